"""The row writes every turn makes, one statement each, and several as one on PostgreSQL
(`merged`); the statements written in SQL, their cursor (`cursor`: bound and prepared on the
server), several sent in one round trip (`pipelined`), and the rows they read made into
instances (`columns`, `from_row`). SPEC G6, I1, I2.

Why not the ORM (`bulk_create`, `save(update_fields=...)`): measured beside it in one run
(`bench/notes/database.md`; Django 5.2.20, psycopg 3.3.9, PostgreSQL 15), its statement per
write made a 100-stream burst's first-token p99 287 ms against 192 and cost a fifth more
CPU a turn; Django's client-side binding (no prepared statements) added a third to the time
to first token.

Writes: each value goes through its field's own conversion for the database
(`get_db_prep_save`, as `Model.save` does; a text, integer or boolean value already of its
field's type is what that conversion returns), so rows are stored exactly as the ORM stores
them; a generated field is the database's to fill. An update names its row by primary key
and must match it: one that matches no row (the row was deleted, or inserted by the same
merged statement, whose parts all see the snapshot from before it) raises `DatabaseError`,
as `save(update_fields=...)` does, and its transaction then commits nothing. Public APIs
only: the fields' conversions, `Model._state` (documented), `Model.from_db`, the converters
Django's compiler applies (`DatabaseOperations.get_db_converters`,
`Field.get_db_converters`), psycopg's `Connection.pipeline`, `Connection.cursor_factory` and
`Cursor`."""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.db.models import Field, GeneratedField, Model
from django.db.models.base import ModelState
from django.db.models.fields.related_descriptors import ForeignKeyDeferredAttribute
from django.db.models.query_utils import DeferredAttribute
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


@dataclass(frozen=True, slots=True)
class _Write:
    sql: str
    params: list[Any]
    # An update: what its one row is, for the error when it matches none.
    row: str | None = None


# Per thread (each database thread its own): the writes `merged` holds for its statement, and
# the checks of the statements sent inside `pipelined`, made once their results are back.
_local = threading.local()


def _holding() -> list[_Write] | None:
    return getattr(_local, "writes", None)


def _checks() -> list[Callable[[], None]] | None:
    return getattr(_local, "checks", None)


@contextlib.contextmanager
def merged() -> Iterator[None]:
    """The `insert`s and `update`s made inside, as one statement at the end of the block on
    PostgreSQL (the first ones as data-modifying WITH clauses of the last): one round trip
    instead of one each. Elsewhere (SQLite has no writes in WITH) each runs at once. For
    writes that nothing inside reads back before the end: the parts share one snapshot, so
    an update of a row inserted in the same block matches nothing (and raises); foreign keys
    are checked at commit (Django makes them deferrable), so a message may name a turn
    inserted beside it. On an error inside, nothing held is run."""
    conn = connections[DEFAULT_DB_ALIAS]
    if conn.vendor != "postgresql" or _holding() is not None:
        yield
        return
    _local.writes = []
    try:
        yield
        writes: list[_Write] = _local.writes
    finally:
        _local.writes = None
    if len(writes) == 1:
        _run(writes[0])
    elif writes:
        _run_merged(writes)


def _run(write: _Write) -> None:
    c = cursor()
    c.execute(write.sql, write.params)
    if write.row is None:
        c.close()
        return
    _after_results(c, lambda: [c.rowcount], [write.row])


def _run_merged(writes: list[_Write]) -> None:
    """One statement: every write a WITH clause, each update returning its row, then their
    counts (all writes run whether or not the counts read them)."""
    heads, counts = [], []
    for i, write in enumerate(writes):
        returning = " RETURNING 1" if write.row is not None else ""
        heads.append(f"w{i} AS ({write.sql}{returning})")
        if write.row is not None:
            counts.append(f"(SELECT count(*) FROM w{i})")  # noqa: S608 (clause names)
    sql = f"WITH {', '.join(heads)} SELECT {', '.join(counts) or '0'}"
    params = [value for write in writes for value in write.params]
    c = cursor()
    c.execute(sql, params)
    rows = [w.row for w in writes if w.row is not None]
    _after_results(c, lambda: list(c.fetchone() or ()), rows)


