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
from tests.engine_helpers import chat_group_of, make_dialog, send
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


@pytest.mark.usefixtures("within_a_minute")
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


@pytest.mark.usefixtures("within_a_minute")
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


@pytest.mark.usefixtures("within_a_minute")
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


@pytest.mark.usefixtures("within_a_minute")
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
