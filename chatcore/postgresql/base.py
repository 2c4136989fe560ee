"""PostgreSQL through Django's connection pool, with a check on borrow that costs no round trip
while the connection is sound, and transactions begun by their first statement (scaled mode,
G5, G6).

Django's pool (`OPTIONS["pool"]`, psycopg's) checks every connection it lends with an empty
query: a round trip to the server on every database call, about ten a turn, each of them a
wake-up of a server process on a machine the server shares. A connection the server ended
while it sat idle in the pool (a restart, `pg_terminate_backend`, an idle timeout) has had
its socket readable since then: the server's goodbye, or the end of the stream. So the check
here first asks the socket: nothing to read means nothing happened, and the connection is
lent without a query; anything to read (the goodbye, or a rare notice) gets the pool's own
check, which fails for an ended connection, so the pool replaces it. What neither check can
see at once (a network that drops packets without a word) stays with TCP's own timeouts, as
it was.

A transaction Django opens (`atomic`) cost a round trip of its own before its first statement:
psycopg sends BEGIN and waits for it (in pipeline mode too). Here the driver stays in
autocommit, and the first statement of a transaction goes with its BEGIN in one pipeline: one
round trip, which on a busy machine is milliseconds (every turn runs four or five
transactions). A transaction that runs no statement sends nothing; commit and rollback go by
the server's transaction status, as psycopg's always do. Statements that do not go through a
cursor's `execute` (`executemany`, a named cursor's DECLARE, `copy`) send their BEGIN on its
own first, as before. Django declares a named cursor (`QuerySet.iterator`) WITH HOLD when the
driver is in autocommit, so here also inside a transaction: the same rows, kept a little
longer at commit (nothing in this project iterates with one).

A write that reads nothing back can be held, inside a transaction, to go with whatever the
connection sends next (`hold_write`, for one cursor's next statement): the next statement,
in one pipeline, or the COMMIT. `sessions_app.rows.merged` holds its statement so, which
makes a turn's admission and its commit one round trip shorter. Django sees the statement
when it is made (query logging, execute wrappers); an error in it is raised by the statement
or the commit it went with, inside the same `atomic` block, which then rolls back as for any
failed commit. A rollback or a closed connection drops what is held unsent. Statements sent
together on purpose (`pipelined`: a row lock and the statement that must run after it) cost
one round trip.

Timestamps are read by psycopg's own compiled loader. Django's (`psycopg_any.BaseTzLoader`)
subclasses psycopg's pure-Python one to set the time zone it returns, which made every
`timestamptz` value about 3 µs of parsing in Python: every message of a history read, every
turn row. With `USE_TZ` and no `TIME_ZONE` of the database's own (this project's settings),
Django's time zone is UTC and so is the connection's (Django sets it on every connection), so
the compiled loader's values are already Django's: the same instant, `timezone.utc` as their
`tzinfo`. Any other setting keeps Django's loader.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import select
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from django.db.backends.postgresql import base
from django.db.backends.postgresql.base import ServerBindingCursor
from django.db.backends.utils import debug_transaction
from psycopg import OperationalError, abc, adapt, pq
from psycopg_pool import ConnectionPool

logger = logging.getLogger(__name__)

# Set on a driver connection while Django's transaction on it has run no statement yet.
_BEGIN_PENDING = "_chat_begin_pending"
_LOGGED = "logged"  # a cursor's `_chat_hold` when Django logs queries: its text is kept
# The writes held on a driver connection: (cursor class, query, params, execute's kwargs).
_HELD = "_chat_held"

# psycopg's own loader of `timestamptz` text: its compiled one where psycopg has it.
_TIMESTAMPTZ_OID = psycopg.adapters.types["timestamptz"].oid
_PARSE_TIMESTAMPTZ = psycopg.adapters.get_loader(_TIMESTAMPTZ_OID, pq.Format.TEXT)


class UtcTimestamptzLoader(adapt.Loader):
    """`timestamptz` as Django reads it with `USE_TZ` and UTC (aware, `UTC` as its `tzinfo`),
    parsed by psycopg's own loader. On a connection whose time zone is UTC (Django sets it
    so) the parsed value needs nothing more, and `load` is the compiled loader's own, with no
    Python frame per value."""

    timezone = datetime.UTC  # what Django's `create_cursor` compares

    def __init__(self, oid: int, context: abc.AdaptContext | None = None) -> None:
        super().__init__(oid, context)
        self._parse = _PARSE_TIMESTAMPTZ(oid, context).load  # type: ignore[misc]
        if self.connection is not None and self.connection.info.timezone is self.timezone:
            self.load = self._parse  # type: ignore[method-assign]

    def load(self, data: Any) -> datetime.datetime:
        return self._parse(data).replace(tzinfo=self.timezone)


@functools.lru_cache
def _utc_adapters(django_template: adapt.AdaptersMap) -> adapt.AdaptersMap:
    """Django's adapters (`psycopg_any.get_adapters_template`) with `UtcTimestamptzLoader`."""
    adapters = adapt.AdaptersMap(django_template)
    adapters.register_loader("timestamptz", UtcTimestamptzLoader)
    return adapters


