"""Scaled mode's PostgreSQL backend (`chatcore/postgresql/base.py`): the pool lends a sound
connection without a round trip, and still replaces one the server ended while it sat in the
pool (G5); a request whose connection the server ends after the pool's check still answers
(its reads run once more on a fresh connection), and one that cannot reach the database at
all answers a retryable 503 (A4)."""

from __future__ import annotations

import datetime
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import psycopg
import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import User
from django.db import IntegrityError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from psycopg import OperationalError
from psycopg_pool import ConnectionPool

from chatcore.engine.sessions import resolve_dialog
from chatcore.postgresql.base import check_connection
from sessions_app import rows
from sessions_app.auth import token_for_raw
from sessions_app.models import Session
from tests.conftest import require_postgresql
from tests.engine_helpers import Exchanges

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]


@pytest.fixture
def pool() -> Any:
    require_postgresql()
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


# --- A connection lost under a request (A4) -------------------------------------------------


_UNDER_TEST: ContextVar[bool] = ContextVar("under_test", default=False)


@contextmanager
def _under_test() -> Iterator[None]:
    """Calls made from here on (and from the tasks started here) are the ones hit."""
    token = _UNDER_TEST.set(True)
    try:
        yield
    finally:
        _UNDER_TEST.reset(token)


def _called_from(fn: Callable[..., Any]) -> bool:
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is fn.__code__:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _EndAfterCheck:
    """The pool's check, then the server process of the connection it just passed ended (as a
    restart or an idle timeout can do in that moment): the call's first query then finds its
    connection gone. `hit(n)` says whether the n-th borrow (from 1) is hit; only borrows that
    `counts()` (default: made under `_under_test`) count, not the engine's own work meanwhile."""

    def __init__(
        self, pool: Any, hit: Callable[[int], bool], counts: Callable[[], bool] | None = None
    ) -> None:
        self.pool, self.hit, self.counts = pool, hit, counts or _UNDER_TEST.get
        self.inner = pool._check
        self.borrows = self.ended = 0
        self.busy = False

    def __call__(self, conn: Any) -> None:
        self.inner(conn)
        if self.busy or not self.counts():
            return
        self.borrows += 1
        if not self.hit(self.borrows):
            return
        self.busy = True  # `_end_backend` borrows a connection of its own
        try:
            _end_backend(conn.info.backend_pid)
            self.ended += 1
        finally:
            self.busy = False


@pytest.fixture
def end_after_check(pool: Any) -> Any:
    installed: list[_EndAfterCheck] = []

    def install(
        hit: Callable[[int], bool], counts: Callable[[], bool] | None = None
    ) -> _EndAfterCheck:
        hook = _EndAfterCheck(pool, hit, counts)
        pool._check = hook
        installed.append(hook)
        return hook

    yield install
    if installed:
        pool._check = installed[0].inner


async def test_a_read_whose_connection_the_server_ends_under_it_still_answers(
    api: Any, end_after_check: Any
) -> None:
    # covers: A4 (a failed read is tried again, on a fresh connection), E3
    status, created = await api.post("/sessions", {"title": "kept"})
    assert status == 201
    status, sent = await api.post(f"/sessions/{created['session_id']}/messages", {"content": "hi"})
    assert status in (200, 202)

    # The token's read is the request's first call (borrow 1, its new try borrow 2); the
    # dialog's read comes next (borrow 3, its new try 4).
    hook = end_after_check(lambda n: n in (1, 3))
    with _under_test():
        status, page = await api.get(f"/sessions/{created['session_id']}/messages")

    assert (hook.borrows, hook.ended) == (4, 2)
    assert status == 200, page
    assert [m["content"] for m in page["messages"] if m["role"] == "user"] == ["hi"]


async def test_a_database_that_cannot_be_reached_answers_a_retryable_503(
    api: Any, end_after_check: Any
) -> None:
    # covers: A4, E3 (errors are JSON `{code, message}`; never a 500 for a database outage)
    status, created = await api.post("/sessions", {"title": "kept"})
    assert status == 201

    hook = end_after_check(lambda n: True)
    with _under_test():
        status, error, response = await api.call("GET", f"/sessions/{created['session_id']}")

    assert hook.ended == 2  # the token's read, and its one more try
    assert status == 503
    assert error["code"] == "storage_error"
    assert response["Retry-After"] == "1"


