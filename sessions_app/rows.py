"""Row reads and writes in one statement each, for the ones every turn makes (G6).

Writes: each value goes through its field's own conversion for the database
(`get_db_prep_save`, as `Model.save` does), so JSON, UUIDs and datetimes are stored exactly
as the ORM stores them; a text, integer or boolean value already of its field's Python type
is passed as it is, which is what that conversion returns for it. A generated field is the
database's to fill: never written, and loaded by a read, as after `save()`. Reads: the row's
columns go through the converters the ORM's compiler would apply, and the instance is made as
`Model.from_db` makes it, its values set straight into it (`from_row`). What is skipped is
the query compilation, which cost more than the database's own work; the statements' text is
built once per model. The models written here have no signal receivers and client-side
primary keys (UUID or text), so nothing `save()` would do is missed."""

from __future__ import annotations

import contextlib
import datetime
import functools
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.db.models import Field, Model
from django.db.models.base import ModelState
from django.db.models.fields.related_descriptors import ForeignKeyDeferredAttribute
from django.db.models.signals import post_init, pre_init

M = TypeVar("M", bound=Model)

# Field types whose conversion for the database returns a value of this Python type as it is.
_PLAIN: dict[str, type] = {
    "CharField": str,
    "TextField": str,
    "SlugField": str,
    "IntegerField": int,
    "BigIntegerField": int,
    "SmallIntegerField": int,
    "PositiveIntegerField": int,
    "PositiveBigIntegerField": int,
    "PositiveSmallIntegerField": int,
    "BooleanField": bool,
}


# The writes `merged` holds for one statement, per thread (each database thread its own).
_held = threading.local()


@contextlib.contextmanager
def merged() -> Iterator[None]:
    """The `insert`s and `update`s made inside, as one statement at the end on PostgreSQL (the
    first ones as data-modifying WITH clauses of the last): one round trip instead of one
    each. Elsewhere (SQLite has no writes in WITH) each runs at once. For writes that nothing
    inside reads back before the end: the sub-statements share one snapshot, and foreign keys
    are checked at commit (Django makes them deferrable), so a message may name a turn
    inserted beside it. On an error inside, nothing held is run. Inside a transaction the
    statement itself is held in turn, to go with the transaction's next statement or its
    COMMIT: an error in it is raised there, inside the same transaction."""
    conn = connections[DEFAULT_DB_ALIAS]
    if conn.vendor != "postgresql" or _holding() is not None:
        yield
        return
    _held.writes = []
    try:
        yield
        writes: list[tuple[str, list[Any]]] = _held.writes
    finally:
        _held.writes = None
    if not writes:
        return
    sql, params = writes[-1]
    if len(writes) > 1:
        heads = ", ".join(f"w{i} AS ({text})" for i, (text, _p) in enumerate(writes[:-1]))
        sql = f"WITH {heads} {sql}"
        params = [value for _text, values in writes for value in values]
    with cursor() as c:
        hold = getattr(conn, "hold_write", None)
        if hold is not None:
            # Inside a transaction it goes with the next statement or the COMMIT, in one
            # round trip (`chatcore.postgresql.base`).
            hold(c)
        c.execute(sql, params)


@contextlib.contextmanager
def pipelined() -> Iterator[None]:
    """On PostgreSQL, the statements executed inside go to the server in one round trip at
    the end of the block (read their results after it); elsewhere each runs at once."""
    conn = connections[DEFAULT_DB_ALIAS]
    together = getattr(conn, "pipelined", None)
    if together is None:
        yield
        return
    with together():
        yield


def when_commit_sent(fn: Callable[[], object]) -> None:
    """Inside a transaction: run `fn` once its COMMIT is on its way, on PostgreSQL, where the
    COMMIT is a round trip (work handed to another thread then runs while this one waits for
    the server; never when the transaction rolls back first, and what `fn` started goes
    unused should the COMMIT fail); elsewhere now. `fn` must not use the connection."""
    conn = connections[DEFAULT_DB_ALIAS]
    later = getattr(conn, "when_commit_sent", None)
    if later is None or not conn.in_atomic_block:
        fn()
        return
    later(fn)


def _holding() -> list[tuple[str, list[Any]]] | None:
    return getattr(_held, "writes", None)


def _write(sql: str, params: list[Any]) -> None:
    held = _holding()
    if held is not None:
        held.append((sql, params))
        return
    with cursor() as c:
        c.execute(sql, params)


