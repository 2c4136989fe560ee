"""Scaled mode's database: Django's PostgreSQL backend with its connection pool (settings,
`OPTIONS["pool"]`, psycopg's). The pool replaces a connection the server ended while it sat
in the pool (G5); a request whose connection the server ends after the pool's check still
answers (its reads run once more on a fresh connection), and one that cannot reach the
database at all answers a retryable 503 (A4). Django's documented options reach the server
(`isolation_level`, I2); a transaction that waits on something else with a row locked holds
up the writers of that row only (I3); statements sent together (`rows.pipelined`) cost one
round trip and run in order (C1, G6)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connection, connections, transaction
from django.db.utils import load_backend
from psycopg import IsolationLevel

from chatcore.engine.sessions import resolve_dialog
from sessions_app import rows
from sessions_app.auth import token_for_raw
from sessions_app.models import Session
from tests.conftest import require_postgresql
from tests.engine_helpers import Exchanges
from tests.storage_helpers import create

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


# --- Django's documented options; a lock held while waiting (I2, I3) --------------------------


@pytest.mark.parametrize(
    ("level", "shown"),
    [
        (IsolationLevel.SERIALIZABLE, "serializable"),
        (IsolationLevel.REPEATABLE_READ, "repeatable read"),
        (None, "read committed"),
    ],
)
def test_the_isolation_level_set_in_options_reaches_postgresql(
    pool: Any, level: IsolationLevel | None, shown: str
) -> None:
    # covers: I2 (`OPTIONS["isolation_level"]`, Django's documented setting, is what the
    # server runs a transaction at; the server's default without it)
    options = {**connection.settings_dict["OPTIONS"]}
    options.pop("isolation_level", None)
    if level is not None:
        options["isolation_level"] = level
    settings_dict = {**connection.settings_dict, "OPTIONS": options}
    alias = "isolated"
    other = load_backend(settings_dict["ENGINE"]).DatabaseWrapper(settings_dict, alias)
    connections[alias] = other
    try:
        with transaction.atomic(using=alias), other.cursor() as cursor:
            cursor.execute("SHOW transaction_isolation")
            assert cursor.fetchone() == (shown,)
    finally:
        other.close()
        other.close_pool()
        del connections[alias]


def test_a_transaction_waiting_with_a_row_locked_holds_up_that_rows_writers_only(
    pool: Any, user: Any
) -> None:
    # covers: I3 (a transaction that waits on something else, say Redis, while it holds a
    # dialog's row: another dialog's writes go on; that dialog's own wait for it)
    held, other = create(user, "held"), create(user, "other")
    holding, release, done = threading.Event(), threading.Event(), []

    def holder() -> None:
        try:
            with transaction.atomic():
                Session.objects.select_for_update().get(pk=held.pk)
                holding.set()
                release.wait(30)
        finally:
            connections.close_all()

    def same_row_writer() -> None:
        try:
            Session.objects.filter(pk=held.pk).update(title="after the holder")
            done.append("same row")
        finally:
            connections.close_all()

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    try:
        assert holding.wait(10)
        began = time.monotonic()
        Session.objects.filter(pk=other.pk).update(title="not held up")
        assert time.monotonic() - began < 1
        waiting = threading.Thread(target=same_row_writer, daemon=True)
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and done == []  # the held row's writer waits
    finally:
        release.set()
        thread.join(10)
    waiting.join(10)
    assert done == ["same row"]
    assert Session.objects.get(pk=held.pk).title == "after the holder"
    assert Session.objects.get(pk=other.pk).title == "not held up"


# --- Statements sent together (C1, G6) ------------------------------------------------------


@pytest.fixture
def table(pool: Any) -> Any:
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE pipeline_probe (id integer PRIMARY KEY, note text)")
        cursor.execute("INSERT INTO pipeline_probe VALUES (1, 'first')")
    yield "pipeline_probe"
    connection.close()
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE pipeline_probe")


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
                holder.execute("SELECT 1 FROM pipeline_probe WHERE id = 1 FOR UPDATE")
                holder.execute("INSERT INTO pipeline_probe VALUES (21, 'committed while we wait')")
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
        with transaction.atomic():
            with connection.cursor() as locking, connection.cursor() as counting:
                locking.execute("SELECT 1")  # the transaction has begun
                with Exchanges(connection.connection) as exchanges, rows.pipelined():
                    locking.execute("SELECT note FROM pipeline_probe WHERE id = 1 FOR UPDATE")
                    counting.execute("SELECT count(*) FROM pipeline_probe")
                assert locking.fetchone() == ("first",)
                assert counting.fetchone() == (2,)
    finally:
        holder.join()
    assert not failures
    assert exchanges.count == 1


def test_a_send_to_an_idle_dialog_is_admitted_and_started_in_four_round_trips(
    pool: Any, user: Any
) -> None:
    # covers: G6, C3, G2 (psycopg's BEGIN; the rows locked with the counts read after the
    # lock, one round trip; the turn, its user message and the lease, one statement; the
    # COMMIT)
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
    assert exchanges.count <= 4
    assert started is not None and ack.position == 0
    stored = Turn.objects.get(pk=ack.turn_id)
    assert stored.status == TurnStatus.RUNNING
    assert list(session.messages.filter(role="user").values_list("content", flat=True)) == ["hello"]
    live = Session.objects.get(pk=session.pk)
    assert (live.lease_owner, live.lease_epoch) == ("worker", started.lease.epoch)

    # Its lease is given up only once nothing is queued or running: the BEGIN, the lock and
    # the conditional update in one round trip, the COMMIT.
    Turn.objects.filter(pk=stored.pk).update(status=TurnStatus.COMPLETED)
    with Exchanges(connection.connection) as exchanges:
        assert queue.release_if_idle(started.lease)
    assert exchanges.count <= 3
    assert Session.objects.get(pk=session.pk).lease_owner == ""
