"""The `/ws/chat/` consumer through the real ASGI application (`chatcore.asgi.application`),
the real engine and a fake OpenAI-compatible model server: auth, connect state, frame order,
every client frame and error, slash commands, fan-out, mid-turn joins, snapshot gaps
(PROTOCOL "WebSocket: /ws/chat/"; SPEC D1-D3, E1, F2, F3, F6)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.core.cache import cache
from django.test import Client, override_settings

from chatcore.asgi import application
from chatcore.common import publish
from chatcore.engine import runtime
from sessions_app import services
from sessions_app.models import ApiToken, Message, Session, Turn
from tests.engine_helpers import make_dialog
from tests.fakemodel import Reply

pytestmark = [pytest.mark.django_db(transaction=True)]


def chat_cfg(**changes: Any) -> Any:
    return override_settings(CHAT={**settings.CHAT, **changes})


class WS:
    """A test client of `/ws/chat/`: JSON frames in, JSON frames out."""

    def __init__(self, comm: WebsocketCommunicator) -> None:
        self.comm = comm
        self.seen: list[dict[str, Any]] = []
        # The connect frames.
        self.sessions: dict[str, Any] = {}
        self.history: dict[str, Any] = {}

    async def send(self, frame: dict[str, Any] | str) -> None:
        await self.comm.send_to(text_data=frame if isinstance(frame, str) else json.dumps(frame))

    async def next(self, timeout: float = 10.0) -> dict[str, Any]:
        frame = json.loads(await self.comm.receive_from(timeout))
        self.seen.append(frame)
        return frame

    async def until(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 15.0
    ) -> list[dict[str, Any]]:
        """Frames up to and including the first that matches."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        out: list[dict[str, Any]] = []
        while True:
            try:
                frame = await self.next(max(0.05, deadline - loop.time()))
            except TimeoutError:
                raise AssertionError(f"no matching frame; received {out!r}") from None
            out.append(frame)
            if pred(frame):
                return out

    async def drain(self, quiet: float = 0.3) -> list[dict[str, Any]]:
        """Everything that arrives until the connection is quiet for `quiet` seconds."""
        out = []
        while not await self.comm.receive_nothing(timeout=quiet):
            out.append(await self.next())
        return out

    async def ask(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Send a frame and return the answer that carries its client_msg_id."""
        cmid = frame["client_msg_id"]
        await self.send(frame)
        frames = await self.until(lambda f: f.get("client_msg_id") == cmid)
        return frames[-1]

    async def close(self) -> None:
        await self.comm.disconnect()


async def open_ws(headers: list[tuple[bytes, bytes]], path: str = "/ws/chat/") -> tuple[WS, bool]:
    comm = WebsocketCommunicator(application, path, headers=headers)
    connected, _sub = await comm.connect(timeout=10)
    return WS(comm), connected


async def bearer(user: Any) -> list[tuple[bytes, bytes]]:
    _token, raw = await sync_to_async(services.api_token_issue)(user=user, name="ws")
    return [(b"authorization", f"Bearer {raw}".encode())]


@pytest_asyncio.fixture
async def connect(engine: Any) -> AsyncIterator[Callable[..., Any]]:
    """Open authenticated connections (bearer token) that read their connect frames."""
    opened: list[WS] = []

    async def factory(user: Any, path: str = "/ws/chat/") -> WS:
        ws, connected = await open_ws(await bearer(user), path)
        assert connected
        opened.append(ws)
        sessions = await ws.next()
        assert sessions["type"] == "sessions"
        hist = await ws.next()
        assert hist["type"] == "session_history"
        ws.sessions, ws.history = sessions, hist
        return ws

    yield factory
    for ws in opened:
        await ws.close()


async def assert_closed_unauthenticated(ws: WS) -> None:
    output = await ws.comm.receive_output(timeout=5)
    assert output == {"type": "websocket.close", "code": 4401}


async def count(model: Any, **filters: Any) -> int:
    return await sync_to_async(lambda: model.objects.filter(**filters).count())()


def text_of(frames: list[dict[str, Any]], turn_id: str, known: str = "") -> str:
    """Apply snapshot frames as a client does; every frame must apply contiguously."""
    for f in frames:
        if f["type"] == "turn_snapshot" and f["turn_id"] == turn_id:
            assert f["text_offset"] in (0, len(known)), (f["text_offset"], len(known))
            known = known[: f["text_offset"]] + f["text"]
    return known


def terminal(turn_id: str) -> Callable[[dict[str, Any]], bool]:
    return lambda f: f["type"] == "turn_updated" and f["turn_id"] == turn_id


# --- Auth (F2) ----------------------------------------------------------------------------


async def test_unauthenticated_is_accepted_then_closed_4401(engine: Any) -> None:
    # covers: F2
    ws, connected = await open_ws([])
    assert connected
    await assert_closed_unauthenticated(ws)


async def session_cookie(user: Any) -> bytes:
    client = Client()
    await sync_to_async(client.force_login)(user)
    name = settings.SESSION_COOKIE_NAME
    return f"{name}={client.cookies[name].value}".encode()


async def test_session_cookie_with_an_allowed_origin(engine: Any, user: Any) -> None:
    # covers: F2, E1
    cookie = await session_cookie(user)
    ws, connected = await open_ws(
        [(b"cookie", cookie), (b"host", b"testserver"), (b"origin", b"http://testserver")]
    )
    assert connected
    sessions = await ws.next()
    assert sessions["type"] == "sessions"
    assert sessions["items"][0]["session_id"].startswith(f"web:u{user.pk}:")
    await ws.close()


@pytest.mark.parametrize(
    "origin", [None, b"http://evil.example", b"null", b"http://testserver.evil.example"]
)
async def test_session_cookie_without_an_allowed_origin_is_unauthenticated(
    engine: Any, user: Any, origin: bytes | None
) -> None:
    # covers: F2 (cross-site WebSocket hijacking)
    headers = [(b"cookie", await session_cookie(user))]
    if origin is not None:
        headers.append((b"origin", origin))
    ws, connected = await open_ws(headers)
    assert connected
    await assert_closed_unauthenticated(ws)


@pytest.mark.parametrize(
    ("host", "origin", "extra", "settings_changes", "allowed"),
    [
        ("testserver", "http://testserver:80", [], {}, True),  # the default port, spelled out
        ("testserver:8000", "http://testserver:8000", [], {}, True),
        ("testserver:8000", "http://testserver:1", [], {}, False),  # another port
        ("testserver:8000", "http://testserver", [], {}, False),
        ("testserver", "https://testserver", [], {}, False),  # another scheme
        ("testserver", "http://testserver/path", [], {}, False),
        ("evil.example", "http://evil.example", [], {}, False),  # Host not in ALLOWED_HOSTS
        (
            "testserver",
            "https://chat.example.com",
            [],
            {"CSRF_TRUSTED_ORIGINS": ["https://chat.example.com"]},
            True,
        ),
        (
            "testserver",
            "https://chat.example.com:8443",
            [],
            {"CSRF_TRUSTED_ORIGINS": ["https://chat.example.com"]},
            False,
        ),
        (
            "testserver",
            "https://a.example.com",
            [],
            {"CSRF_TRUSTED_ORIGINS": ["https://*.example.com"]},
            True,
        ),
        # Behind a TLS proxy that Django trusts, the page's origin is https.
        (
            "testserver",
            "https://testserver",
            [(b"x-forwarded-proto", b"https")],
            {"SECURE_PROXY_SSL_HEADER": ("HTTP_X_FORWARDED_PROTO", "https")},
            True,
        ),
        # ...and an untrusted proxy header changes nothing.
        ("testserver", "https://testserver", [(b"x-forwarded-proto", b"https")], {}, False),
    ],
)
async def test_cookie_origin_matches_scheme_host_and_port(
    engine: Any,
    user: Any,
    host: str,
    origin: str,
    extra: list[tuple[bytes, bytes]],
    settings_changes: dict[str, Any],
    allowed: bool,
) -> None:
    # covers: F8 (Origin: scheme, host and port), F2
    headers = [
        (b"cookie", await session_cookie(user)),
        (b"host", host.encode()),
        (b"origin", origin.encode()),
        *extra,
    ]
    with override_settings(**settings_changes):
        ws, connected = await open_ws(headers)
        assert connected
        if allowed:
            assert (await ws.next())["type"] == "sessions"
            await ws.close()
        else:
            await assert_closed_unauthenticated(ws)


async def test_other_authorization_schemes_leave_the_cookie_path_alone(
    engine: Any, user: Any
) -> None:
    # covers: F2 (a browser behind an HTTP Basic proxy sends `Authorization: Basic` itself)
    headers = [
        (b"authorization", b"Basic dXNlcjpwdw=="),
        (b"cookie", await session_cookie(user)),
        (b"host", b"testserver"),
        (b"origin", b"http://testserver"),
    ]
    ws, connected = await open_ws(headers)
    assert connected
    assert (await ws.next())["type"] == "sessions"
    await ws.close()


async def test_bearer_token_without_origin(engine: Any, user: Any) -> None:
    # covers: F2
    ws, connected = await open_ws(await bearer(user))
    assert connected
    assert (await ws.next())["type"] == "sessions"
    await ws.close()


async def test_revoked_or_unknown_token_is_unauthenticated(engine: Any, user: Any) -> None:
    # covers: F2
    headers = await bearer(user)
    token = await sync_to_async(ApiToken.objects.get)(user=user)
    await sync_to_async(services.api_token_revoke)(token=token)
    ws, _ = await open_ws(headers)
    await assert_closed_unauthenticated(ws)
    ws, _ = await open_ws([(b"authorization", b"Bearer cc_not-a-token")])
    await assert_closed_unauthenticated(ws)
    # A bad bearer never falls back to a session cookie.
    cookie = await session_cookie(user)
    ws, _ = await open_ws(
        [
            (b"authorization", b"Bearer nope"),
            (b"cookie", cookie),
            (b"host", b"testserver"),
            (b"origin", b"http://testserver"),
        ]
    )
    await assert_closed_unauthenticated(ws)


# --- Connect (D2, D3, B1) -------------------------------------------------------------------


async def test_connect_sends_sessions_then_history_at_the_highest_seq(
    connect: Any, fake_model: Any, user: Any
) -> None:
    # covers: D2, B1
    ws = await connect(user)
    assert ws.sessions["current"] == ws.history["dialog_id"]
    assert ws.history["history_revision"] == 1  # the welcome message (B2)
    assert ws.history["active_turn"] is None and ws.history["queue"] == []
    await ws.send({"type": "send", "content": "hello", "client_msg_id": "c1"})
    queued = await ws.next()
    await ws.until(terminal(queued["turn_id"]))
    await ws.close()

    again = await connect(user)
    # B1: the most recently active dialog; the revision is the highest seq.
    assert again.history["dialog_id"] == ws.history["dialog_id"]
    assert again.history["history_revision"] == 3
    assert [m["seq"] for m in again.history["messages"]] == [1, 2, 3]
    assert again.history["has_more"] is False
    assert again.sessions["items"][0]["message_count"] == 1
    assert await again.drain() == []


async def test_connect_with_dialog_id_query(connect: Any, user: Any) -> None:
    # covers: B1
    await make_dialog(user, "alpha")
    await make_dialog(user, "beta")
    ws = await connect(user, "/ws/chat/?dialog_id=alpha")
    assert ws.sessions["current"] == "alpha" and ws.history["dialog_id"] == "alpha"
    # Unknown or invalid: B1 resolution (the most recent dialog).
    for query in ("nope", "bad%20id"):
        other = await connect(user, f"/ws/chat/?dialog_id={query}")
        assert other.history["dialog_id"] == "beta"


# --- One send (D1, D2, C2) ------------------------------------------------------------------


async def test_one_send_frame_order_and_revision_chain(
    connect: Any, fake_model: Any, user: Any
) -> None:
    # covers: D1, D2, C2
    await make_dialog(user)
    ws = await connect(user)
    fake_model.script(Reply(text="The answer, streamed in small pieces.", chunk=3, delay=0.01))
    await ws.send({"type": "send", "content": "question", "client_msg_id": "m-1"})
    frames = await ws.until(lambda f: f["type"] == "turn_updated")
    types = [f["type"] for f in frames]
    assert types[0] == "queued" and types[1] == "history_delta"
    assert types[-2:] == ["history_delta", "turn_updated"]
    assert set(types[2:-2]) <= {"turn_snapshot"}
    queued, user_delta, committed, done = frames[0], frames[1], frames[-2], frames[-1]
    assert queued == {
        "type": "queued",
        "session_id": ws.history["session_id"],
        "turn_id": queued["turn_id"],
        "position": 0,
        "client_msg_id": "m-1",
        "mode": "send",
    }
    assert user_delta["turn_id"] == queued["turn_id"]
    assert [m["role"] for m in user_delta["messages"]] == ["user"]
    assert user_delta["messages"][0]["content"] == "question"
    assert user_delta["base_revision"] == ws.history["history_revision"]
    assert committed["base_revision"] == user_delta["history_revision"]
    assert committed["history_revision"] == max(m["seq"] for m in committed["messages"])
    assert committed["messages"][-1]["content"] == "The answer, streamed in small pieces."
    assert done["status"] == "completed" and done["turn_id"] == queued["turn_id"]
    snapshots = [f for f in frames if f["type"] == "turn_snapshot"]
    assert [f["frame"] for f in snapshots] == sorted(f["frame"] for f in snapshots)
    # D1: tails only; they rebuild the answer exactly.
    assert text_of(frames, queued["turn_id"]) == committed["messages"][-1]["content"]
    assert await ws.drain() == []


# --- Errors (F3, F6): one answer each, connection still usable, nothing stored -------------


async def assert_usable(ws: WS) -> None:
    answer = await ws.ask({"type": "sessions", "client_msg_id": "still-there"})
    assert answer["type"] == "sessions"


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


# --- Client frame types ---------------------------------------------------------------------


async def test_inject_and_steer_when_idle(connect: Any, fake_model: Any, user: Any) -> None:
    # covers: C4, C5, D2
    ws = await connect(user)
    await ws.send({"type": "inject", "content": "context note", "client_msg_id": "i1"})
    ack, delta = await ws.next(), await ws.next()
    assert ack["type"] == "queued" and ack["turn_id"] is None and ack["mode"] == "inject"
    assert ack["client_msg_id"] == "i1"
    assert delta["type"] == "history_delta" and delta["turn_id"] is None
    assert delta["messages"][0]["content"] == "context note"
    assert delta["base_revision"] == ws.history["history_revision"]
    assert fake_model.turn_requests() == []
    # C4: an idle steer is a send.
    steer = await ws.ask({"type": "steer", "content": "go", "client_msg_id": "s1"})
    assert steer["type"] == "queued" and steer["mode"] == "send" and steer["turn_id"]
    frames = await ws.until(terminal(steer["turn_id"]))
    assert frames[-1]["status"] == "completed"


async def test_steer_and_inject_while_running(connect: Any, fake_model: Any, user: Any) -> None:
    # covers: C4, C5
    ws = await connect(user)
    gate = threading.Event()
    fake_model.script(Reply(text="first step", gate=gate), Reply(text="second step"))
    sent = await ws.ask({"type": "send", "content": "go", "client_msg_id": "g"})
    await fake_model.requests_made(1)
    steer = await ws.ask({"type": "steer", "content": "also this", "client_msg_id": "st"})
    assert steer == {**steer, "type": "queued", "mode": "steer", "turn_id": sent["turn_id"]}
    inject = await ws.ask({"type": "inject", "content": "fyi", "client_msg_id": "in"})
    assert inject["mode"] == "inject" and inject["turn_id"] == sent["turn_id"]
    gate.set()
    frames = await ws.until(terminal(sent["turn_id"]))
    assert frames[-1]["status"] == "completed"
    committed = [
        m["content"] for f in frames if f["type"] == "history_delta" for m in f["messages"]
    ]
    assert "also this" in committed and "fyi" in committed


async def test_stop_mid_stream_then_retry(connect: Any, fake_model: Any, user: Any) -> None:
    # covers: C6, D1
    ws = await connect(user)
    fake_model.script(Reply(text="partial ", endless=True), Reply(text="second try"))
    sent = await ws.ask({"type": "send", "content": "long one", "client_msg_id": "l"})
    await ws.until(lambda f: f["type"] == "turn_snapshot")
    await ws.send({"type": "stop", "client_msg_id": "stop-1"})
    frames = await ws.until(terminal(sent["turn_id"]))
    answer = next(f for f in frames if f.get("client_msg_id") == "stop-1")
    assert answer["type"] == "command_result" and answer["command"] == "stop" and answer["ok"]
    assert frames.index(answer) < len(frames) - 1
    assert frames[-1]["status"] == "cancelled" and frames[-1]["reason"] == "stopped"
    rest = await ws.drain(0.5)
    assert not [f for f in rest if f["type"] == "turn_updated"], "exactly one terminal"
    partials = [
        m
        for f in frames + rest
        if f["type"] == "history_delta"
        for m in f["messages"]
        if m.get("status") == "cancelled"
    ]
    assert partials and partials[0]["content"].startswith("partial")
    # Nothing runs now: stop says so.
    idle = await ws.ask({"type": "stop", "client_msg_id": "stop-2"})
    assert idle["type"] == "command_result" and idle["command"] == "stop"
    retry = await ws.ask({"type": "retry", "client_msg_id": "again"})
    assert retry["type"] == "queued" and retry["mode"] == "retry"
    assert retry["turn_id"] != sent["turn_id"] and retry["client_msg_id"] == "again"
    frames = await ws.until(terminal(retry["turn_id"]))
    assert frames[-1]["status"] == "completed"


async def test_history_paging(connect: Any, user: Any) -> None:
    # covers: D2
    ws = await connect(user)
    for i in range(7):
        await ws.ask({"type": "inject", "content": f"note {i}", "client_msg_id": f"n{i}"})
    await ws.drain(0.2)
    page = await ws.ask({"type": "history", "limit": 3, "client_msg_id": "h1"})
    assert page["type"] == "session_history" and page["history_revision"] == 8
    assert [m["seq"] for m in page["messages"]] == [6, 7, 8] and page["has_more"] is True
    page = await ws.ask({"type": "history", "before_seq": 6, "limit": 3, "client_msg_id": "h2"})
    assert [m["seq"] for m in page["messages"]] == [3, 4, 5] and page["has_more"] is True
    page = await ws.ask({"type": "history", "before_seq": 3, "client_msg_id": "h3"})
    assert [m["seq"] for m in page["messages"]] == [1, 2] and page["has_more"] is False
    page = await ws.ask({"type": "history", "client_msg_id": "h4"})
    assert len(page["messages"]) == 8 and page["has_more"] is False
    await make_dialog(user, "elsewhere")
    other = await ws.ask({"type": "history", "dialog_id": "elsewhere", "client_msg_id": "h5"})
    assert other["dialog_id"] == "elsewhere" and other["history_revision"] == 1


async def test_sessions_frame(connect: Any, user: Any) -> None:
    # covers: E1
    await make_dialog(user, "older")
    ws = await connect(user)
    answer = await ws.ask({"type": "sessions", "client_msg_id": "list"})
    assert answer["type"] == "sessions" and answer["current"] == "older"
    item = answer["items"][0]
    assert set(item) >= {"session_id", "dialog_id", "title", "last_active_at", "message_count"}


# --- Slash commands (B3) --------------------------------------------------------------------


async def test_slash_new_then_send_lands_in_the_new_dialog(
    connect: Any, fake_model: Any, user: Any
) -> None:
    # covers: B3, E1 (frames of one connection are handled in order)
    await make_dialog(user, "first")
    ws = await connect(user)
    # No waiting between the two frames.
    await ws.send({"type": "send", "content": "/new Project notes", "client_msg_id": "n"})
    await ws.send({"type": "send", "content": "hello there", "client_msg_id": "h"})
    result = await ws.next()
    assert result["type"] == "command_result" and result["command"] == "new" and result["ok"]
    assert result["client_msg_id"] == "n"
    sessions, hist = await ws.next(), await ws.next()
    assert sessions["type"] == "sessions" and hist["type"] == "session_history"
    assert hist["title"] == "Project notes" and sessions["current"] == hist["dialog_id"]
    assert hist["dialog_id"] != "first"
    assert [m["role"] for m in hist["messages"]] == ["system"]
    queued = await ws.next()
    assert queued["type"] == "queued" and queued["session_id"] == hist["session_id"]
    frames = await ws.until(terminal(queued["turn_id"]))
    assert all(f["session_id"] == hist["session_id"] for f in frames if "session_id" in f)
    # No duplicate `sessions` from the create's own `sessions_changed`, no stale welcome delta.
    assert [f["type"] for f in frames if f["type"] in ("sessions", "session_history")] == []
    assert await ws.drain() == []
    new = await sync_to_async(Session.objects.get)(dialog_id=hist["dialog_id"])
    assert await count(Message, session=new, role="user") == 1
    first = await sync_to_async(Session.objects.get)(dialog_id="first")
    assert await count(Message, session=first, role="user") == 0


async def test_slash_switch_rename_delete(connect: Any, user: Any) -> None:
    # covers: B3, E1
    await make_dialog(user, "a")
    await make_dialog(user, "b")
    ws = await connect(user)
    assert ws.history["dialog_id"] == "b"

    result = await ws.ask({"type": "send", "content": "/switch a", "client_msg_id": "sw"})
    assert result["type"] == "command_result" and result["command"] == "switch"
    sessions, hist = await ws.next(), await ws.next()
    assert sessions["current"] == "a" and hist["dialog_id"] == "a"

    result = await ws.ask({"type": "send", "content": "/rename Shopping", "client_msg_id": "rn"})
    assert result["command"] == "rename" and result["ok"]
    updated = await ws.next()
    assert updated == {
        "type": "session_updated",
        "session_id": f"web:u{user.pk}:a",
        "dialog_id": "a",
        "title": "Shopping",
    }
    assert await ws.drain() == [], "session_updated is sent once"

    result = await ws.ask({"type": "send", "content": "/delete", "client_msg_id": "del"})
    assert result["command"] == "delete" and result["ok"]
    sessions, hist = await ws.next(), await ws.next()
    assert sessions["type"] == "sessions" and sessions["current"] == "b"
    assert [i["dialog_id"] for i in sessions["items"]] == ["b"]
    assert hist["type"] == "session_history" and hist["dialog_id"] == "b"
    assert await ws.drain() == []

    # Deleting the last dialog makes a new one current.
    await ws.ask({"type": "send", "content": "/delete", "client_msg_id": "del2"})
    sessions, hist = await ws.next(), await ws.next()
    assert sessions["current"] == hist["dialog_id"] not in ("a", "b")
    assert len(sessions["items"]) == 1


async def test_slash_rename_with_dialog_id_keeps_the_current_dialog(
    connect: Any, user: Any
) -> None:
    # covers: B3
    await make_dialog(user, "other")
    await make_dialog(user, "main")
    ws = await connect(user)
    await ws.ask(
        {"type": "send", "content": "/rename Renamed", "dialog_id": "other", "client_msg_id": "r"}
    )
    updated = await ws.next()
    assert updated["dialog_id"] == "other" and updated["title"] == "Renamed"
    sent = await ws.ask(
        {"type": "send", "content": "/delete", "dialog_id": "other", "client_msg_id": "d"}
    )
    assert sent["command"] == "delete"
    sessions, hist = await ws.next(), await ws.next()
    assert sessions["current"] == "main" and hist["dialog_id"] == "main"


@pytest.mark.parametrize("command", ["/sessions", "/info", "/help"])
async def test_slash_read_commands(connect: Any, user: Any, command: str) -> None:
    # covers: B3
    ws = await connect(user)
    result = await ws.ask({"type": "send", "content": command, "client_msg_id": "c"})
    assert result["type"] == "command_result" and result["ok"]
    assert result["command"] == command[1:] and result["content"]
    assert await ws.drain(0.2) == []
    assert await count(Message) == 1 and await count(Turn) == 0


async def test_slash_commands_never_enter_history(connect: Any, user: Any) -> None:
    # covers: B3
    ws = await connect(user)
    await ws.ask({"type": "send", "content": "/info", "client_msg_id": "i"})
    await ws.ask({"type": "send", "content": "/nope", "client_msg_id": "n"})
    assert await count(Message) == 1


# --- Fan-out (D2, D3) -----------------------------------------------------------------------


async def test_two_connections_of_a_user_see_the_same_stream(
    connect: Any, fake_model: Any, user: Any, other_user: Any
) -> None:
    # covers: D3, D2, F2
    await make_dialog(user)
    tab1, tab2 = await connect(user), await connect(user)
    stranger = await connect(other_user)
    fake_model.script(Reply(text="shared answer for both tabs", chunk=2, delay=0.01))
    sent = await tab1.ask({"type": "send", "content": "hi", "client_msg_id": "x"})
    seen1 = await tab1.until(terminal(sent["turn_id"]))
    seen2 = await tab2.until(terminal(sent["turn_id"]))

    def kinds(frames: list[dict[str, Any]]) -> list[str]:
        return [f["type"] for f in frames if f["type"] != "turn_snapshot"]

    assert kinds(seen1) == ["history_delta", "history_delta", "turn_updated"]
    assert kinds(seen2) == kinds(seen1)
    answer = seen1[-2]["messages"][-1]["content"]
    assert text_of(seen1, sent["turn_id"]) == answer == text_of(seen2, sent["turn_id"])
    assert any(f["type"] == "turn_snapshot" for f in seen2)
    assert await stranger.drain(0.5) == []


async def test_snapshots_only_for_the_current_dialog(
    connect: Any, fake_model: Any, user: Any
) -> None:
    # covers: D2 (deltas and terminals of every dialog, snapshots of the current one)
    await make_dialog(user, "side")
    await make_dialog(user, "main")
    ws = await connect(user)
    fake_model.script(Reply(text="answer in the side dialog", chunk=2, delay=0.01))
    sent = await ws.ask(
        {"type": "send", "content": "hi", "dialog_id": "side", "client_msg_id": "s"}
    )
    frames = await ws.until(terminal(sent["turn_id"]))
    assert [f["type"] for f in frames] == ["history_delta", "history_delta", "turn_updated"]
    assert all(f["session_id"].endswith(":side") for f in frames)


async def test_sessions_changed_elsewhere_refreshes_sessions_once(
    connect: Any, user: Any, monkeypatch: Any
) -> None:
    # covers: E1 (live dialog list)
    from sessions_app import consumers

    # A wide coalescing window, so the burst below is one burst on any machine.
    monkeypatch.setattr(consumers, "SESSIONS_COALESCE_SECONDS", 0.4)
    await make_dialog(user, "main")
    tab1, tab2 = await connect(user), await connect(user)
    await tab2.ask({"type": "send", "content": "/new", "client_msg_id": "n"})
    frames = await tab1.drain(1.0)
    sessions = [f for f in frames if f["type"] == "sessions"]
    assert len(sessions) == 1
    assert sessions[0]["current"] == "main" and len(sessions[0]["items"]) == 2
    # The new dialog's welcome reaches tab 1 as a delta of another dialog (unread marks).
    assert [f["type"] for f in frames if f["type"] != "sessions"] == ["history_delta"]
    # Several changes in a burst: one frame.
    for i in range(3):
        await sync_to_async(services.session_create)(
            owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id=f"burst{i}"
        )
    frames = await tab1.drain(1.0)
    sessions = [f for f in frames if f["type"] == "sessions"]
    assert len(sessions) == 1 and len(sessions[0]["items"]) == 5


async def test_current_dialog_deleted_in_another_tab(connect: Any, user: Any) -> None:
    # covers: E1 (the dialog that becomes current)
    await make_dialog(user, "keep")
    await make_dialog(user, "gone")
    tab1, tab2 = await connect(user), await connect(user)
    assert tab1.history["dialog_id"] == "gone"
    await tab2.ask({"type": "send", "content": "/delete", "client_msg_id": "d"})
    frames = await tab1.drain(0.5)
    assert [f["type"] for f in frames] == ["sessions", "session_history"]
    assert frames[0]["current"] == "keep" and frames[1]["dialog_id"] == "keep"


# --- Mid-turn joins, disconnects, gaps (D1, D3, STYLE 5) -------------------------------------


async def test_connection_opening_mid_turn_gets_the_snapshot_then_the_rest(
    connect: Any, fake_model: Any, user: Any
) -> None:
    # covers: D3, D1
    await make_dialog(user)
    first = await connect(user)
    text = "".join(f"word{i} " for i in range(60))
    fake_model.script(Reply(text=text, chunk=3, delay=0.01))
    sent = await first.ask({"type": "send", "content": "go", "client_msg_id": "g"})
    await first.until(lambda f: f["type"] == "turn_snapshot" and len(f["text"]) > 0)
    late = await connect(user)
    active = late.history["active_turn"]
    assert active is not None and active["turn_id"] == sent["turn_id"]
    assert active["text_offset"] == 0 and active["type"] == "turn_snapshot"
    assert 0 < len(active["text"]) < len(text)
    frames = await late.until(terminal(sent["turn_id"]))
    rebuilt = text_of(frames, sent["turn_id"], known=active["text"])
    committed = frames[-2]["messages"][-1]["content"]
    assert rebuilt == committed == text
    assert frames[-1]["status"] == "completed"


async def test_late_join_with_a_gate_gets_full_text(
    connect: Any, fake_model: Any, user: Any
) -> None:
    # covers: D3
    await make_dialog(user)
    first = await connect(user)
    gate = threading.Event()
    fake_model.script(Reply(text="already said, ", gate=gate))
    sent = await first.ask({"type": "send", "content": "go", "client_msg_id": "g"})
    seen: list[dict[str, Any]] = []

    def said(frame: dict[str, Any]) -> bool:
        seen.append(frame)
        return "said, " in text_of(seen, sent["turn_id"])

    await first.until(said)
    late = await connect(user)
    assert late.history["active_turn"]["text"] == "already said, "
    gate.set()
    frames = await late.until(terminal(sent["turn_id"]))
    assert frames[-1]["status"] == "completed"
    assert text_of(frames, sent["turn_id"], known="already said, ") == "already said, "


async def test_closing_the_socket_mid_turn_does_not_stop_the_turn(
    connect: Any, fake_model: Any, user: Any, recorder: Any
) -> None:
    # covers: STYLE 5, C3 (a closed socket never fails the turn)
    await make_dialog(user)
    ws = await connect(user)
    gate = threading.Event()
    fake_model.script(Reply(text="answer after you left", gate=gate))
    sent = await ws.ask({"type": "send", "content": "bye", "client_msg_id": "b"})
    session = await sync_to_async(Session.objects.get)(owner=user, dialog_id="default")
    rec = await recorder(publish.chat_group("web", f"u{user.pk}"))
    await fake_model.requests_made(1)
    await ws.close()
    gate.set()
    done = await rec.terminal(sent["turn_id"])
    assert done["status"] == "completed"
    contents = await sync_to_async(
        lambda: list(
            Message.objects.filter(session=session)
            .order_by("seq")
            .values_list("content", flat=True)
        )
    )()
    assert contents[-2:] == ["bye", "answer after you left"]


async def test_snapshot_gap_asks_for_a_full_snapshot(
    connect: Any, fake_model: Any, user: Any
) -> None:
    # covers: D1, D3 (a tail beyond what the connection has is held back; the turn's process
    # sends a full snapshot to this connection)
    await make_dialog(user)
    ws = await connect(user)
    fake_model.script(Reply(text="real text ", endless=True))
    sent = await ws.ask({"type": "send", "content": "go", "client_msg_id": "g"})
    before = await ws.until(lambda f: f["type"] == "turn_snapshot")
    known = text_of(before, sent["turn_id"])
    session = await sync_to_async(Session.objects.get)(owner=user, dialog_id="default")
    # A tail from beyond this connection's text, as if it had missed frames.
    await get_channel_layer().group_send(
        publish.session_group(session.pk),
        {
            "type": publish.EVENT_TYPE,
            "frame": {
                "type": "turn_snapshot",
                "session_id": session.session_id,
                "turn_id": sent["turn_id"],
                "status": "running",
                "text_offset": 10_000,
                "text": "JUNK",
                "tools": [],
                "frame": 10_000,
            },
        },
    )
    frames = await ws.until(
        lambda f: f["type"] == "turn_snapshot" and f["text_offset"] == 0, timeout=5
    )
    assert all("JUNK" not in f.get("text", "") for f in frames)
    full = frames[-1]
    assert full["text"].startswith("real text ") and len(full["text"]) >= len(known)
    more = await ws.until(lambda f: f["type"] == "turn_snapshot")
    rebuilt = text_of(more, sent["turn_id"], known=full["text"])
    assert rebuilt.startswith(full["text"])
    await ws.send({"type": "stop", "client_msg_id": "s"})
    frames = await ws.until(terminal(sent["turn_id"]))
    rebuilt = text_of(frames, sent["turn_id"], known=rebuilt)
    partial = next(m for f in frames if f["type"] == "history_delta" for m in f["messages"])
    assert partial["status"] == "cancelled"
    assert partial["content"].startswith(rebuilt) or rebuilt.startswith(partial["content"])


async def test_last_dialog_deleted_elsewhere_then_send_resolves_a_new_one(
    connect: Any, fake_model: Any, user: Any
) -> None:
    # covers: B1 (omitted dialog id = resolved as in B1), E1
    old = await make_dialog(user, "only")
    ws = await connect(user)
    # Deleted outside this connection (the API, an operator): nothing is left.
    await sync_to_async(services.session_soft_delete)(session=old)
    frames = await ws.drain(0.5)
    assert [f["type"] for f in frames] == ["sessions"] and frames[0]["items"] == []
    await ws.send({"type": "send", "content": "still here?", "client_msg_id": "s"})
    sessions, hist, queued = await ws.next(), await ws.next(), await ws.next()
    assert sessions["type"] == "sessions" and hist["type"] == "session_history"
    assert hist["dialog_id"] != "only" and sessions["current"] == hist["dialog_id"]
    assert queued["type"] == "queued" and queued["session_id"] == hist["session_id"]
    done = await ws.until(terminal(queued["turn_id"]))
    assert done[-1]["status"] == "completed"


async def test_recreated_dialog_with_the_same_id(connect: Any, fake_model: Any, user: Any) -> None:
    # covers: A1 (opaque primary key: a deleted `default` can be re-created), D2
    old = await make_dialog(user)
    ws = await connect(user)
    sent = await ws.ask({"type": "send", "content": "first life", "client_msg_id": "a"})
    await ws.until(terminal(sent["turn_id"]))
    await sync_to_async(services.session_soft_delete)(session=old)
    new = await make_dialog(user)
    frames = await ws.drain(0.5)
    hist = [f for f in frames if f["type"] == "session_history"]
    assert len(hist) == 1 and hist[0]["history_revision"] == 1
    assert [f["type"] for f in frames].count("sessions") == 1
    sent = await ws.ask({"type": "send", "content": "second life", "client_msg_id": "b"})
    frames = await ws.until(terminal(sent["turn_id"]))
    deltas = [f for f in frames if f["type"] == "history_delta"]
    assert [d["base_revision"] for d in deltas] == [1, 2]
    assert await count(Message, session=new, role="user") == 1


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ([(b"cookie", b"django_language=zh-hans")], "未知命令"),
        ([(b"accept-language", b"zh-CN,zh;q=0.9")], "未知命令"),
        ([(b"cookie", b"django_language=en"), (b"accept-language", b"zh-CN")], "Unknown command"),
    ],
)
async def test_replies_follow_the_users_language(engine, user, extra, expected):
    # covers: F5 (the language cookie set by /i18n/setlang/ wins over Accept-Language)
    ws, connected = await open_ws(await bearer(user) + extra)
    assert connected
    try:
        await ws.next()
        await ws.next()
        answer = await ws.ask({"type": "send", "content": "/bogus", "client_msg_id": "lang"})
        assert answer["type"] == "error" and expected in answer["message"]
    finally:
        await ws.close()