def _after_results(c: CursorWrapper, counted: Callable[[], list[int]], rows: list[str]) -> None:
    """Check that each update matched its row, once the statement's results are back: at
    once, or at the end of the `pipelined` block it was sent in."""

    def check() -> None:
        try:
            found = counted()
        finally:
            c.close()
        for row, count in zip(rows, found, strict=True):
            if count != 1:
                raise DatabaseError(f"{row}: the update matched {count} rows, not 1")

    waiting = _checks()
    if waiting is not None:
        waiting.append(check)
    else:
        check()


def _write(write: _Write) -> None:
    held = _holding()
    if held is not None:
        held.append(write)
    else:
        _run(write)


@contextlib.contextmanager
def pipelined() -> Iterator[None]:
    """On PostgreSQL, the statements executed inside go to the server together, in one round
    trip at the end of the block (psycopg's pipeline mode); read their results after it.
    Each still runs on its own snapshot, in order: a lock waited for by one is held when the
    next one runs. The updates sent inside (`update`, `merged`) are checked once their
    results are back, before the block ends. Elsewhere each runs at once. Not for the ORM's
    writes whose row count their caller reads (it would read none yet)."""
    conn = connections[DEFAULT_DB_ALIAS]
    if conn.vendor != "postgresql":
        yield
        return
    conn.ensure_connection()
    outer = _checks()
    checks: list[Callable[[], None]] = [] if outer is None else outer
    _local.checks = checks
    try:
        with conn.wrap_database_errors, conn.connection.pipeline():
            yield
    finally:
        _local.checks = outer
    if outer is None:
        for check in checks:
            check()


def cursor() -> CursorWrapper:
    """A cursor for the statements written in SQL (here, and the engine's on our own tables).

    On PostgreSQL it binds parameters on the server (psycopg's `Cursor`), so a pooled
    connection prepares a statement it has run a few times (`OPTIONS["prepare_threshold"]`,
    settings) and the server parses and plans it once, not on every turn: planning the
    turn's statements cost more than running them. The ORM keeps Django's client-side
    binding, which some of its expressions need (a parameter whose type only the client
    knows). Elsewhere (SQLite, which caches its statements itself) Django's own cursor."""
    conn = connections[DEFAULT_DB_ALIAS]
    if conn.vendor != "postgresql":
        return conn.cursor()
    import psycopg

    # Django's own cursor wrapper (time zone, debug log, error wrapping) around a cursor of
    # psycopg's server-binding class: the connection's cursor class is swapped for this one
    # call, on this thread's connection, and put back.
    conn.ensure_connection()
    raw = conn.connection
    client = raw.cursor_factory
    raw.cursor_factory = psycopg.Cursor
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


def _quote(name: str | None) -> str:
    assert name is not None
    return connection.ops.quote_name(name)


def _fields(model: type[Model]) -> list[Field[Any, Any]]:
    return list(model._meta.concrete_fields)


def _written(model: type[Model]) -> list[Field[Any, Any]]:
    """The fields an INSERT gives values to: not those the database computes (generated)."""
    return [f for f in _fields(model) if not isinstance(f, GeneratedField)]