async def test_a_socket_whose_reads_lose_their_connection_still_opens(
    engine: Any, user: Any, end_after_check: Any
) -> None:
    # covers: A4, B1, E1 (a socket's first reads: its token's, then its dialog's)
    from tests.ws_helpers import bearer, open_ws

    headers = await bearer(user)
    # The test client runs the socket's application in a context of its own: the reads hit
    # are told by the calls they are made in (borrow 1 the token's, 2 its new try; 3 the
    # dialog's resolution, which creates the chat's first dialog, 4 its new try).
    hook = end_after_check(
        lambda n: n in (1, 3),
        counts=lambda: _called_from(token_for_raw) or _called_from(resolve_dialog),
    )
    ws, connected = await open_ws(headers)
    try:
        assert connected
        sessions = await ws.next()
        assert sessions["type"] == "sessions"
        assert (await ws.next())["type"] == "session_history"
        assert (hook.borrows, hook.ended) == (4, 2)
        assert len(sessions["items"]) == 1
    finally:
        await ws.close()
    assert await sync_to_async(Session.objects.filter(owner=user).count)() == 1


# --- A transaction begun by its first statement (G6) ----------------------------------------


@pytest.fixture
def table(pool: Any) -> Any:
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE begin_probe (id integer PRIMARY KEY, note text)")
        cursor.execute("INSERT INTO begin_probe VALUES (1, 'first')")
    yield "begin_probe"
    connection.close()
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE begin_probe")


def _ids() -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM begin_probe ORDER BY id")
        return [row[0] for row in cursor.fetchall()]


def test_a_transaction_sends_its_begin_with_its_first_statement(table: str) -> None:
    # covers: G6 (round trips: a transaction of one statement costs that statement and its
    # COMMIT, not a BEGIN of its own as well)
    connection.ensure_connection()
    with Exchanges(connection.connection) as exchanges:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SELECT note FROM begin_probe WHERE id = 1 FOR UPDATE")
                assert cursor.fetchone() == ("first",)
    assert exchanges.count == 2


def test_the_first_statements_row_lock_is_held_until_the_commit(table: str) -> None:
    # covers: G2, G6 (the first statement runs inside the transaction, not before it)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT note FROM begin_probe WHERE id = 1 FOR UPDATE")
        with connections["default"].pool.connection() as other:
            with pytest.raises(psycopg.errors.LockNotAvailable):
                other.execute("SELECT 1 FROM begin_probe WHERE id = 1 FOR UPDATE NOWAIT")
            other.rollback()
    with connections["default"].pool.connection() as other:
        assert other.execute(
            "SELECT 1 FROM begin_probe WHERE id = 1 FOR UPDATE NOWAIT"
        ).fetchone() == (1,)


def test_a_rolled_back_transaction_leaves_nothing_and_the_next_one_begins(table: str) -> None:
    # covers: A4, G6
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("INSERT INTO begin_probe VALUES (2, 'gone')")
            raise RuntimeError("roll back")
    # A first statement that fails: its transaction is rolled back, the connection works on.
    with pytest.raises(IntegrityError):
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("INSERT INTO begin_probe VALUES (1, 'duplicate')")
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO begin_probe VALUES (3, 'kept')")
            cursor.execute("SELECT txid_current_if_assigned() IS NOT NULL")
            assert cursor.fetchone() == (True,)  # inside a transaction, with its write
    assert _ids() == [1, 3]


def test_savepoints_and_many_rows_at_once_stay_inside_the_transaction(table: str) -> None:
    # covers: G6
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.executemany("INSERT INTO begin_probe VALUES (%s, %s)", [(4, "a"), (5, "b")])
            raise RuntimeError("roll back")
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO begin_probe VALUES (6, 'outer')")
        with pytest.raises(RuntimeError):
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("INSERT INTO begin_probe VALUES (7, 'inner')")
                raise RuntimeError("roll back the savepoint")
    assert _ids() == [1, 6]


