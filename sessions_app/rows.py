"""Writes of model rows in one statement each, for the writes every turn makes (G6).

Each value goes through its field's own conversion for the database (`get_db_prep_save`, as
`Model.save` does), so JSON, UUIDs and datetimes are stored exactly as the ORM stores them;
what is skipped is the query compilation, which cost more than the database's own work. The
models written here have no signal receivers and client-side primary keys (UUID or text), so
nothing `save()` would do is missed."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from django.db import connection
from django.db.models import Field, Model


def _quote(name: str | None) -> str:
    assert name is not None
    return connection.ops.quote_name(name)


def insert(objs: Sequence[Model]) -> None:
    """INSERT `objs` (all of one model, primary keys already set) in one statement."""
    if not objs:
        return
    opts = type(objs[0])._meta
    if opts.pk is None or opts.pk.db_returning:
        raise ValueError(f"{opts.label}: rows.insert needs a client-side primary key")
    quote = _quote
    fields = list(opts.concrete_fields)
    marks = "(" + ", ".join(["%s"] * len(fields)) + ")"
    sql = (
        f"INSERT INTO {quote(opts.db_table)} ({', '.join(quote(f.column) for f in fields)})"  # noqa: S608
        f" VALUES {', '.join([marks] * len(objs))}"
    )
    params = [
        field.get_db_prep_save(field.pre_save(obj, add=True), connection)
        for obj in objs
        for field in fields
    ]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
    for obj in objs:
        obj._state.adding = False
        obj._state.db = connection.alias


def update(obj: Model, names: Iterable[str]) -> None:
    """UPDATE the given fields of `obj`'s row (by primary key) in one statement."""
    opts = obj._meta
    assert opts.pk is not None
    quote = _quote
    fields = [opts.get_field(name) for name in names]
    assert all(isinstance(f, Field) for f in fields)
    sets = ", ".join(f"{quote(f.column)} = %s" for f in fields)  # type: ignore[union-attr]
    sql = f"UPDATE {quote(opts.db_table)} SET {sets} WHERE {quote(opts.pk.column)} = %s"  # noqa: S608
    params = [
        f.get_db_prep_save(f.pre_save(obj, add=False), connection)  # type: ignore[union-attr]
        for f in fields
    ]
    params.append(opts.pk.get_db_prep_value(obj.pk, connection))
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
