"""PostgreSQL through Django's connection pool, with a check on borrow that costs no round trip
while the connection is sound (scaled mode, G5, G6).

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
"""

from __future__ import annotations

import select
from typing import Any

from django.db.backends.postgresql import base
from psycopg import OperationalError
from psycopg_pool import ConnectionPool


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


class DatabaseWrapper(base.DatabaseWrapper):
    @property
    def pool(self) -> Any:
        pool = super().pool
        # Django hands the pool psycopg's own check (`CONN_HEALTH_CHECKS`) when it creates it;
        # the pool keeps it in `_check`, which is where it is swapped for the one above.
        if pool is not None and getattr(pool, "_check", None) is ConnectionPool.check_connection:
            pool._check = check_connection
        return pool