def cursor() -> CursorWrapper:
    """A cursor for the statements written in SQL (here, and the engine's on our own tables).

    On PostgreSQL it binds parameters on the server, so a pooled connection prepares a
    statement it has run a few times (`OPTIONS["prepare_threshold"]`, settings) and the server
    parses and plans it once, not on every turn: planning the turn's statements cost more
    than running them. The ORM keeps Django's client-side binding, which some of its
    expressions need (a parameter whose type only the client knows). Elsewhere (SQLite, which
    caches its statements itself) Django's own cursor."""
    conn = connections[DEFAULT_DB_ALIAS]
    if conn.vendor != "postgresql":
        return conn.cursor()
    from django.db.backends.postgresql.base import ServerBindingCursor

    # This project's backend begins a transaction with its first statement, through its own
    # cursor classes (`chatcore.postgresql.base`); Django's plain backend has none.
    binding = getattr(conn, "server_binding_cursor", ServerBindingCursor)
    # Django's own cursor (time zone, debug wrapper, error wrapping), made by the server-binding
    # class: the connection's cursor class is swapped for this one call, on this thread's
    # connection, and put back.
    conn.ensure_connection()
    raw = conn.connection
    client = raw.cursor_factory
    raw.cursor_factory = binding
    try:
        return conn.cursor()
    finally:
        raw.cursor_factory = client


# Per vendor, field types whose conversion returns a value of this Python type as it is
# there: the driver adapts it (a UUID where the database has a native type, an aware datetime
# on PostgreSQL).
_PLAIN_ON: dict[str, dict[str, type]] = {
    "postgresql": {"UUIDField": uuid.UUID, "DateTimeField": datetime.datetime},
}


@functools.cache
def _plain_type(field: Field[Any, Any], vendor: str) -> type | None:
    """The Python type whose values `field` stores unconverted on `vendor`, or None (convert
    always). A datetime only when aware, which `_db_values` checks."""
    if getattr(field, "auto_now", False) or getattr(field, "auto_now_add", False):
        return None  # `pre_save` sets the value
    target = field.target_field if field.is_relation else field  # type: ignore[attr-defined]
    internal = target.get_internal_type()
    return _PLAIN.get(internal) or _PLAIN_ON.get(vendor, {}).get(internal)


@functools.cache
def _value_plan(
    model: type[Model], vendor: str, names: tuple[str, ...] | None
) -> list[tuple[str, type | None, Field[Any, Any]]]:
    """Per field written (`names`, or all `_written`): its attribute, `_plain_type`, field."""
    fields = _written(model) if names is None else _named(model, names)
    return [(f.attname, _plain_type(f, vendor), f) for f in fields]


def _db_values(
    plan: list[tuple[str, type | None, Field[Any, Any]]],
    obj: Model,
    add: bool,
    conn: BaseDatabaseWrapper,
    out: list[Any],
) -> None:
    """`obj`'s values for `plan`'s fields as `Model.save` would send them, onto `out`: a
    value of its field's plain type as it is (an aware datetime only), any other through the
    field's own conversion. One loop, no call per plain value: a turn's start writes 42."""
    for attname, plain, field in plan:
        value = getattr(obj, attname)
        if value is None:
            if plain is not None:
                out.append(None)
                continue
        else:
            kind = type(value)
            if kind is plain and (kind is not datetime.datetime or value.utcoffset() is not None):
                out.append(value)
                continue
        out.append(field.get_db_prep_save(field.pre_save(obj, add=add), conn))


def _quote(conn: BaseDatabaseWrapper, name: str | None) -> str:
    assert name is not None
    return conn.ops.quote_name(name)


def _fields(model: type[Model]) -> list[Field[Any, Any]]:
    return list(model._meta.concrete_fields)


def _written(model: type[Model]) -> list[Field[Any, Any]]:
    """The fields an INSERT gives values to: not those the database computes (generated)."""
    return [f for f in _fields(model) if not f.generated]


@functools.cache
def _insert_sql(model: type[Model], vendor: str, count: int) -> str:
    opts = model._meta
    columns = ", ".join(_quote(connection, f.column) for f in _written(model))
    marks = "(" + ", ".join(["%s"] * len(_written(model))) + ")"
    return (
        f"INSERT INTO {_quote(connection, opts.db_table)} ({columns})"  # noqa: S608
        f" VALUES {', '.join([marks] * count)}"
    )


