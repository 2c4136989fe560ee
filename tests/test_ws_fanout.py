"""`/ws/chat/` fan-out and delivery (SPEC D1-D3, STYLE 5): several connections of a user,
dialogs changed elsewhere, mid-turn joins, disconnects and snapshot gaps."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer

from chatcore.common import publish
from sessions_app import services
from sessions_app.models import Message, Session
from tests.engine_helpers import make_dialog
from tests.fakemodel import Reply
from tests.ws_helpers import (
    count,
    terminal,
    text_of,
)

pytestmark = [pytest.mark.django_db(transaction=True)]


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
    from sessions_app import ws_events

    # A wide coalescing window, so the burst below is one burst on any machine.
    monkeypatch.setattr(ws_events, "SESSIONS_COALESCE_SECONDS", 0.4)
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
    # The answer so far, whole: what this connection knew, then on as the model streams it
    # (its text, then dots), however far the model had got when the full snapshot was made.
    assert full["text"].startswith(known)
    assert ("real text " + "." * len(full["text"])).startswith(full["text"])
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
