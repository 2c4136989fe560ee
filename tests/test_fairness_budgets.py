"""Fairness, continued (F7): budgets per kind of request, open sockets per user, byte-bounded
history pages and cache, the turn deadline."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import cache
from django.test import override_settings

from chatcore.engine.sessions import SessionStates
from chatcore.engine.turns.builder import RuntimeInfo, TurnInputBuilder
from sessions_app.models import Compaction, Message, Session, Turn
from tests.api_helpers import bearer_api, engine_with, error_of
from tests.engine_helpers import chat_group_of, history, make_dialog, send
from tests.fakemodel import Reply
from tests.test_fairness import (
    chat_cfg,
    fill_history,
    terminals,
    ws_connect,
)
from tests.ws_helpers import bearer, open_ws

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


# --- Item 3: budgets -----------------------------------------------------------------------


async def test_rest_writes_have_their_own_budget(engine: Any, make_engine: Any, user: Any) -> None:
    # covers: F7 (create, rename, delete: 429 rate_limited with Retry-After past the budget)
    await sync_to_async(cache.clear)()
    api = await bearer_api(user)
    async with engine_with(make_engine, WRITE_RATE_PER_MINUTE=3):
        made = await api.create(dialog_id="w1")
        status, _ = await api.patch(f"/sessions/{made['session_id']}", {"title": "renamed"})
        assert status == 200
        status, _ = await api.delete(f"/sessions/{made['session_id']}")
        assert status == 204
        status, data, response = await api.call("POST", "/sessions", {"dialog_id": "w2"})
        error_of(status, data, 429, "rate_limited")
        assert 1 <= int(response["Retry-After"]) <= 60
        # The refused create changed nothing; sends have their own budget.
        count = await sync_to_async(Session.objects.filter(owner=user, dialog_id="w2").count)()
        assert count == 0
    await sync_to_async(cache.clear)()


async def test_rest_compact_and_retry_are_charged_to_the_send_rate(
    engine: Any, make_engine: Any, fake_model: Any, user: Any
) -> None:
    # covers: F7
    await sync_to_async(cache.clear)()
    api = await bearer_api(user)
    made = await api.create(dialog_id="c1")
    sid = made["session_id"]
    fake_model.script(Reply(status=400, error={"error": {"message": "bad"}}))
    async with engine_with(make_engine, RATE_LIMIT_PER_MINUTE=1):
        ack = await api.send(sid, "fails")
        assert (await api.turn_done(ack["turn_id"]))["status"] == "failed"
        status, data, response = await api.call("POST", f"/sessions/{sid}/retry", {})
        error_of(status, data, 429, "rate_limited")
        assert int(response["Retry-After"]) >= 1
        status, data = await api.post(f"/sessions/{sid}/compact")
        error_of(status, data, 429, "rate_limited")
    turns = await sync_to_async(Turn.objects.filter(session__owner=user).count)()
    assert turns == 1  # the refused retry opened no turn
    await sync_to_async(cache.clear)()


async def test_ws_commands_use_the_write_budget_and_stop_is_never_refused(
    engine: Any, make_engine: Any, user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: F7, B3
    import types

    from chatcore.engine import limits

    # Budgets count per clock minute: the test's requests all fall in one, whenever it runs.
    fixed = 1_800_000_000.0 - 40
    monkeypatch.setattr(limits, "time", types.SimpleNamespace(time=lambda: fixed))
    await sync_to_async(cache.clear)()
    async with engine_with(make_engine, WRITE_RATE_PER_MINUTE=2):
        ws = await ws_connect(user)
        assert (await ws.ask({"type": "send", "content": "/help", "client_msg_id": "h"}))[
            "type"
        ] == "command_result"
        assert (await ws.ask({"type": "send", "content": "/new spare", "client_msg_id": "n"}))[
            "type"
        ] == "command_result"
        await ws.drain()
        refused = await ws.ask({"type": "send", "content": "/rename x", "client_msg_id": "r"})
        assert refused["type"] == "error" and refused["code"] == "rate_limited"
        assert refused["retry_after"] > 0
        stopped = await ws.ask({"type": "stop", "client_msg_id": "s"})
        assert stopped["type"] == "command_result" and stopped["command"] == "stop"
        # Sends have their own budget.
        sent = await ws.ask({"type": "send", "content": "still here", "client_msg_id": "m"})
        assert sent["type"] == "queued"
        titles = await sync_to_async(
            lambda: list(Session.objects.filter(owner=user).values_list("title", flat=True))
        )()
        assert "x" not in titles
        await ws.close()
    await sync_to_async(cache.clear)()


async def test_ws_retry_and_compact_are_charged_to_the_send_rate(
    engine: Any, make_engine: Any, fake_model: Any, user: Any
) -> None:
    # covers: F7
    await sync_to_async(cache.clear)()
    fake_model.script(Reply(status=400, error={"error": {"message": "bad"}}))
    async with engine_with(make_engine, RATE_LIMIT_PER_MINUTE=1):
        ws = await ws_connect(user)
        queued = await ws.ask({"type": "send", "content": "fails", "client_msg_id": "f"})
        await ws.until(lambda f: f["type"] == "turn_updated" and f["turn_id"] == queued["turn_id"])
        retry = await ws.ask({"type": "retry", "client_msg_id": "r"})
        assert retry["type"] == "error" and retry["code"] == "rate_limited"
        compact = await ws.ask({"type": "send", "content": "/compact", "client_msg_id": "c"})
        assert compact["type"] == "error" and compact["code"] == "rate_limited"
        await ws.close()
    assert await sync_to_async(Turn.objects.count)() == 1
    await sync_to_async(cache.clear)()


async def test_open_sockets_per_user_are_bounded(
    engine: Any, make_engine: Any, user: Any, other_user: Any
) -> None:
    # covers: F7 (the socket past the bound: a rate_limited error frame, then close 4429)
    async with engine_with(make_engine, USER_SOCKETS_MAX=2):
        first = await ws_connect(user)
        second = await ws_connect(user)
        third, connected = await open_ws(await bearer(user))
        assert connected  # accepted, told why, then closed
        refusal = json.loads(await third.comm.receive_from(10))
        assert refusal["type"] == "error" and refusal["code"] == "rate_limited"
        closed = await third.comm.receive_output(10)
        assert closed == {"type": "websocket.close", "code": 4429}
        # Another user is not affected.
        bob = await ws_connect(other_user)
        # A closed socket frees its place.
        await first.close()
        again = await ws_connect(user)
        await again.close()
        await second.close()
        await bob.close()


@pytest.mark.redis
def test_the_socket_bound_holds_across_processes(redis_url: str) -> None:
    # covers: F7, G1 (scaled mode: sockets of every process count; a dead process's expire)
    import time

    import redis

    from chatcore.engine.limits import SocketRegistry

    redis.Redis.from_url(redis_url).delete("ws:user:424242")
    with override_settings(SCALED=True, REDIS_URL=redis_url):
        one, two = SocketRegistry(), SocketRegistry()
        assert one.open(424242, "c1", 2)
        assert two.open(424242, "c2", 2)
        assert not one.open(424242, "c3", 2)
        two.close(424242, "c2")
        assert one.open(424242, "c3", 2)
        # A process that dies stops refreshing its sockets; they stop counting.
        one.TTL_SECONDS = 1
        one.refresh()
        time.sleep(1.5)
        assert two.open(424242, "c4", 2)
        assert two.open(424242, "c5", 2)
        assert not two.open(424242, "c6", 2)
    redis.Redis.from_url(redis_url).delete("ws:user:424242")


@pytest.mark.redis
def test_the_send_budget_on_redis_is_one_count_shared_by_every_process(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: F7 (scaled mode: the per-minute budget is counted in Redis, across processes)
    import uuid

    from django.core.cache.backends.redis import RedisCache

    from chatcore.common.errors import RateLimited
    from chatcore.engine import limits

    prefix = f"t{uuid.uuid4().hex[:8]}"
    backend = {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": redis_url}
    # A fixed clock 20 s into a minute: the test never straddles two minutes' counters.
    monkeypatch.setattr(limits.time, "time", lambda: 1_800_000_000.0 - 40)
    cfg = {"RATE_LIMIT_PER_MINUTE": 3, "WRITE_RATE_PER_MINUTE": 100}
    with override_settings(CACHES={"default": {**backend, "KEY_PREFIX": prefix}}):
        for _ in range(3):
            limits.charge(9191, limits.SEND, cfg)
        with pytest.raises(RateLimited) as refused:
            limits.charge(9191, limits.SEND, cfg)
        assert refused.value.retry_after == 40
        # Writes have their own budget.
        limits.charge(9191, limits.WRITE, cfg)
    # Another process (its own cache client) sees the same count, through the cache API,
    # and the counter goes away after its two minutes.
    other = RedisCache(redis_url, {"KEY_PREFIX": prefix})
    key = f"rl:send:9191:{int((1_800_000_000 - 40) // 60)}"
    assert other.get(key) == 4
    ttl = other._cache.get_client(write=True).ttl(other.make_and_validate_key(key))
    assert 60 < ttl <= 120
    other.delete_many([key, key.replace(":send:", ":write:")])


@pytest.mark.redis
async def test_a_burst_of_sends_is_charged_exactly_in_a_few_round_trips_to_redis(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: F7, G6 (the send rate of a burst: every charge counted once, the budget exact,
    # the counts in a pipeline to Redis per trip rather than one round trip per send: the
    # first goes at once, the rest together while it is under way)
    import uuid

    from chatcore.common.errors import RateLimited
    from chatcore.engine import limits

    monkeypatch.setattr(limits.time, "time", lambda: 1_800_000_000.0 - 40)
    batches: list[int] = []
    real = limits._COUNTS.run_many

    def counted(keys: list[str]) -> list[int]:
        batches.append(len(keys))
        return real(keys)

    monkeypatch.setattr(limits._COUNTS, "run_many", counted)
    backend = {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": redis_url}
    cfg = {"RATE_LIMIT_PER_MINUTE": 40, "WRITE_RATE_PER_MINUTE": 100}
    with override_settings(CACHES={"default": {**backend, "KEY_PREFIX": uuid.uuid4().hex}}):
        results = await asyncio.gather(
            *(limits.acharge(7373, limits.SEND, cfg) for _ in range(50)),
            limits.acharge(7374, limits.SEND, cfg),  # another user: a budget of their own
            return_exceptions=True,
        )
        refused = [r for r in results if isinstance(r, RateLimited)]
        assert len(refused) == 10 and all(r.retry_after == 40 for r in refused)
        assert results[-1] is None
        assert sum(batches) == 51 and len(batches) <= 3
        with pytest.raises(RateLimited):
            await limits.acharge(7373, limits.SEND, cfg)
        await limits.acharge(7374, limits.SEND, cfg)


def counts_held(monkeypatch: pytest.MonkeyPatch, before_read: Any) -> list[int]:
    """Every trip of send-rate counts to Redis (an admission's own, or a loop-side charge's)
    recorded by its number of keys, its replies read only after `before_read()` (once per
    trip): a cache server slow to answer, or held until the test lets it go."""
    from chatcore.engine import limits

    real = limits._start_counts
    trips: list[int] = []

    def start(keys: list[str]) -> Any:
        trip = real(keys)
        trips.append(len(keys))
        read = trip.counts
        waited: list[bool] = []

        def counts() -> list[int]:
            if not waited:
                waited.append(True)
                before_read()
            return read()

        trip.counts = counts  # type: ignore[method-assign]
        return trip

    monkeypatch.setattr(limits, "_start_counts", start)
    return trips


@pytest.mark.redis
async def test_a_send_over_its_rate_is_refused_beside_its_admission_and_changes_nothing(
    make_engine: Any, fake_model: Any, user: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: F7, G6 (with a cache server a send's charge runs beside its admission, whose
    # transaction waits for it: a refusal that comes back after the admission's statements
    # still rolls them back; a counter seen over its budget refuses the next send at once,
    # with no round trip and no admission; on PostgreSQL the refused send's input was being
    # built meanwhile, and neither it nor its message reaches the model or the history cache)
    import time
    import types
    import uuid

    from chatcore.common.errors import RateLimited
    from chatcore.engine import limits

    fixed = 1_800_000_000.0 - 40
    monkeypatch.setattr(limits, "time", types.SimpleNamespace(time=lambda: fixed))
    real_start = limits._start_counts
    # Longer than the admission's statements: they wait for it.
    trips = counts_held(monkeypatch, lambda: time.sleep(0.3))
    backend = {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": redis_url}
    with override_settings(CACHES={"default": {**backend, "KEY_PREFIX": uuid.uuid4().hex}}):
        async with engine_with(make_engine, RATE_LIMIT_PER_MINUTE=2) as engine:
            session = await make_dialog(user)
            fake_model.script(Reply(text="one"), Reply(text="two"))
            for text in ("first", "second"):
                ack = await send(engine, session, text)
                assert ack.turn_id is not None
                await engine.wait_idle(session.pk)

            def stored() -> tuple[int, int, int, int]:
                row = Session.objects.get(pk=session.pk)
                return (
                    Turn.objects.filter(session_id=session.pk).count(),
                    Message.objects.filter(session_id=session.pk).count(),
                    row.last_seq,
                    row.state_version,
                )

            before = await sync_to_async(stored)()
            with pytest.raises(RateLimited) as refused:
                await send(engine, session, "third")
            assert refused.value.retry_after == 40
            assert await sync_to_async(stored)() == before
            assert trips == [1, 1, 1]

            def unreachable(keys: list[str]) -> Any:
                raise AssertionError("a send known over its budget went to the cache server")

            monkeypatch.setattr(limits, "_start_counts", unreachable)
            with pytest.raises(RateLimited):
                await send(engine, session, "fourth")
            assert await sync_to_async(stored)() == before
            assert [m.content for m in await history(session) if m.role == "user"] == [
                "first",
                "second",
            ]

            # The next minute's budget: the dialog goes on exactly as stored.
            monkeypatch.setattr(limits, "_start_counts", real_start)
            monkeypatch.setattr(limits, "time", types.SimpleNamespace(time=lambda: fixed + 60))
            fake_model.script(Reply(text="three"))
            ack = await send(engine, session, "fifth")
            assert ack.turn_id is not None
            await engine.wait_idle(session.pk)
            shown = [
                (m["role"], m["content"].split("\n\n[runtime context]", 1)[0])
                for m in fake_model.turn_requests()[-1].messages[1:]
            ]
            assert shown == [
                ("user", "first"),
                ("assistant", "one"),
                ("user", "second"),
                ("assistant", "two"),
                ("user", "fifth"),
            ]
            # After the welcome: what was accepted, nothing of what was refused.
            assert [m.content for m in await history(session)][1:] == [
                "first",
                "one",
                "second",
                "two",
                "fifth",
                "three",
            ]


@pytest.mark.redis
async def test_a_burst_of_sends_wider_than_the_database_threads_waits_for_no_thread(
    make_engine: Any,
    fake_model: Any,
    make_user: Any,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # covers: F7, G6 (each admission makes and reads its own charge on its database thread,
    # needing no other thread: a cache server slow to answer holds every thread a while, and
    # every send is admitted)
    import time
    import uuid

    from chatcore.common import dbthreads

    counts_held(monkeypatch, lambda: time.sleep(0.2))
    backend = {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": redis_url}
    width = dbthreads.thread_count() * 2
    with override_settings(CACHES={"default": {**backend, "KEY_PREFIX": uuid.uuid4().hex}}):
        async with engine_with(make_engine) as engine:
            sessions = [
                await make_dialog(await sync_to_async(make_user)(f"burst{i}")) for i in range(width)
            ]
            fake_model.script(*(Reply(text=f"answer {i}") for i in range(width)))
            acks = await asyncio.wait_for(
                asyncio.gather(*(send(engine, s, "hello") for s in sessions)), timeout=30
            )
            assert all(ack.turn_id is not None for ack in acks)
            await engine.wait_idle()
            turns = await sync_to_async(
                lambda: Turn.objects.filter(session_id__in=[s.pk for s in sessions]).count()
            )()
            assert turns == width


@pytest.mark.redis
@pytest.mark.postgres
async def test_an_admission_goes_on_when_its_charge_is_back_however_busy_the_loop_is(
    make_engine: Any, fake_model: Any, user: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: F7, G6 (a send's charge is made and read by its admitting transaction itself,
    # never through the loop: in a burst the loop is busy taking in the other sends, and an
    # admission that waited for it would hold its database thread for nothing)
    import threading
    import time
    import uuid

    from chatcore.engine import admission_lock

    real_lock = admission_lock.lock_for_admission
    admitting, charge_may_go = threading.Event(), threading.Event()

    def lock(*args: Any, **kwargs: Any) -> Any:
        found = real_lock(*args, **kwargs)
        admitting.set()
        return found

    counts_held(monkeypatch, lambda: charge_may_go.wait(10))
    monkeypatch.setattr(admission_lock, "lock_for_admission", lock)
    backend = {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": redis_url}
    with override_settings(CACHES={"default": {**backend, "KEY_PREFIX": uuid.uuid4().hex}}):
        async with engine_with(make_engine) as engine:
            session = await make_dialog(user)
            fake_model.script(Reply(text="answer"))
            sent = asyncio.create_task(send(engine, session, "hello"))
            while not admitting.is_set():
                await asyncio.sleep(0.01)
            found: list[bool] = []

            def committed() -> None:
                # From a thread of its own, while the loop is blocked below.
                from django.db import connection

                try:
                    for _ in range(500):
                        if Turn.objects.filter(session_id=session.pk).exists():
                            found.append(True)
                            return
                        time.sleep(0.02)
                finally:
                    connection.close()

            # The loop is blocked from here until the watcher is done: the charge comes
            # back and the admission commits meanwhile, or the watcher gives up.
            charge_may_go.set()
            watcher = threading.Thread(target=committed)
            watcher.start()
            watcher.join()
            assert found == [True]
            ack = await sent
            assert ack.turn_id is not None
            await engine.wait_idle(session.pk)
            assert [m.content for m in await history(session)][-2:] == ["hello", "answer"]


def test_the_socket_bound_falls_back_to_the_process_when_redis_is_down() -> None:
    # covers: F7, G5 (an unreachable Redis never locks people out, nor lifts the bound)
    from chatcore.engine.limits import SocketRegistry

    with override_settings(SCALED=True, REDIS_URL="redis://127.0.0.1:1/0"):
        registry = SocketRegistry()
        assert registry.open(7, "c1", 2)
        assert registry.open(7, "c2", 2)
        assert not registry.open(7, "c3", 2)
        registry.close(7, "c1")
        assert registry.open(7, "c3", 2)
        assert registry.count(7) == 2


async def test_history_pages_are_bounded_in_bytes(engine: Any, user: Any) -> None:
    # covers: F7 (fewer messages and has_more=true when a page would pass the byte bound)
    session = await make_dialog(user)
    await sync_to_async(fill_history)(session, 10, size=4000)
    with chat_cfg(HISTORY_PAGE_MAX_BYTES=10_000):
        ws = await ws_connect(user)
        page = await ws.ask({"type": "history", "limit": 500, "client_msg_id": "h"})
        assert page["type"] == "session_history"
        assert 1 <= len(page["messages"]) <= 3 and page["has_more"] is True
        assert page["messages"][-1]["content"].startswith("message 10 ")  # the newest
        await ws.close()

        api = await bearer_api(user)
        status, data = await api.get(f"/sessions/{session.session_id}/messages", limit=500)
        assert status == 200 and data["has_more"] is True
        assert 1 <= len(data["messages"]) <= 3
        status, rest = await api.get(
            f"/sessions/{session.session_id}/messages", from_seq=data["next_from_seq"]
        )
        assert rest["messages"][0]["seq"] == data["next_from_seq"]

    with chat_cfg(HISTORY_PAGE_MAX_BYTES=10):
        # One message larger than the whole bound still comes, alone: pages always move on.
        status, data = await api.get(f"/sessions/{session.session_id}/messages", limit=500)
        assert len(data["messages"]) == 1 and data["has_more"] is True


# --- Item 8: the history cache's budget, the turn deadline ----------------------------------


async def test_history_cache_has_a_byte_budget_and_skips_compacted_history(user: Any) -> None:
    # covers: F7, A5 (LRU within a byte budget; only what follows the last compaction)
    dialogs = [await make_dialog(user, f"h{i}") for i in range(3)]
    for d in dialogs:
        await sync_to_async(fill_history)(d, 200, size=2000)

    def fresh(session: Session) -> Session:
        return Session.objects.get(pk=session.pk)

    probe = SessionStates(max_bytes=10**9)
    await sync_to_async(probe.history)(await sync_to_async(fresh)(dialogs[0]))
    one = probe.size
    states = SessionStates(max_bytes=int(one * 2.5))
    for d in dialogs[:2]:
        await sync_to_async(states.history)(await sync_to_async(fresh)(d))
    # Use the first again, then load the third: the least recently used (second) goes.
    await sync_to_async(states.history)(await sync_to_async(fresh)(dialogs[0]))
    await sync_to_async(states.history)(await sync_to_async(fresh)(dialogs[2]))
    assert dialogs[0].pk in states and dialogs[2].pk in states
    assert dialogs[1].pk not in states
    assert states.size <= int(one * 2.5)

    # A compaction through seq 150: only the 51 messages after it are kept.
    await sync_to_async(Compaction.objects.create)(
        session_id=dialogs[0].pk, through_seq=150, summary="earlier"
    )
    builder = TurnInputBuilder(states=states, context_window=10**9)
    prepared = await builder.prepare(
        session_pk=dialogs[0].pk, runtime=RuntimeInfo(channel="web", dialog_id="h0", title="t")
    )
    assert prepared.compacted_through == 150
    rows = await sync_to_async(states.history)(
        await sync_to_async(fresh)(dialogs[0]), after_seq=150
    )
    assert [m.seq for m in rows] == list(range(151, 202))
    assert states.size < one * 2  # the compacted part left the cache


async def test_a_trickling_model_ends_the_turn_at_its_deadline(
    make_engine: Any, fake_model: Any, recorder: Any, user: Any
) -> None:
    # covers: F7, C9, C10 (failed with kind timeout, partial kept, lease released)
    with chat_cfg(TURN_DEADLINE_SECONDS=1):
        engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="slowly", endless=True))
    ack = await send(engine, session, "take your time")
    done = await terminals(rec, [ack.turn_id], timeout=30)
    frame = done[ack.turn_id]
    assert frame["status"] == "failed" and frame["error"]["kind"] == "timeout"
    assert "too long" in frame["error"]["message"]
    request = (await fake_model.requests_made(1))[0]
    assert await asyncio.to_thread(request.aborted.wait, 10), "the model stream stayed open"
    await engine.wait_idle()
    row = await sync_to_async(Session.objects.get)(pk=session.pk)
    assert row.lease_owner == "" and row.lease_expires_at is None
    last = await sync_to_async(lambda: Message.objects.filter(session=session).last())()
    assert last is not None and last.status == "interrupted" and last.content.startswith("slowly")
    # The dialog goes on.
    fake_model.default = lambda body: Reply(text="quick")
    ack2 = await send(engine, session, "again")
    assert (await terminals(rec, [ack2.turn_id]))[ack2.turn_id]["status"] == "completed"


def test_timeout_failures_are_translated() -> None:
    # covers: F5, C10
    from django.utils import translation

    from chatcore.engine.turns.outcome import FailureKind, present_failure

    english = present_failure(FailureKind.TIMEOUT)
    with translation.override("zh-hans"):
        chinese = present_failure(FailureKind.TIMEOUT)
    assert english != chinese and chinese


@pytest.mark.redis
def test_a_send_s_charge_is_counted_after_redis_closed_the_pools_connection(
    redis_url: str,
) -> None:
    # covers: F7, G5 (an admission's own charge takes a connection of the cache's pool for
    # each trip: one the server closed meanwhile, a restart or an idle timeout, is replaced,
    # and each count is made once)
    import uuid

    import redis

    from chatcore.common.errors import RateLimited
    from chatcore.engine import limits

    backend = {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": redis_url}
    cfg = {"RATE_LIMIT_PER_MINUTE": 2, "WRITE_RATE_PER_MINUTE": 100}

    def charged(user_id: int) -> limits.PendingCharge:
        charge = asyncio.run(limits.charge_beside(user_id, limits.SEND, cfg))
        assert charge is not None
        charge.send()
        return charge

    with override_settings(CACHES={"default": {**backend, "KEY_PREFIX": uuid.uuid4().hex}}):
        charged(9191).wait()
        pool = cache._cache.get_client(write=True).connection_pool  # type: ignore[attr-defined]
        conn = pool.get_connection()
        conn.send_command("CLIENT", "ID")
        client_id = conn.read_response()
        pool.release(conn)
        with redis.Redis.from_url(redis_url) as other:
            other.execute_command("CLIENT", "KILL", "ID", client_id)
        charged(9191).wait()  # the second of the minute: within the budget
        with pytest.raises(RateLimited):
            charged(9191).wait()
