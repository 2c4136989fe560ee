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
"""

from __future__ import annotations

import select
from typing import Any

import psycopg
from django.db.backends.postgresql import base
from django.db.backends.postgresql.base import ServerBindingCursor
from psycopg import OperationalError, pq
from psycopg_pool import ConnectionPool

# Set on a driver connection while Django's transaction on it has run no statement yet.
_BEGIN_PENDING = "_chat_begin_pending"


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


def _begin_alone(conn: psycopg.Connection[Any]) -> None:
    if _take_pending_begin(conn):
        conn.execute("BEGIN")


class _BeginsTransactions:
    """A cursor whose statement that opens a transaction sends its BEGIN with it."""

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        conn = self.connection  # type: ignore[attr-defined]
        if not _take_pending_begin(conn):
            return super().execute(query, params, **kwargs)  # type: ignore[misc]
        if conn.pgconn.pipeline_status != pq.PipelineStatus.OFF:
            conn.execute("BEGIN")  # already in a pipeline: it goes with what follows
            return super().execute(query, params, **kwargs)  # type: ignore[misc]
        with conn.pipeline():
            conn.execute("BEGIN")
            super().execute(query, params, **kwargs)  # type: ignore[misc]
        return self

    def executemany(self, query: Any, params_seq: Any, **kwargs: Any) -> Any:
        _begin_alone(self.connection)  # type: ignore[attr-defined]
        return super().executemany(query, params_seq, **kwargs)  # type: ignore[misc]

    def copy(self, *args: Any, **kwargs: Any) -> Any:
        _begin_alone(self.connection)  # type: ignore[attr-defined]
        return super().copy(*args, **kwargs)  # type: ignore[misc]


class ClientBindingCursor(_BeginsTransactions, base.Cursor):
    """Django's cursor (client-side binding, the ORM's)."""


class ServerBindingCursorBegins(_BeginsTransactions, ServerBindingCursor):
    """Django's server-binding cursor (`sessions_app.rows.cursor`)."""


class DatabaseWrapper(base.DatabaseWrapper):
    # The class of cursors that bind on the server (`sessions_app.rows.cursor`).
    server_binding_cursor = ServerBindingCursorBegins

    def get_connection_params(self) -> dict[str, Any]:
        params = super().get_connection_params()
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

    def _commit(self) -> None:
        super()._commit()  # type: ignore[misc]
        self._rearm()

    def _rollback(self) -> None:
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
        super()._close()  # type: ignore[misc]

    def create_cursor(self, name: str | None = None) -> Any:
        if name and self.connection is not None:
            _begin_alone(self.connection)  # a named cursor's DECLARE
        return super().create_cursor(name)

    @property
    def pool(self) -> Any:
        pool = super().pool
        # Django hands the pool psycopg's own check (`CONN_HEALTH_CHECKS`) when it creates it;
        # the pool keeps it in `_check`, which is where it is swapped for the one above.
        if pool is not None and getattr(pool, "_check", None) is ConnectionPool.check_connection:
            pool._check = check_connection
        return pool
