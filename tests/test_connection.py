"""The connection every first-party channel shares (`sessions_app/connection.py`; SPEC D5,
B3): the WebSocket, the REST API, its Server-Sent Events and the terminal store a user's
message with its sender, the time it was received and, as reply-to, the client's message id;
slash commands are refused during shutdown as sends are, and write nothing."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.utils import timezone

from chatcore.common.errors import ShuttingDown
from sessions_app.connection import ChannelConnection
from sessions_app.models import Message, Session, StagedInput
from tests.api_helpers import read_stream, stream_post, wait_turn_row
from tests.fakemodel import FakeModelServer, Reply
from tests.procs import embedded_env, manage, migrate_embedded
from tests.ws_helpers import count, terminal

pytestmark = [pytest.mark.django_db(transaction=True)]


async def user_message(content: str) -> Message:
    return await sync_to_async(Message.objects.get)(role="user", content=content)


# --- D5: one Inbound, built the same way by every channel -----------------------------------


async def test_websocket_send_keeps_sender_received_time_and_reply_to(
    connect: Any, user: Any
) -> None:
    # covers: D5
    ws = await connect(user)
    before = timezone.now()
    ack = await ws.ask({"type": "send", "content": "from the web", "client_msg_id": "web-7"})
    after = timezone.now()
    await ws.until(terminal(ack["turn_id"]))
    message = await user_message("from the web")
    assert message.source == {
        "kind": "user_input",
        "from_channel": "web",
        "from_user_id": str(user.pk),
        "reply_to": "web-7",
        "client_msg_id": "web-7",
    }
    assert before <= message.created_at <= after


async def test_websocket_steer_keeps_reply_to_too(
    connect: Any, user: Any, fake_model: FakeModelServer
) -> None:
    # covers: D5, C4
    ws = await connect(user)
    fake_model.script(Reply(text="working", endless=True))
    sent = await ws.ask({"type": "send", "content": "start", "client_msg_id": "s-1"})
    await fake_model.requests_made(1)
    steer = await ws.ask({"type": "steer", "content": "and this", "client_msg_id": "s-2"})
    assert steer["mode"] == "steer" and steer["turn_id"] == sent["turn_id"]
    staged = await sync_to_async(lambda: list(StagedInput.objects.filter(mode="steer")))()
    assert [item.source.get("reply_to") for item in staged] == ["s-2"]
    stopped = await ws.ask({"type": "stop", "client_msg_id": "s-3"})
    assert stopped["type"] == "command_result" and stopped["command"] == "stop"


async def test_rest_send_keeps_sender_and_reply_to(api: Any, user: Any) -> None:
    # covers: D5, E3
    s = await api.create(dialog_id="rest")
    ack = await api.send(s["session_id"], "from the api", client_msg_id="api-3")
    await wait_turn_row(ack["turn_id"])
    message = await user_message("from the api")
    assert message.source == {
        "kind": "user_input",
        "from_channel": "api",
        "from_user_id": str(user.pk),
        "reply_to": "api-3",
        "client_msg_id": "api-3",
    }


async def test_rest_send_without_a_client_id_has_no_reply_to(api: Any) -> None:
    # covers: D5 (nothing to reply to: the key is left out, not stored empty)
    s = await api.create(dialog_id="bare")
    ack = await api.send(s["session_id"], "no id")
    await wait_turn_row(ack["turn_id"])
    source = (await user_message("no id")).source
    assert "reply_to" not in source and "client_msg_id" not in source


async def test_sse_send_keeps_sender_and_reply_to(api: Any, user: Any) -> None:
    # covers: D5, E3
    s = await api.create(dialog_id="sse")
    response = await stream_post(
        api,
        f"/sessions/{s['session_id']}/messages",
        {"content": "streamed", "client_msg_id": "sse-9"},
    )
    events = await read_stream(response)
    assert events[0]["event"] == "queued" and events[0]["client_msg_id"] == "sse-9"
    assert events[-1]["event"] == "turn_updated" and events[-1]["status"] == "completed"
    message = await user_message("streamed")
    assert message.source == {
        "kind": "user_input",
        "from_channel": "api",
        "from_user_id": str(user.pk),
        "reply_to": "sse-9",
        "client_msg_id": "sse-9",
    }


@pytest.mark.slow
def test_terminal_lines_keep_sender_and_reply_to(
    tmp_path: Path, fake_model: FakeModelServer
) -> None:
    # covers: D5, E4
    env = embedded_env(tmp_path, LLM_BASE_URL=fake_model.url)
    migrate_embedded(env)
    done = manage("chat", "--user", "carol", env=env, stdin="one\ntwo\n")
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(tmp_path / "chat.sqlite3") as db:
        user_pk = db.execute("SELECT id FROM auth_user WHERE username='carol'").fetchone()[0]
        rows = db.execute(
            "SELECT content, source FROM sessions_app_message WHERE role='user' ORDER BY seq"
        ).fetchall()
    sources = {content: json.loads(source) for content, source in rows}
    assert set(sources) == {"one", "two"}
    for source in sources.values():
        assert source["from_channel"] == "cli"
        assert source["from_user_id"] == str(user_pk)
        # Each line is its own client message: its id is what it replies to.
        assert source["reply_to"] == source["client_msg_id"]
        assert source["reply_to"].startswith("cli-")
    assert sources["one"]["reply_to"] != sources["two"]["reply_to"]


# --- B3: slash commands during shutdown -----------------------------------------------------


async def test_slash_commands_are_refused_during_shutdown_and_write_nothing(
    connect: Any, engine: Any, user: Any
) -> None:
    # covers: B3, F1
    ws = await connect(user)
    dialogs = await count(Session)
    engine.supervisor.close()
    for n, text in enumerate(["/new Late dialog", "/rename Late", "/delete", "/sessions"]):
        answer = await ws.ask({"type": "send", "content": text, "client_msg_id": f"c{n}"})
        assert answer["type"] == "error" and answer["code"] == "shutting_down", answer
    assert await count(Session) == dialogs
    assert await count(Session, deleted_at__isnull=False) == 0
    assert await count(Session, title="Late") == 0
    # `/stop` only ever reduces work: it still answers during shutdown.
    answer = await ws.ask({"type": "stop", "client_msg_id": "c-stop"})
    assert answer["type"] == "command_result" and answer["command"] == "stop"


async def test_the_shared_connection_refuses_commands_during_shutdown(
    engine: Any, user: Any
) -> None:
    # covers: B3 (the terminal and the chat apps take this path too)
    layer = get_channel_layer()
    conn = ChannelConnection(
        engine=engine,
        user=user,
        channel="cli",
        chat_id=f"u{user.pk}",
        layer=layer,
        reply_channel=await layer.new_channel("test."),
    )
    current = await sync_to_async(conn.resolve)("here", create=True)
    engine.supervisor.close()
    with pytest.raises(ShuttingDown):
        await conn.send_or_command("/new elsewhere", current)
    with pytest.raises(ShuttingDown):
        await conn.send_or_command("plain text", current)
    assert await count(Session, owner=user) == 1