@functools.cache
def _insert_sql(model: type[Model], vendor: str, count: int) -> str:
    opts = model._meta
    columns = ", ".join(_quote(f.column) for f in _written(model))
    marks = "(" + ", ".join(["%s"] * len(_written(model))) + ")"
    return (
        f"INSERT INTO {_quote(opts.db_table)} ({columns})"  # noqa: S608
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
    _write(_Write(_insert_sql(model, conn.vendor, len(objs)), params))
    for obj in objs:
        obj._state.adding = False
        obj._state.db = conn.alias


@functools.cache
def _update_sql(model: type[Model], vendor: str, names: tuple[str, ...]) -> str:
    opts = model._meta
    assert opts.pk is not None
    sets = ", ".join(f"{_quote(f.column)} = %s" for f in _named(model, names))
    return (
        f"UPDATE {_quote(opts.db_table)} SET {sets}"  # noqa: S608
        f" WHERE {_quote(opts.pk.column)} = %s"
    )


@functools.cache
def _named(model: type[Model], names: tuple[str, ...]) -> list[Field[Any, Any]]:
    fields = [model._meta.get_field(name) for name in names]
    assert all(isinstance(f, Field) for f in fields)
    return fields  # type: ignore[return-value]


def update(obj: Model, names: Iterable[str]) -> None:
    """UPDATE the given fields of `obj`'s row (by primary key) in one statement. A row it
    does not match raises `DatabaseError` (at once, at the end of its `merged` block, or of
    the `pipelined` block that sent it)."""
    model = type(obj)
    opts = model._meta
    assert opts.pk is not None
    names = tuple(names)
    conn = connections[DEFAULT_DB_ALIAS]
    params: list[Any] = []
    _db_values(_value_plan(model, conn.vendor, names), obj, False, conn, params)
    params.append(opts.pk.get_db_prep_value(obj.pk, conn))
    _write(_Write(_update_sql(model, conn.vendor, names), params, row=f"{opts.label} {obj.pk}"))


# --- Reads ------------------------------------------------------------------------------------


@functools.cache
def columns(model: type[Model], alias: str) -> str:
    """The model's columns for a SELECT, in the order `from_row` reads them, qualified by the
    table alias `alias`."""
    return ", ".join(f"{alias}.{_quote(f.column)}" for f in _fields(model))


Converter = Callable[[Any, Any, BaseDatabaseWrapper], Any]


@functools.cache
def _converters(model: type[Model], vendor: str) -> list[tuple[int, list[Converter], Any]]:
    """Per column that needs any: its index, the converters the ORM's compiler applies to it
    (the backend's, then the field's own), and the expression they are given."""
    out = []
    for i, field in enumerate(_fields(model)):
        col = field.get_col(model._meta.db_table)
        found = connection.ops.get_db_converters(col) + field.get_db_converters(connection)
        if found:
            out.append((i, found, col))
    return out


@functools.cache
def _attnames(model: type[Model]) -> tuple[str, ...]:
    return tuple(f.attname for f in _fields(model))


# The descriptors a plain model's concrete fields have: they read and write the value kept
# under the field's attname in the instance's `__dict__`, and nothing else for a new instance.
_PLAIN_DESCRIPTORS = (DeferredAttribute, ForeignKeyDeferredAttribute)


@functools.cache
def _plain(model: type[Model]) -> bool:
    """Whether `Model.__init__` would do no more for a row of `model` than put each value in
    the instance's `__dict__` under a `ModelState` (and send `pre_init` and `post_init`): the
    model keeps Django's `__init__`, `from_db` and `__setattr__`, and each concrete field's
    attribute is Django's plain descriptor (a foreign key's id included; a file or image
    field, whose descriptor does more, is not plain)."""
    if (
        model.__init__ is not Model.__init__
        or model.__setattr__ is not Model.__setattr__
        or getattr(model.from_db, "__func__", None) is not Model.from_db.__func__  # type: ignore[attr-defined]
    ):
        return False
    return all(
        type(inspect.getattr_static(model, f.attname, None)) in _PLAIN_DESCRIPTORS
        for f in _fields(model)
    )


def from_row(model: type[M], row: Sequence[Any]) -> M:
    """A `model` instance from the first columns of `row` (selected with `columns`), made as
    the ORM makes one (`Model.from_db`); the columns after those are the caller's.

    For a plain model (`_plain`) whose `pre_init` and `post_init` nobody listens to, the
    values go straight into the instance's `__dict__`, as `Model.__init__` would put them
    there one `setattr` at a time: 40% of a message's making on PostgreSQL (issue 57, a
    fresh storm's pages). Anything else goes through `from_db`."""
    conn = connections[DEFAULT_DB_ALIAS]
    values = list(row[: len(model._meta.concrete_fields)])
    for i, found, col in _converters(model, conn.vendor):
        value = values[i]
        for convert in found:
            value = convert(value, col, conn)
        values[i] = value
    if not _plain(model) or pre_init.has_listeners(model) or post_init.has_listeners(model):
        return model.from_db(conn.alias, _attnames(model), values)
    obj = model.__new__(model)
    state = ModelState()
    state.adding, state.db = False, conn.alias
    obj._state = state
    obj.__dict__.update(zip(_attnames(model), values, strict=True))
    return obj
