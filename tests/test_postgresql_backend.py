"""Scaled mode's PostgreSQL backend (`chatcore/postgresql/base.py`): the pool lends a sound
connection without a round trip, and still replaces one the server ended while it sat in the
pool (G5)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.db import connection, connections
from psycopg import OperationalError

from chatcore.postgresql.base import check_connection
from tests.conftest import IN_CI

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]


@pytest.fixture
def pool() -> Any:
    if connection.vendor != "postgresql":
        reason = "the PostgreSQL backend (run with DATABASE_URL set, as pass 2 of make test does)"
        if IN_CI:
            pytest.fail(reason + " (CI must run it)")
        pytest.skip(reason)
    pool = connection.pool
    assert pool is not None, "scaled mode uses Django's connection pool"
    return pool


def _end_backend(pid: int) -> None:
    """End a server process from another connection, and wait until it is gone."""
    with connections["default"].pool.connection() as other:
        assert other.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone() == (True,)
        deadline = time.monotonic() + 10
        while other.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone():
            assert time.monotonic() < deadline, "the server process did not end"
            time.sleep(0.01)


def _backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def test_the_pool_checks_with_the_cheap_check(pool: Any) -> None:
    # covers: G5, G6
    assert pool._check is check_connection


def test_a_sound_connection_is_lent_without_a_query(pool: Any) -> None:
    # covers: G6 (no round trip per database call for the check)
    conn = pool.getconn()
    try:
        sent: list[str] = []
        real = conn.execute

        def execute(query: Any, *args: Any, **kwargs: Any) -> Any:
            sent.append(str(query))
            return real(query, *args, **kwargs)

        conn.execute = execute
        check_connection(conn)
        assert sent == []
        del conn.execute
    finally:
        pool.putconn(conn)


def test_a_connection_the_server_ended_in_the_pool_is_replaced(pool: Any) -> None:
    # covers: G5 (a restart or an ended backend: the next call gets a working connection)
    connections.close_all()
    pool.check()  # start from connections that all work
    first = _backend_pid()
    connection.close()  # back to the pool
    _end_backend(first)
    # Every pooled connection is borrowed in turn: the ended one is found and replaced, and
    # every call works.
    pids = set()
    held = [pool.getconn() for _ in range(pool.get_stats()["pool_size"])]
    try:
        for conn in held:
            pids.add(conn.execute("SELECT pg_backend_pid()").fetchone()[0])
    finally:
        for conn in held:
            pool.putconn(conn)
    assert first not in pids
    assert _backend_pid() != first


def test_a_failed_check_goes_to_the_pools_own_check(pool: Any) -> None:
    # covers: G5
    conn = pool.getconn()
    try:
        _end_backend(conn.info.backend_pid)
        # The server's goodbye left the socket readable; the pool's own check then fails.
        with pytest.raises(OperationalError):
            check_connection(conn)
    finally:
        pool.putconn(conn)