def test_autocommit_turned_off_by_hand_begins_again_after_each_commit(table: str) -> None:
    # covers: G6
    transaction.set_autocommit(False)
    try:
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO begin_probe VALUES (8, 'committed')")
        transaction.commit()
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO begin_probe VALUES (9, 'rolled back')")
        transaction.rollback()
    finally:
        transaction.set_autocommit(True)
    assert _ids() == [1, 8]


def test_a_connection_closed_inside_a_transaction_goes_back_to_the_pool_with_none_pending(
    table: str, pool: Any
) -> None:
    # covers: G5, G6 (the next borrower's statements are not caught in a stray transaction)
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            raw = connection.connection
            connection.close()  # nothing ran: no BEGIN was sent
            raise RuntimeError("leave")
    ConnectionPool.check_connection(raw)  # the pool's own check, when it lends it again
    assert raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO begin_probe VALUES (10, 'autocommitted')")
    with connections["default"].pool.connection() as other:
        assert other.execute("SELECT 1 FROM begin_probe WHERE id = 10").fetchone() == (1,)


def _held_insert(cursor: Any, id_: int, note: str) -> None:
    connection.hold_write(cursor)
    cursor.execute("INSERT INTO begin_probe VALUES (%s, %s)", [id_, note])


def _locked_then_held(cursor: Any, id_: int, note: str) -> None:
    """A transaction's first statement (its row lock), then a held write: as a turn's commit."""
    cursor.execute("SELECT note FROM begin_probe WHERE id = 1 FOR UPDATE")
    _held_insert(cursor, id_, note)


def test_a_held_write_goes_with_the_commit(table: str) -> None:
    # covers: G6 (a turn's commit: the lock, then its writes with the COMMIT, two round trips)
    connection.ensure_connection()
    with CaptureQueriesContext(connection) as logged:
        with Exchanges(connection.connection) as exchanges:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    _locked_then_held(cursor, 11, "with the commit")
    assert exchanges.count == 2
    assert _ids() == [1, 11]
    # Django saw the write when it was made (query logging, execute wrappers).
    assert any("INSERT INTO begin_probe" in query["sql"] for query in logged.captured_queries)


def test_a_held_write_goes_with_the_next_statement_which_sees_it(table: str) -> None:
    # covers: G6
    connection.ensure_connection()
    with Exchanges(connection.connection) as exchanges:
        with transaction.atomic():
            with connection.cursor() as cursor:
                _locked_then_held(cursor, 12, "held")
                cursor.execute("SELECT note FROM begin_probe WHERE id = 12")
                assert cursor.fetchone() == ("held",)
    assert exchanges.count == 3  # BEGIN with the lock; the write with the read; COMMIT
    assert _ids() == [1, 12]


def test_a_held_write_that_fails_rolls_its_transaction_back(table: str) -> None:
    # covers: A4, G6 (the error is raised inside the same atomic block; nothing commits)
    with pytest.raises(IntegrityError):
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("INSERT INTO begin_probe VALUES (13, 'not kept')")
                _held_insert(cursor, 1, "a duplicate key")
    assert _ids() == [1]
    # ... and when the next statement carries it, that statement raises it.
    with pytest.raises(IntegrityError):
        with transaction.atomic():
            with connection.cursor() as cursor:
                _locked_then_held(cursor, 1, "a duplicate key")
                cursor.execute("SELECT 1")
    assert _ids() == [1]
    with transaction.atomic():
        with connection.cursor() as cursor:
            _locked_then_held(cursor, 14, "the connection works on")
    assert _ids() == [1, 14]


def test_a_held_write_is_dropped_by_a_rollback_and_kept_by_savepoints(table: str) -> None:
    # covers: G6
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            with connection.cursor() as cursor:
                _locked_then_held(cursor, 15, "rolled back")
            raise RuntimeError("roll back")
    with transaction.atomic():
        with connection.cursor() as cursor:
            _locked_then_held(cursor, 16, "before the savepoint")
        with pytest.raises(RuntimeError):
            with transaction.atomic():
                with connection.cursor() as cursor:
                    _held_insert(cursor, 17, "inside the savepoint")
                raise RuntimeError("roll back the savepoint")
        with connection.cursor() as cursor:
            cursor.executemany("INSERT INTO begin_probe VALUES (%s, %s)", [(18, "many")])
            _held_insert(cursor, 19, "last")
    assert _ids() == [1, 16, 18, 19]


