"""REST API messages and turns (SPEC E3, C4-C6, F3, F7; PROTOCOL "REST API"): sends,
steers, injects, limits, stop, retry, compaction, turns and message pages, through the real
ASGI stack and engine on the fake model server."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import cache
from django.test import override_settings

from sessions_app.models import Turn
from tests.api_helpers import (
    Api,
    engine_with,
    error_of,
)
from tests.fakemodel import Reply

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


# --- Messages and turns -----------------------------------------------------------------------


async def test_send_is_accepted_and_the_turn_completes(api: Api, user: Any) -> None:
    # covers: E3, C2
    s = await api.create(dialog_id="chat")
    ack = await api.send(s["session_id"], "hi there", client_msg_id="c-1")
    assert ack["session_id"] == s["session_id"]
    assert ack["position"] == 0 and ack["mode"] == "send" and ack["client_msg_id"] == "c-1"
    turn = await api.turn_done(ack["turn_id"])
    assert turn["status"] == "completed"
    assert turn["reason"] is None and turn["error"] is None
    assert turn["session_id"] == s["session_id"] and turn["client_msg_id"] == "c-1"
    roles = [(m["role"], m["content"]) for m in turn["messages"]]
    assert roles == [("user", "hi there"), ("assistant", "echo: hi there")]
    user_message = turn["messages"][0]
    assert user_message["source"]["from_channel"] == "api"
    assert "from_user_id" not in user_message["source"]  # sender ids stay private
    assert "tool_calls" not in user_message  # optional fields only when present

    _, page = await api.get(f"/sessions/{s['session_id']}/messages")
    assert [m["seq"] for m in page["messages"]] == [1, 2, 3]
    assert page["history_revision"] == 3 and page["has_more"] is False
    _, state = await api.get(f"/sessions/{s['session_id']}")
    assert state["message_count"] == 1 and state["status"] == "idle"


async def test_session_shows_the_running_turn_and_the_queue(api: Api, fake_model: Any) -> None:
    # covers: E3, C2, D3
    s = await api.create(dialog_id="q")
    gate = threading.Event()
    fake_model.script(Reply(text="first answer", gate=gate), Reply(text="second"))
    first = await api.send(s["session_id"], "one")
    second = await api.send(s["session_id"], "two", client_msg_id="m2")
    assert second["position"] == 1
    state = await api.until(
        f"/sessions/{s['session_id']}",
        lambda d: d["status"] == "running" and d["active_turn"]["text"] == "first answer",
    )
    assert state["active_turn"]["turn_id"] == first["turn_id"]
    assert state["active_turn"]["text_offset"] == 0
    assert state["queue"] == [
        {"turn_id": second["turn_id"], "mode": "send", "client_msg_id": "m2", "preview": "two"}
    ]
    _, listed = await api.get("/sessions")
    assert listed["items"][0]["status"] == "running"
    status, turn = await api.get(f"/turns/{second['turn_id']}")
    assert turn["status"] == "queued" and turn["messages"] == []
    gate.set()
    assert (await api.turn_done(second["turn_id"]))["status"] == "completed"


async def test_steer_joins_the_running_turn(api: Api, fake_model: Any) -> None:
    # covers: E3, C4
    s = await api.create(dialog_id="steer")
    gate = threading.Event()
    fake_model.script(Reply(text="step one", gate=gate), Reply(text="steered answer"))
    ack = await api.send(s["session_id"], "start")
    await fake_model.requests_made(1)  # the turn is past its model request
    steer = await api.send(s["session_id"], "also this", mode="steer")
    assert steer["mode"] == "steer" and steer["turn_id"] == ack["turn_id"]
    gate.set()
    turn = await api.turn_done(ack["turn_id"])
    assert [m["content"] for m in turn["messages"]] == [
        "start",
        "step one",
        "also this",
        "steered answer",
    ]


async def test_idle_steer_is_a_send(api: Api) -> None:
    # covers: C4
    s = await api.create(dialog_id="idle-steer")
    ack = await api.send(s["session_id"], "as a send", mode="steer")
    assert ack["mode"] == "send" and ack["turn_id"]
    assert (await api.turn_done(ack["turn_id"]))["status"] == "completed"


async def test_idle_inject_appends_without_a_turn(api: Api, fake_model: Any) -> None:
    # covers: E3, C5
    s = await api.create(dialog_id="inj")
    ack = await api.send(s["session_id"], "context only", mode="inject")
    assert ack["turn_id"] is None and ack["mode"] == "inject"
    _, page = await api.get(f"/sessions/{s['session_id']}/messages", from_seq=2)
    assert [(m["role"], m["content"]) for m in page["messages"]] == [("user", "context only")]
    assert fake_model.turn_requests() == []


@pytest.mark.parametrize(
    "body",
    [
        {"content": ""},
        {"content": "   \n"},
        {},
        {"content": None},
        {"content": 12},
        {"content": "x", "mode": "shout"},
        {"content": "x", "client_msg_id": "c" * 129},
        {"content": "nul \x00 inside"},
        {"content": "lone \ud800 surrogate"},
    ],
    ids=lambda b: json.dumps(b)[:40],
)
async def test_send_rejects_bad_input_with_422(api: Api, body: dict[str, Any]) -> None:
    # covers: E3, C2
    s = await api.create(dialog_id="bad")
    status, data = await api.post(f"/sessions/{s['session_id']}/messages", body)
    error_of(status, data, 422, "bad_request")
    assert await sync_to_async(Turn.objects.count)() == 0
    _, page = await api.get(f"/sessions/{s['session_id']}/messages")
    assert len(page["messages"]) == 1  # a refused send writes nothing (C2)


async def test_send_to_an_unknown_dialog_is_404(api: Api, user: Any) -> None:
    status, data = await api.post(f"/sessions/api:u{user.pk}:none/messages", {"content": "x"})
    error_of(status, data, 404, "not_found")


async def test_too_long_content_is_413(api: Api, make_engine: Any) -> None:
    # covers: F3, F6
    s = await api.create(dialog_id="big")
    async with engine_with(make_engine, CONTENT_LIMIT=10):
        status, data = await api.post(
            f"/sessions/{s['session_id']}/messages", {"content": "x" * 11}
        )
        error_of(status, data, 413, "too_large")
        # The body guard refuses an oversized body before parsing it.
        status, data = await api.post(
            f"/sessions/{s['session_id']}/messages", {"content": "y" * 200_000}
        )
        error_of(status, data, 413, "too_large")
        ack = await api.send(s["session_id"], "x" * 10)
        assert ack["turn_id"]
    assert await sync_to_async(Turn.objects.count)() == 1


async def test_body_guard_follows_djangos_upload_limit(api: Api) -> None:
    # covers: F3
    s = await api.create(dialog_id="guard")
    with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000):
        status, data = await api.post(
            f"/sessions/{s['session_id']}/messages", {"content": "z" * 2000}
        )
    error_of(status, data, 413, "too_large")
    assert await sync_to_async(Turn.objects.count)() == 0


@pytest.mark.usefixtures("within_a_minute")
async def test_rate_limit_is_429_with_retry_after(api: Api, make_engine: Any) -> None:
    # covers: F3
    s = await api.create(dialog_id="rl")
    await sync_to_async(cache.clear)()
    async with engine_with(make_engine, RATE_LIMIT_PER_MINUTE=2):
        await api.send(s["session_id"], "one", mode="inject")
        await api.send(s["session_id"], "two", mode="inject")
        status, data, response = await api.call(
            "POST", f"/sessions/{s['session_id']}/messages", {"content": "three"}
        )
    error_of(status, data, 429, "rate_limited")
    assert 1 <= int(response["Retry-After"]) <= 60
    await sync_to_async(cache.clear)()


async def test_full_queue_is_409(api: Api, fake_model: Any, make_engine: Any) -> None:
    # covers: C1, F3
    s = await api.create(dialog_id="full")
    gate = threading.Event()
    fake_model.script(Reply(text="slow", gate=gate))
    async with engine_with(make_engine, QUEUE_CAPACITY=2):
        first = await api.send(s["session_id"], "running")
        await fake_model.requests_made(1)  # the turn is past its model request
        await api.send(s["session_id"], "queued 1")
        await api.send(s["session_id"], "queued 2")
        status, data = await api.post(f"/sessions/{s['session_id']}/messages", {"content": "no"})
        error_of(status, data, 409, "queue_full")
        gate.set()
        await api.turn_done(first["turn_id"])


async def test_stop_cancels_the_running_turn_and_drops_the_queue(api: Api, fake_model: Any) -> None:
    # covers: E3, C6
    s = await api.create(dialog_id="stop")
    fake_model.script(Reply(text="partial answer", endless=True))
    running = await api.send(s["session_id"], "go")
    queued = await api.send(s["session_id"], "later")
    await api.until(
        f"/sessions/{s['session_id']}",
        lambda d: d["active_turn"] is not None and "partial" in d["active_turn"]["text"],
    )
    status, data = await api.post(f"/sessions/{s['session_id']}/stop")
    assert status == 200
    assert data == {"stopped_running": True, "dropped": 1}
    stopped = await api.turn_done(running["turn_id"])
    assert stopped["status"] == "cancelled"
    partial = [m for m in stopped["messages"] if m["role"] == "assistant"]
    assert partial and partial[0]["status"] == "cancelled"
    dropped = await api.turn_done(queued["turn_id"])
    assert dropped["status"] == "cancelled" and dropped["reason"] == "dropped"

    status, data = await api.post(f"/sessions/{s['session_id']}/stop")
    assert status == 200 and data == {"stopped_running": False, "dropped": 0}


async def test_retry_reruns_the_last_cancelled_turn(api: Api, fake_model: Any) -> None:
    # covers: E3, C6
    s = await api.create(dialog_id="retry")
    status, data = await api.post(f"/sessions/{s['session_id']}/retry")
    assert status == 409, data  # nothing to retry yet
    fake_model.script(Reply(text="cut", endless=True), Reply(text="second try"))
    ack = await api.send(s["session_id"], "question")
    await fake_model.requests_made(1)  # the turn is past its model request
    await api.post(f"/sessions/{s['session_id']}/stop")
    await api.turn_done(ack["turn_id"])

    status, retried = await api.post(f"/sessions/{s['session_id']}/retry", {"client_msg_id": "r1"})
    assert status == 202, retried
    assert retried["mode"] == "retry" and retried["turn_id"] != ack["turn_id"]
    assert retried["client_msg_id"] == "r1"
    turn = await api.turn_done(retried["turn_id"])
    assert turn["status"] == "completed"
    assert [m["content"] for m in turn["messages"]] == ["second try"]  # no second user message
    _, page = await api.get(f"/sessions/{s['session_id']}/messages")
    assert [m["content"] for m in page["messages"] if m["role"] == "user"] == ["question"]


async def test_compact_is_accepted(api: Api, fake_model: Any) -> None:
    # covers: E3, B5
    s = await api.create(dialog_id="compact")
    for i in range(8):
        await api.send(s["session_id"], f"fact {i}", mode="inject")
    status, data = await api.post(f"/sessions/{s['session_id']}/compact")
    assert status == 202
    assert data == {"session_id": s["session_id"], "accepted": True}
    status, data = await api.post(f"/sessions/{s['session_id']}x/compact")
    error_of(status, data, 404, "not_found")


async def test_get_turn_unknown_or_malformed_is_404(api: Api) -> None:
    # covers: E3, F2
    for turn_id in ("00000000-0000-0000-0000-000000000000", "nope", "1", "%20"):
        status, data = await api.get(f"/turns/{turn_id}")
        error_of(status, data, 404, "not_found")


# --- Message pages ----------------------------------------------------------------------------


async def test_messages_page_by_from_seq(api: Api) -> None:
    # covers: E3, A3
    s = await api.create(dialog_id="pages")
    sid = s["session_id"]
    for i in range(6):
        await api.send(sid, f"m{i}", mode="inject")  # seqs 2..7 (1 is the welcome)

    status, page = await api.get(f"/sessions/{sid}/messages", from_seq=0, limit=3)
    assert status == 200
    assert [m["seq"] for m in page["messages"]] == [1, 2, 3]
    assert page["has_more"] is True and page["next_from_seq"] == 4
    assert page["history_revision"] == 7

    # New messages arrive between pages: the next page neither skips nor repeats.
    await api.send(sid, "late", mode="inject")
    _, page2 = await api.get(f"/sessions/{sid}/messages", from_seq=page["next_from_seq"], limit=3)
    assert [m["seq"] for m in page2["messages"]] == [4, 5, 6]
    assert page2["has_more"] is True and page2["history_revision"] == 8
    _, page3 = await api.get(f"/sessions/{sid}/messages", from_seq=page2["next_from_seq"], limit=3)
    assert [m["content"] for m in page3["messages"]] == ["m5", "late"]
    assert page3["has_more"] is False and page3["next_from_seq"] == 9
    _, beyond = await api.get(f"/sessions/{sid}/messages", from_seq=100)
    assert beyond["messages"] == [] and beyond["has_more"] is False
    assert beyond["next_from_seq"] == 100

    _, everything = await api.get(f"/sessions/{sid}/messages", limit=500)
    assert [m["seq"] for m in everything["messages"]] == list(range(1, 9))
    first = everything["messages"][0]
    assert set(first) >= {"id", "seq", "role", "content", "created_at"}


@pytest.mark.parametrize(
    "params",
    [{"limit": 0}, {"limit": 501}, {"from_seq": -1}, {"from_seq": 2**63}, {"limit": "many"}],
    ids=str,
)
async def test_messages_page_rejects_bad_paging(api: Api, params: dict[str, Any]) -> None:
    s = await api.create(dialog_id="badpages")
    status, data = await api.get(f"/sessions/{s['session_id']}/messages", **params)
    error_of(status, data, 422, "bad_request")