def insert(objs: Sequence[Model]) -> None:
    """INSERT `objs` (all of one model, primary keys already set) in one statement."""
    if not objs:
        return
    model = type(objs[0])
    opts = model._meta
    if opts.pk is None or opts.pk.db_returning:
        raise ValueError(f"{opts.label}: rows.insert needs a client-side primary key")
    conn = connections[DEFAULT_DB_ALIAS]
    plan = _value_plan(model, conn.vendor, None)
    params: list[Any] = []
    for obj in objs:
        _db_values(plan, obj, True, conn, params)
    _write(_insert_sql(model, conn.vendor, len(objs)), params)
    for obj in objs:
        obj._state.adding = False
        obj._state.db = conn.alias


@functools.cache
def _update_sql(model: type[Model], vendor: str, names: tuple[str, ...]) -> str:
    opts = model._meta
    assert opts.pk is not None
    sets = ", ".join(f"{_quote(connection, f.column)} = %s" for f in _named(model, names))
    return (
        f"UPDATE {_quote(connection, opts.db_table)} SET {sets}"  # noqa: S608
        f" WHERE {_quote(connection, opts.pk.column)} = %s"
    )


@functools.cache
def _named(model: type[Model], names: tuple[str, ...]) -> list[Field[Any, Any]]:
    fields = [model._meta.get_field(name) for name in names]
    assert all(isinstance(f, Field) for f in fields)
    return fields  # type: ignore[return-value]


def update(obj: Model, names: Iterable[str]) -> None:
    """UPDATE the given fields of `obj`'s row (by primary key) in one statement."""
    model = type(obj)
    opts = model._meta
    assert opts.pk is not None
    names = tuple(names)
    conn = connections[DEFAULT_DB_ALIAS]
    params: list[Any] = []
    _db_values(_value_plan(model, conn.vendor, names), obj, False, conn, params)
    params.append(opts.pk.get_db_prep_value(obj.pk, conn))
    _write(_update_sql(model, conn.vendor, names), params)


# --- Reads ------------------------------------------------------------------------------------


@functools.cache
def columns(model: type[Model], alias: str) -> str:
    """The model's columns for a SELECT, in the order `from_row` reads them, qualified by the
    table alias `alias`."""
    return ", ".join(f"{alias}.{_quote(connection, f.column)}" for f in _fields(model))


Converter = Callable[[Any, Any, BaseDatabaseWrapper], Any]


@functools.cache
def _converters(model: type[Model], vendor: str) -> list[tuple[int, list[Converter], Any]]:
    """Per column that needs any: its index, the converters the compiler would apply (the
    backend's, then the field's own), and the expression they are given."""
    out = []
    for i, field in enumerate(_fields(model)):
        col = field.get_col(model._meta.db_table)
        found = connection.ops.get_db_converters(col) + field.get_db_converters(connection)
        if found:
            out.append((i, found, col))
    return out


@functools.cache
def _set_directly(model: type[Model]) -> tuple[str, ...] | None:
    """The attribute names `from_row` sets a `model` instance's values under, when setting
    them straight into its `__dict__` is what `Model.__init__` would do: the model keeps
    Django's `__init__` and `from_db`, and no value goes through a descriptor of its own (a
    foreign key's id does, but only to forget a cached related object, which a new instance
    has not got). None otherwise: the instance is made by `from_db`."""
    if model.__init__ is not Model.__init__ or model.from_db.__func__ is not (  # type: ignore[attr-defined]
        Model.from_db.__func__  # type: ignore[attr-defined]
    ):
        return None
    names = tuple(f.attname for f in _fields(model))
    for name in names:
        found = getattr(model, name, None)
        if hasattr(type(found), "__set__") and type(found) is not ForeignKeyDeferredAttribute:
            return None
    return names


def from_row(model: type[M], row: Sequence[Any]) -> M:
    """A `model` instance from the first columns of `row` (selected with `columns`), as the
    ORM would build it; the columns after those are the caller's. Made as `Model.__init__`
    makes it, without its steps per field (`_set_directly`), which a long history's read
    pays once per message."""
    conn = connections[DEFAULT_DB_ALIAS]
    values = list(row[: len(model._meta.concrete_fields)])
    for i, found, col in _converters(model, conn.vendor):
        value = values[i]
        for convert in found:
            value = convert(value, col, conn)
        values[i] = value
    names = _set_directly(model)
    if names is None:
        return model.from_db(conn.alias, (), values)
    pre_init.send(sender=model, args=tuple(values), kwargs={})
    obj = model.__new__(model)
    state = obj.__dict__["_state"] = ModelState()
    obj.__dict__.update(zip(names, values, strict=True))
    post_init.send(sender=model, instance=obj)
    state.adding = False
    state.db = conn.alias
    return obj