def test_a_write_held_outside_a_transaction_runs_at_once(table: str) -> None:
    # covers: A4 (autocommit: nothing would carry it)
    with connection.cursor() as cursor:
        _held_insert(cursor, 20, "autocommitted")
    with connections["default"].pool.connection() as other:
        assert other.execute("SELECT 1 FROM begin_probe WHERE id = 20").fetchone() == (1,)


def test_a_step_run_once_the_commit_is_sent_sees_it_land_without_this_thread(
    table: str,
) -> None:
    # covers: G6 (a started turn's input is built while its admission waits for its COMMIT:
    # handed over once the COMMIT is on its way, not before, when it took the interpreter
    # lock from the COMMIT's own steps)
    order: list[str] = []

    def once_sent() -> None:
        # This thread has not read the COMMIT's answer; the server commits all the same.
        with connections["default"].pool.connection() as other:
            deadline = time.monotonic() + 10
            while not other.execute("SELECT 1 FROM begin_probe WHERE id = 21").fetchone():
                assert time.monotonic() < deadline, "the COMMIT was not sent"
                time.sleep(0.005)
        order.append("sent")

    with transaction.atomic():
        with connection.cursor() as cursor:
            _locked_then_held(cursor, 21, "sent")
        rows.when_commit_sent(once_sent)
        transaction.on_commit(lambda: order.append("committed"))
        assert order == []
    assert order == ["sent", "committed"]

    # Never for a transaction that rolls back; an error of the step leaves the COMMIT be.
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            with connection.cursor() as cursor:
                _locked_then_held(cursor, 22, "rolled back")
            rows.when_commit_sent(lambda: order.append("rolled back"))
            raise RuntimeError("roll back")

    # ... nor for a savepoint that rolls back inside one that commits.
    with transaction.atomic():
        with pytest.raises(RuntimeError):
            with transaction.atomic():
                rows.when_commit_sent(lambda: order.append("savepoint rolled back"))
                raise RuntimeError("roll back the savepoint")

    def fails() -> None:
        raise ValueError("a step that fails")

    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO begin_probe VALUES (23, 'not held')")
        rows.when_commit_sent(fails)
    assert order == ["sent", "committed"]
    assert _ids() == [1, 21, 23]
    # Outside a transaction there is no COMMIT to wait for: at once.
    rows.when_commit_sent(lambda: order.append("at once"))
    assert order[-1] == "at once"


def test_statements_pipelined_together_cost_one_round_trip_and_run_in_order(
    table: str, pool: Any
) -> None:
    # covers: C1, G6 (a count sent with a lock, in its round trip, runs once the lock is held:
    # it sees what the lock's holder committed meanwhile)
    connection.ensure_connection()
    ours = connection.connection.info.backend_pid
    locked, failures = threading.Event(), []

    def hold_the_lock_until_we_wait() -> None:
        try:
            with pool.connection() as holder, holder.transaction():
                holder.execute("SELECT 1 FROM begin_probe WHERE id = 1 FOR UPDATE")
                holder.execute("INSERT INTO begin_probe VALUES (21, 'committed while we wait')")
                locked.set()
                deadline = time.monotonic() + 10
                while not holder.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
                    [ours],
                ).fetchone():
                    assert time.monotonic() < deadline, "our lock never waited"
                    time.sleep(0.01)
        except BaseException as exc:
            failures.append(exc)
            locked.set()

    holder = threading.Thread(target=hold_the_lock_until_we_wait)
    holder.start()
    try:
        assert locked.wait(10)
        with Exchanges(connection.connection) as exchanges:
            with transaction.atomic():
                with connection.cursor() as locking, connection.cursor() as counting:
                    with rows.pipelined():
                        locking.execute("SELECT note FROM begin_probe WHERE id = 1 FOR UPDATE")
                        counting.execute("SELECT count(*) FROM begin_probe")
                    assert locking.fetchone() == ("first",)
                    assert counting.fetchone() == (2,)
    finally:
        holder.join()
    assert not failures
    assert exchanges.count == 2


