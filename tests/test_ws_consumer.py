"""The `/ws/chat/` consumer through the real ASGI application (`chatcore.asgi.application`),
the real engine and a fake OpenAI-compatible model server: connect state, frame order, every
client frame type, slash commands and the user's language (PROTOCOL "WebSocket: /ws/chat/";
SPEC D1-D3, E1, F5). Auth, errors and fan-out have their own files (test_ws_*.py)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from sessions_app.models import Message, Session, Turn
from tests.engine_helpers import make_dialog
from tests.fakemodel import Reply
from tests.ws_helpers import (
    bearer,
    count,
    open_ws,
    terminal,
    text_of,
)

pytestmark = [pytest.mark.django_db(transaction=True)]


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


async def test_first_connect_reads_the_dialog_list_once(
    connect: Any, user: Any, monkeypatch: Any
) -> None:
    # covers: B2, D2 (a crowd of new users connecting costs one list read each)
    from sessions_app import ws_events

    reads: list[str] = []
    real = ws_events.sessions_frame

    def counted(**kwargs: Any) -> Any:
        reads.append(kwargs["chat_id"])
        return real(**kwargs)

    monkeypatch.setattr(ws_events, "sessions_frame", counted)
    # The user has no dialog yet: connecting creates it (with its welcome, B2), and the
    # creation's own `sessions_changed` comes back to this very connection.
    ws = await connect(user)
    assert len(ws.sessions["items"]) == 1
    await asyncio.sleep(ws_events.SESSIONS_COALESCE_SECONDS + 0.3)
    assert await ws.drain() == []
    assert len(reads) == 1
    # Another tab's new dialog is news to this one: it reads the list and shows both.
    other = await connect(user)
    await other.send({"type": "send", "content": "/new", "client_msg_id": "n"})
    frames = await ws.drain(1.0)
    sessions = [f for f in frames if f["type"] == "sessions"]
    assert len(sessions) == 1 and len(sessions[0]["items"]) == 2


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
