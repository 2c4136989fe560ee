"""`/ws/chat/` errors (SPEC F3, F6, F7; PROTOCOL "WebSocket: /ws/chat/"): one answer per bad
frame, the connection still usable, nothing stored; limits and shutdown."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import cache

from chatcore.engine import runtime
from sessions_app.models import Message, Turn
from tests.engine_helpers import make_dialog
from tests.fakemodel import Reply
from tests.ws_helpers import (
    assert_usable,
    bearer,
    chat_cfg,
    count,
    open_ws,
    terminal,
)

pytestmark = [pytest.mark.django_db(transaction=True)]


# --- Errors (F3, F6): one answer each, connection still usable, nothing stored -------------

BAD_FRAMES: list[tuple[str, Any, str]] = [
    ("invalid json", "{not json", "bad_request"),
    ("not an object", "[1, 2]", "bad_request"),
    ("a string", '"send"', "bad_request"),
    ("no type", {"content": "x", "client_msg_id": "e"}, "bad_request"),
    ("unknown type", {"type": "shout", "client_msg_id": "e"}, "bad_request"),
    ("missing content", {"type": "send", "client_msg_id": "e"}, "bad_request"),
    ("content not a string", {"type": "send", "content": 5, "client_msg_id": "e"}, "bad_request"),
    ("empty content", {"type": "send", "content": "   ", "client_msg_id": "e"}, "bad_request"),
    (
        "steer not a string",
        {"type": "steer", "content": ["x"], "client_msg_id": "e"},
        "bad_request",
    ),
    ("inject empty", {"type": "inject", "content": "", "client_msg_id": "e"}, "bad_request"),
    (
        "dialog id not matching the rules",
        {"type": "send", "content": "x", "dialog_id": "no spaces", "client_msg_id": "e"},
        "bad_request",
    ),
    (
        "dialog id not a string",
        {"type": "send", "content": "x", "dialog_id": 7, "client_msg_id": "e"},
        "bad_request",
    ),
    (
        "unknown dialog",
        {"type": "send", "content": "x", "dialog_id": "missing", "client_msg_id": "e"},
        "not_found",
    ),
    (
        "stop unknown dialog",
        {"type": "stop", "dialog_id": "missing", "client_msg_id": "e"},
        "not_found",
    ),
    (
        "history limit not an int",
        {"type": "history", "limit": "10", "client_msg_id": "e"},
        "bad_request",
    ),
    (
        "history limit a bool",
        {"type": "history", "limit": True, "client_msg_id": "e"},
        "bad_request",
    ),
    (
        "history limit over 500",
        {"type": "history", "limit": 501, "client_msg_id": "e"},
        "bad_request",
    ),
    (
        "history before_seq 0",
        {"type": "history", "before_seq": 0, "client_msg_id": "e"},
        "bad_request",
    ),
    (
        "history before_seq float",
        {"type": "history", "before_seq": 2.5, "client_msg_id": "e"},
        "bad_request",
    ),
    (
        "content over the content limit",
        {"type": "send", "content": "x" * (65_536 + 1), "client_msg_id": "e"},
        "too_large",
    ),
    (
        "client_msg_id too long",
        {"type": "send", "content": "x", "client_msg_id": "e" * 129},
        "bad_request",
    ),
    ("retry with nothing to retry", {"type": "retry", "client_msg_id": "e"}, "bad_request"),
    (
        "unknown slash command",
        {"type": "send", "content": "/frobnicate", "client_msg_id": "e"},
        "unknown_command",
    ),
    (
        "slash command bad argument",
        {"type": "send", "content": "/switch a b", "client_msg_id": "e"},
        "bad_request",
    ),
    (
        "switch to a missing dialog",
        {"type": "send", "content": "/switch nope", "client_msg_id": "e"},
        "not_found",
    ),
]


@pytest.mark.parametrize(("case", "frame", "code"), BAD_FRAMES, ids=[c[0] for c in BAD_FRAMES])
async def test_bad_frames_get_one_error_each(
    connect: Any, user: Any, case: str, frame: Any, code: str
) -> None:
    # covers: F3, F6, B3
    ws = await connect(user)
    messages_before = await count(Message)
    await ws.send(frame)
    answer = await ws.next()
    assert answer["type"] == "error" and answer["code"] == code, answer
    assert answer["message"]
    if isinstance(frame, dict) and isinstance(frame.get("client_msg_id"), str):
        assert answer["client_msg_id"] == frame["client_msg_id"]
    else:
        assert answer["client_msg_id"] is None
    assert await ws.drain(0.2) == []
    await assert_usable(ws)
    assert await count(Turn) == 0
    assert await count(Message) == messages_before


async def test_client_msg_id_not_a_string_and_binary_frames(connect: Any, user: Any) -> None:
    # covers: F3
    ws = await connect(user)
    await ws.send({"type": "send", "content": "x", "client_msg_id": 5})
    answer = await ws.next()
    assert answer["code"] == "bad_request" and answer["client_msg_id"] is None
    await ws.comm.send_to(bytes_data=b'{"type": "sessions"}')
    assert (await ws.next())["code"] == "bad_request"
    await assert_usable(ws)
    assert await count(Turn) == 0


async def test_frame_over_the_frame_limit(connect: Any, user: Any) -> None:
    # covers: F3, F6 (256 KiB frames; the content check never sees it)
    ws = await connect(user)
    limit = settings.CHAT["FRAME_LIMIT_BYTES"]
    assert limit == 256 * 1024
    frame = json.dumps({"type": "send", "content": "y" * limit, "client_msg_id": "big"})
    await ws.send(frame)
    answer = await ws.next()
    assert answer["type"] == "error" and answer["code"] == "too_large"
    # Multi-byte text counts in bytes, not characters.
    await ws.send(
        json.dumps({"type": "send", "content": "字" * (limit // 3 + 10)}, ensure_ascii=False)
    )
    assert (await ws.next())["code"] == "too_large"
    await assert_usable(ws)
    assert await count(Turn) == 0


async def test_another_users_dialog_is_not_found(connect: Any, user: Any, other_user: Any) -> None:
    # covers: F2
    await make_dialog(other_user, "secret")
    ws = await connect(user)
    for frame in (
        {"type": "send", "content": "hi", "dialog_id": "secret", "client_msg_id": "x1"},
        {"type": "history", "dialog_id": "secret", "client_msg_id": "x2"},
        {"type": "send", "content": "/switch secret", "client_msg_id": "x3"},
    ):
        answer = await ws.ask(frame)
        assert answer["type"] == "error" and answer["code"] == "not_found"
    assert await count(Turn) == 0


@pytest_asyncio.fixture
async def engine_with(make_engine: Callable[..., Any]) -> AsyncIterator[Callable[..., Any]]:
    """An engine made under changed CHAT settings, installed as the process engine."""
    installed = []

    async def factory(**cfg: Any) -> Any:
        with chat_cfg(**cfg):
            made = await make_engine()
        runtime.set_engine(made)
        installed.append(made)
        return made

    yield factory
    runtime.set_engine(None)


@pytest.mark.usefixtures("within_a_minute")
async def test_rate_limited(engine_with: Any, make_user: Any, fake_model: Any) -> None:
    # covers: F3
    await sync_to_async(cache.clear)()
    await engine_with(RATE_LIMIT_PER_MINUTE=1)
    user = await sync_to_async(make_user)()
    ws, _ = await open_ws(await bearer(user))
    await ws.drain()
    first = await ws.ask({"type": "send", "content": "one", "client_msg_id": "r1"})
    assert first["type"] == "queued"
    refused = await ws.ask({"type": "send", "content": "two", "client_msg_id": "r2"})
    assert refused["type"] == "error" and refused["code"] == "rate_limited"
    assert refused["retry_after"] > 0
    await ws.until(terminal(first["turn_id"]))
    await assert_usable(ws)
    assert await count(Turn) == 1
    await ws.close()


async def test_queue_full_and_overloaded(engine_with: Any, make_user: Any, fake_model: Any) -> None:
    # covers: C1, F3
    engine = await engine_with(QUEUE_CAPACITY=1, GLOBAL_ADMISSION_BOUND=1)
    user = await sync_to_async(make_user)()
    await make_dialog(user, "one")
    ws, _ = await open_ws(await bearer(user), "/ws/chat/?dialog_id=one")
    await ws.drain()
    gate = threading.Event()
    fake_model.script(Reply(text="slow", gate=gate))
    running = await ws.ask({"type": "send", "content": "a", "client_msg_id": "q1"})
    await fake_model.requests_made(1)
    queued = await ws.ask({"type": "send", "content": "b", "client_msg_id": "q2"})
    assert queued["type"] == "queued" and queued["position"] == 1
    full = await ws.ask({"type": "send", "content": "c", "client_msg_id": "q3"})
    assert full["type"] == "error" and full["code"] == "queue_full"
    await make_dialog(user, "two")
    over = await ws.ask({"type": "send", "content": "d", "dialog_id": "two", "client_msg_id": "q4"})
    assert over["type"] == "error" and over["code"] == "overloaded"
    assert await count(Turn) == 2
    gate.set()
    await ws.until(terminal(queued["turn_id"]))
    assert running["turn_id"] != queued["turn_id"]
    await ws.close()
    await engine.wait_idle()


async def test_shutting_down(connect: Any, engine: Any, user: Any) -> None:
    # covers: B3, F1
    ws = await connect(user)
    engine.supervisor.close()
    for frame in (
        {"type": "send", "content": "late", "client_msg_id": "s1"},
        {"type": "retry", "client_msg_id": "s2"},
    ):
        answer = await ws.ask(frame)
        assert answer["type"] == "error" and answer["code"] == "shutting_down"
    await assert_usable(ws)
    assert await count(Turn) == 0
