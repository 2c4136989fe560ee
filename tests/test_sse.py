"""Server-Sent Events of the REST API in-process (`sessions_app/sse.py`; SPEC C3, D1, D3, F8;
PROTOCOL "REST API" streaming): the frames of one turn, idle injects, refusals, joins of a
running turn, retries, keepalives, Redis and a terminal the layer lost."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import pytest
from django.test import override_settings

from chatcore.engine import runtime
from tests.api_helpers import (
    BASE,
    Api,
    engine_with,
    error_of,
    parse_sse,
    read_stream,
    stream_post,
)
from tests.fakemodel import Reply

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


async def test_sse_streams_the_turn_in_process(api: Api, fake_model: Any) -> None:
    # covers: E3, D1, D3
    s = await api.create(dialog_id="sse")
    fake_model.script(Reply(text="streamed answer, word by word", chunk=3, delay=0.01))
    response = await api.client.post(
        f"{BASE}/sessions/{s['session_id']}/messages",
        {"content": "stream please", "client_msg_id": "s1"},
        content_type="application/json",
        headers={**api.headers, "Accept": "text/event-stream"},
    )
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/event-stream")
    events = await asyncio.wait_for(read_stream(response), 20)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "queued" and kinds[1] == "history_delta" and kinds[-1] == "turn_updated"
    assert kinds[-2] == "history_delta"
    assert set(kinds[2:-2]) == {"turn_snapshot"}
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    turn_id = events[0]["turn_id"]
    assert events[0]["client_msg_id"] == "s1"
    assert all(e.get("turn_id") == turn_id for e in events)
    text = ""
    for e in events[2:-2]:
        text = text[: e["text_offset"]] + e["text"]
    assert text == "streamed answer, word by word"
    assert events[-2]["messages"][-1]["content"] == text
    assert events[-1]["status"] == "completed"


async def test_sse_idle_inject_streams_queued_then_its_delta(api: Api) -> None:
    # covers: C5, E3
    s = await api.create(dialog_id="sse-inject")
    response = await api.client.post(
        f"{BASE}/sessions/{s['session_id']}/messages",
        {"content": "ctx", "mode": "inject"},
        content_type="application/json",
        headers={**api.headers, "Accept": "text/event-stream"},
    )
    events = await asyncio.wait_for(read_stream(response), 10)
    assert [e["event"] for e in events] == ["queued", "history_delta"]
    assert events[0]["turn_id"] is None
    assert events[1]["messages"][0]["content"] == "ctx"
    assert events[1]["history_revision"] == 2


async def test_sse_refusal_is_a_json_error(api: Api, make_engine: Any) -> None:
    s = await api.create(dialog_id="sse-bad")
    async with engine_with(make_engine, CONTENT_LIMIT=3):
        status, data, _ = await api.call(
            "POST",
            f"/sessions/{s['session_id']}/messages",
            {"content": "too long"},
            headers={"Accept": "text/event-stream"},
        )
    error_of(status, data, 413, "too_large")


async def test_sse_steer_joins_the_running_turn_with_a_full_snapshot(
    api: Api, fake_model: Any
) -> None:
    # covers: C4, D3: a stream that joins mid-turn first gets the whole text so far.
    s = await api.create(dialog_id="sse-steer")
    gate = threading.Event()
    fake_model.script(Reply(text="first part", gate=gate), Reply(text=" and the rest"))
    ack = await api.send(s["session_id"], "begin")
    await api.until(
        f"/sessions/{s['session_id']}",
        lambda d: d["active_turn"] is not None and d["active_turn"]["text"] == "first part",
    )
    response = await stream_post(
        api, f"/sessions/{s['session_id']}/messages", {"content": "steer it", "mode": "steer"}
    )
    reader = asyncio.ensure_future(read_stream(response))
    await asyncio.sleep(0.3)
    gate.set()
    events = await asyncio.wait_for(reader, 20)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "queued" and kinds[-1] == "turn_updated"
    assert events[0]["mode"] == "steer" and events[0]["turn_id"] == ack["turn_id"]
    snapshots = [e for e in events if e["event"] == "turn_snapshot"]
    assert snapshots[0]["text_offset"] == 0 and snapshots[0]["text"] == "first part"
    text = ""
    for e in snapshots:
        assert e["text_offset"] <= len(text)
        text = text[: e["text_offset"]] + e["text"]
    assert text.endswith(" and the rest")
    assert events[-1]["turn_id"] == ack["turn_id"] and events[-1]["status"] == "completed"
    deltas = [m["content"] for e in events if e["event"] == "history_delta" for m in e["messages"]]
    assert "steer it" in deltas


async def test_sse_retry_streams_the_new_turn(api: Api, fake_model: Any) -> None:
    # covers: C6, E3
    s = await api.create(dialog_id="sse-retry")
    fake_model.script(Reply(text="x", endless=True), Reply(text="retried answer"))
    ack = await api.send(s["session_id"], "q")
    await fake_model.requests_made(1)  # the turn is past its model request
    await api.post(f"/sessions/{s['session_id']}/stop")
    await api.turn_done(ack["turn_id"])
    response = await stream_post(api, f"/sessions/{s['session_id']}/retry")
    events = await asyncio.wait_for(read_stream(response), 20)
    assert events[0]["event"] == "queued" and events[0]["mode"] == "retry"
    assert events[-1]["event"] == "turn_updated" and events[-1]["status"] == "completed"
    assert events[-1]["turn_id"] == events[0]["turn_id"] != ack["turn_id"]


async def test_sse_sends_keepalives_while_silent(
    api: Api, fake_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: E3
    from sessions_app import sse as sse_module

    monkeypatch.setattr(sse_module, "SSE_KEEPALIVE_SECONDS", 0.05)
    s = await api.create(dialog_id="sse-quiet")
    gate = threading.Event()
    fake_model.script(Reply(text="late", gate=gate))
    response = await stream_post(api, f"/sessions/{s['session_id']}/messages", {"content": "hi"})
    chunks: list[str] = []

    async def consume() -> None:
        async for chunk in response.streaming_content:
            chunks.append(chunk.decode() if isinstance(chunk, bytes) else chunk)

    reader = asyncio.ensure_future(consume())
    await asyncio.sleep(0.5)
    gate.set()
    await asyncio.wait_for(reader, 20)
    raw = "".join(chunks)
    assert ": keepalive\n\n" in raw
    assert parse_sse(raw)[-1]["status"] == "completed"


@pytest.mark.redis
async def test_sse_over_redis_keeps_every_frame_across_keepalives(
    api: Api, fake_model: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: E3, D1, D3 in scaled mode: keepalive timeouts never drop frames (the Redis
    # pub/sub layer unsubscribes a channel whose receive is cancelled).
    from channels.layers import get_channel_layer

    from chatcore.engine.engine import Engine
    from chatcore.engine.provider import OpenAIProvider
    from sessions_app import sse as sse_module

    monkeypatch.setattr(sse_module, "SSE_KEEPALIVE_SECONDS", 0.01)
    layers = {
        "default": {
            "BACKEND": "chatcore.common.redislayer.RedisPubSubLayer",
            "CONFIG": {"hosts": [redis_url], "prefix": f"t{uuid.uuid4().hex[:8]}"},
        }
    }
    answer = "Every frame arrives, however long the pauses between them are."
    previous = await runtime.get_engine()
    with override_settings(CHANNEL_LAYERS=layers):
        engine = Engine(
            provider=OpenAIProvider(
                base_url=fake_model.url, api_key="sk-test", model="fake", retry_base_delay=0.01
            )
        )
        await engine.start()
        runtime.set_engine(engine)
        try:
            s = await api.create(dialog_id="redis-sse")
            fake_model.script(Reply(text=answer, chunk=3, delay=0.06))
            response = await stream_post(
                api, f"/sessions/{s['session_id']}/messages", {"content": "go"}
            )
            chunks: list[str] = []
            async for chunk in response.streaming_content:
                chunks.append(chunk.decode() if isinstance(chunk, bytes) else chunk)
            raw = "".join(chunks)
        finally:
            runtime.set_engine(previous)
            await engine.shutdown(grace=2)
            await get_channel_layer().flush()
    assert raw.count(": keepalive") > 3
    events = parse_sse(raw)
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["queued", "history_delta"]
    assert kinds[-2:] == ["history_delta", "turn_updated"]
    text = ""
    for e in events[2:-2]:
        text = text[: e["text_offset"]] + e["text"]
    assert text == answer
    assert events[-2]["messages"][-1]["content"] == answer


async def test_sse_ends_with_the_stored_terminal_when_the_layer_loses_it(
    api: Api, fake_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: C2, E3: every accepted send ends with one terminal, on the stream too.
    from chatcore.common import publish
    from sessions_app import sse as sse_module

    monkeypatch.setattr(sse_module, "SSE_KEEPALIVE_SECONDS", 0.05)
    monkeypatch.setattr(sse_module, "SSE_TERMINAL_GRACE_SECONDS", 0.1)
    original = publish.apublish

    async def lossy(group: str, frame: dict[str, Any]) -> None:
        if frame.get("type") != "turn_updated":
            await original(group, frame)

    monkeypatch.setattr(publish, "apublish", lossy)
    s = await api.create(dialog_id="lossy")
    response = await stream_post(api, f"/sessions/{s['session_id']}/messages", {"content": "hi"})
    events = await asyncio.wait_for(read_stream(response), 20)
    assert events[-1]["event"] == "turn_updated"
    assert events[-1]["status"] == "completed"
    assert events[-1]["turn_id"] == events[0]["turn_id"]