def test_a_send_to_an_idle_dialog_is_admitted_and_started_in_two_round_trips(
    pool: Any, user: Any
) -> None:
    # covers: G6, C3, G2 (the rows locked with the counts read after the lock, one round trip;
    # the turn, its user message and the lease written with the COMMIT, the second)
    from django.conf import settings

    from chatcore.engine import admission, queue
    from chatcore.engine.ingress import Inbound
    from chatcore.engine.sessions import SessionStates
    from sessions_app import services
    from sessions_app.models import Turn, TurnStatus

    session = services.session_create(owner=user, channel="web", chat_id=f"u{user.pk}")
    inbound = Inbound(
        owner=user, channel="web", chat_id=session.chat_id, content="hello", sender_id="s"
    )
    connection.ensure_connection()
    with Exchanges(connection.connection) as exchanges:
        ack, started = admission.admit_and_start(
            inbound, session, cfg=settings.CHAT, states=SessionStates(), start_as="worker"
        )
    assert exchanges.count == 2
    assert started is not None and ack.position == 0
    stored = Turn.objects.get(pk=ack.turn_id)
    assert stored.status == TurnStatus.RUNNING
    assert list(session.messages.filter(role="user").values_list("content", flat=True)) == ["hello"]
    live = Session.objects.get(pk=session.pk)
    assert (live.lease_owner, live.lease_epoch) == ("worker", started.lease.epoch)

    # Its lease is given up only once nothing is queued or running: the lock and the
    # conditional update in one round trip, then the COMMIT.
    Turn.objects.filter(pk=stored.pk).update(status=TurnStatus.COMPLETED)
    with Exchanges(connection.connection) as exchanges:
        assert queue.release_if_idle(started.lease)
    assert exchanges.count == 2
    assert Session.objects.get(pk=session.pk).lease_owner == ""


_STAMPS = [
    "2026-12-06 13:10:09.932796+00",
    "2000-02-29 23:59:59.5+05:30",
    "1969-12-31 23:59:59-08",
    "0001-01-01 00:00:00+00",
    "9999-12-30 23:59:59.999999+00",
    "1890-06-01 12:00:00+00:19:32",
]


def _read_stamps(cursor: Any) -> list[Any]:
    cursor.execute(
        "SELECT s::timestamptz FROM unnest(%s::text[]) WITH ORDINALITY AS t(s, n) ORDER BY n",
        [_STAMPS],
    )
    return [row[0] for row in cursor.fetchall()]


def test_timestamps_read_back_as_django_reads_them_aware_and_in_utc(pool: Any) -> None:
    # covers: A2 (a message's and a dialog's stored times), G6 (timestamps parsed by
    # psycopg's compiled loader, not in Python)
    from django.db.backends.postgresql.psycopg_any import register_tzloader

    from chatcore.postgresql.base import UtcTimestamptzLoader

    with connection.cursor() as cursor:
        ours = _read_stamps(cursor)
        register_tzloader(datetime.UTC, cursor.cursor)  # Django's own loader, on this cursor
        djangos = _read_stamps(cursor)
    assert connection.connection.adapters.get_loader(1184, psycopg.pq.Format.TEXT) is (
        UtcTimestamptzLoader
    )
    assert ours == djangos
    assert all(value.tzinfo is datetime.UTC for value in ours)
    assert ours[1] == datetime.datetime(2000, 2, 29, 18, 29, 59, 500000, tzinfo=datetime.UTC)
    assert ours[4].microsecond == 999999

    # A connection another time zone was set on reads the same instants, as Django's loader
    # would (whose values it would then be wrong on; Django keeps its connections in UTC).
    with connection.cursor() as cursor:
        cursor.execute("SET TIME ZONE 'Asia/Kolkata'")
        try:
            elsewhere = _read_stamps(cursor)
            register_tzloader(datetime.UTC, cursor.cursor)
            assert elsewhere == _read_stamps(cursor)
        finally:
            cursor.execute("SET TIME ZONE 'UTC'")

    # Through the ORM: a dialog's stored time comes back as it was written.
    owner = User.objects.create_user("stamps")
    session = Session.objects.create(owner=owner, channel="web", chat_id="c")
    written = datetime.datetime(2001, 9, 9, 1, 46, 40, 123456, tzinfo=datetime.UTC)
    Session.objects.filter(pk=session.pk).update(created_at=written)
    assert Session.objects.get(pk=session.pk).created_at == written