def check_connection(conn: Any) -> None:
    """The pool's `check`: quiet for a sound connection, `OperationalError` for one the
    server ended (the pool then opens another)."""
    if conn.closed or conn.broken:
        raise OperationalError("the connection is closed")
    if _readable(conn.pgconn.socket):
        ConnectionPool.check_connection(conn)


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))


def _take_pending_begin(conn: psycopg.Connection[Any]) -> bool:
    """True once for the first statement of a transaction Django opened on `conn`."""
    if not getattr(conn, _BEGIN_PENDING, False):
        return False
    setattr(conn, _BEGIN_PENDING, False)
    return conn.pgconn.transaction_status == pq.TransactionStatus.IDLE


def _take_held(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    held: list[tuple[Any, ...]] = getattr(conn, _HELD, None) or []
    if held:
        setattr(conn, _HELD, None)
    return held


def _drop_held(conn: psycopg.Connection[Any] | None) -> None:
    if conn is not None:
        setattr(conn, _HELD, None)


def _send_first(conn: psycopg.Connection[Any], begin: bool, held: list[tuple[Any, ...]]) -> None:
    """Queue, in the pipeline `conn` is in, what must go before the next statement."""
    if begin:
        conn.execute("BEGIN")
    for cursor_class, query, params, kwargs in held:
        cursor_class(conn).execute(query, params, **kwargs)


def _send_pending_alone(conn: psycopg.Connection[Any]) -> None:
    """Send a pending BEGIN and the held writes before a statement that cannot go with them
    in a pipeline (`executemany`, `copy`, a named cursor's DECLARE)."""
    begin, held = _take_pending_begin(conn), _take_held(conn)
    if held:
        with conn.pipeline():
            _send_first(conn, begin, held)
    elif begin:
        conn.execute("BEGIN")


def _to_hold(conn: psycopg.Connection[Any]) -> bool:
    """True inside a transaction already begun on the server, outside a pipeline; a
    statement to hold runs at once anywhere else."""
    return (
        not getattr(conn, _BEGIN_PENDING, False)
        and conn.pgconn.transaction_status == pq.TransactionStatus.INTRANS
        and conn.pgconn.pipeline_status == pq.PipelineStatus.OFF
    )


class _BeginsTransactions:
    """A cursor whose statement that opens a transaction sends its BEGIN with it, and any
    held writes before it, in one pipeline."""

    # Set for this cursor's next statement only (`DatabaseWrapper.hold_write`).
    _chat_hold: bool | str = False

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        conn = self.connection  # type: ignore[attr-defined]
        hold = self._chat_hold
        if hold:
            self._chat_hold = False
            if _to_hold(conn):
                self._hold(conn, query, params, kwargs, logged=hold == _LOGGED)
                return self
        begin, held = _take_pending_begin(conn), _take_held(conn)
        if not begin and not held:
            return super().execute(query, params, **kwargs)  # type: ignore[misc]
        if conn.pgconn.pipeline_status != pq.PipelineStatus.OFF:
            _send_first(conn, begin, held)  # already in a pipeline: they go with what follows
            return super().execute(query, params, **kwargs)  # type: ignore[misc]
        with conn.pipeline():
            _send_first(conn, begin, held)
            super().execute(query, params, **kwargs)  # type: ignore[misc]
        return self

    def _hold(
        self, conn: psycopg.Connection[Any], query: Any, params: Any, kwargs: Any, *, logged: bool
    ) -> None:
        held = getattr(conn, _HELD, None)
        if held is None:
            held = []
            setattr(conn, _HELD, held)
        held.append((type(self), query, params, kwargs))
        if logged:  # the statement's text, for Django's query log (`last_executed_query`)
            text = self._query_cls(adapt.Transformer(self))  # type: ignore[attr-defined,arg-type]
            text.convert(query, params)
            self._query = text

    def executemany(self, query: Any, params_seq: Any, **kwargs: Any) -> Any:
        _send_pending_alone(self.connection)  # type: ignore[attr-defined]
        return super().executemany(query, params_seq, **kwargs)  # type: ignore[misc]

    def copy(self, *args: Any, **kwargs: Any) -> Any:
        _send_pending_alone(self.connection)  # type: ignore[attr-defined]
        return super().copy(*args, **kwargs)  # type: ignore[misc]


class ClientBindingCursor(_BeginsTransactions, base.Cursor):
    """Django's cursor (client-side binding, the ORM's)."""


class ServerBindingCursorBegins(_BeginsTransactions, ServerBindingCursor):
    """Django's server-binding cursor (`sessions_app.rows.cursor`)."""


class DatabaseWrapper(base.DatabaseWrapper):
    # The class of cursors that bind on the server (`sessions_app.rows.cursor`).
    server_binding_cursor = ServerBindingCursorBegins

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Steps to run once this transaction's COMMIT is sent (`when_commit_sent`), with the
        # savepoints each was added under.
        self._on_commit_sent: list[tuple[set[str], Callable[[], object]]] = []

    def get_connection_params(self) -> dict[str, Any]:
        params = super().get_connection_params()
        if self.timezone is datetime.UTC:  # USE_TZ, no TIME_ZONE of its own
            params["context"] = _utc_adapters(params["context"])
        params["cursor_factory"] = (
            ServerBindingCursorBegins
            if params.get("cursor_factory") is ServerBindingCursor
            else ClientBindingCursor
        )
        return params

    def _set_autocommit(self, autocommit: bool) -> None:
        # The driver stays in autocommit; a transaction is begun by its first statement.
        conn = self.connection
        if not conn.autocommit:
            with self.wrap_database_errors:
                conn.autocommit = True
        setattr(conn, _BEGIN_PENDING, not autocommit)

    def hold_write(self, cursor: Any) -> None:
        """Hold `cursor`'s next statement, a write whose result nothing reads, to go with
        the next one this connection sends (a statement or the COMMIT) in one pipeline. Only
        inside a transaction that has begun; otherwise the statement runs at once. `cursor`:
        Django's cursor on this connection."""
        raw = cursor.cursor
        if isinstance(raw, _BeginsTransactions) and self.in_atomic_block:
            raw._chat_hold = _LOGGED if self.queries_logged else True

    @contextlib.contextmanager
    def pipelined(self) -> Iterator[None]:
        """The statements executed inside go to the server together, in one round trip at
        the end of the block; their results are read after it. Each still runs on its own
        snapshot, in order (a lock waited for by one is held when the next one runs)."""
        self.ensure_connection()
        with self.wrap_database_errors, self.connection.pipeline():
            yield

    def when_commit_sent(self, fn: Callable[[], object]) -> None:
        """Run `fn` once this transaction's COMMIT is on its way to the server, before its
        answer is back: work for another thread handed over then runs while this one waits
        for the server, rather than taking the interpreter lock from it between the COMMIT's
        own steps. Never when the transaction (or the savepoint `fn` was added in) rolls
        back first; should the server then refuse the COMMIT, what `fn` started goes unused
        (its caller keeps nothing of a transaction that did not commit). An error of `fn`
        is logged; the COMMIT goes on. `fn` must not use this connection."""
        # Under the savepoints open now: one rolled back takes the step with it (as
        # Django's `on_commit` does).
        self._on_commit_sent.append((set(self.savepoint_ids), fn))

    def savepoint_rollback(self, sid: str) -> None:
        super().savepoint_rollback(sid)
        self._on_commit_sent = [(ids, fn) for ids, fn in self._on_commit_sent if sid not in ids]

    def _commit_sent(self) -> None:
        waiting, self._on_commit_sent = self._on_commit_sent, []
        for _ids, fn in waiting:
            try:
                fn()
            except Exception:
                logger.exception("a step to run once the COMMIT was sent failed")

    def _commit(self) -> None:
        held = _take_held(self.connection) if self.connection is not None else []
        if not held:
            self._commit_sent()  # the COMMIT is the next thing sent
            super()._commit()  # type: ignore[misc]
        else:
            # The held writes and the COMMIT in one pipeline: an error in a write aborts the
            # COMMIT and is raised here (`atomic` then rolls back).
            with debug_transaction(self, "COMMIT"), self.wrap_database_errors:
                with self.connection.pipeline():
                    _send_first(self.connection, False, held)
                    self.connection.execute("COMMIT")
                    # Written to the socket by now; its answer is read at the pipeline's end.
                    self._commit_sent()
        self._rearm()

    def _rollback(self) -> None:
        _drop_held(self.connection)
        self._on_commit_sent = []
        super()._rollback()  # type: ignore[misc]
        self._rearm()

    def _rearm(self) -> None:
        # Outside `atomic` (Django's autocommit turned off by hand), the next statement after
        # a commit or rollback opens the next transaction, as the driver's own mode does.
        if self.connection is not None and not self.get_autocommit():
            setattr(self.connection, _BEGIN_PENDING, True)

    def _close(self) -> None:
        # A connection goes back to the pool with no transaction pending on it: the pool's
        # check on its next borrow must not begin one.
        if self.connection is not None:
            setattr(self.connection, _BEGIN_PENDING, False)
            _drop_held(self.connection)
        self._on_commit_sent = []  # its transaction ends with it
        super()._close()  # type: ignore[misc]

    def create_cursor(self, name: str | None = None) -> Any:
        if name and self.connection is not None:
            _send_pending_alone(self.connection)  # before a named cursor's DECLARE
        return super().create_cursor(name)

    @property
    def pool(self) -> Any:
        pool = super().pool
        # Django hands the pool psycopg's own check (`CONN_HEALTH_CHECKS`) when it creates it;
        # the pool keeps it in `_check`, which is where it is swapped for the one above.
        if pool is not None and getattr(pool, "_check", None) is ConnectionPool.check_connection:
            pool._check = check_connection
        return pool
