"""Chat-app dialogs linked to a web user (issue 13 item 5; SPEC A1, F2): read-only links are
enforced on every write over REST and the WebSocket, and the web chat's socket lists linked
dialogs, opens them by `session_id` and streams their turns. Through the real stack: the
Telegram webhook with a fake Bot API server, the REST API, `/ws/chat/` on the real ASGI
application, the real engine and the fake model."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from sessions_app.chatapps import store
from sessions_app.models import ChannelAccount, Session, Turn
from tests.api_helpers import Api, issue_token
from tests.fakemodel import Reply
from tests.telegram_helpers import Bot, turns
from tests.ws_helpers import WS, bearer, open_ws

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]

# The Telegram bot fixtures (the fake Bot API server, the engine and the webhook client) are
# shared from conftest.py.


async def linked(bot: Bot, user: Any, *, writable: bool) -> Session:
    """A Telegram user's dialog (one answered turn), its account linked to `user`."""
    await bot.say("hello from telegram", user_id=7, first_name="Ann")
    await bot.idle()
    account = await sync_to_async(ChannelAccount.objects.get)()
    await sync_to_async(store.account_link)(account=account, user=user, writable=writable)
    return await sync_to_async(Session.objects.get)(channel="telegram")


@pytest_asyncio.fixture
async def connect() -> AsyncIterator[Callable[..., Any]]:
    opened: list[WS] = []

    async def factory(user: Any) -> WS:
        ws, connected = await open_ws(await bearer(user))
        assert connected
        opened.append(ws)
        ws.sessions = await ws.next()
        ws.history = await ws.next()
        assert (ws.sessions["type"], ws.history["type"]) == ("sessions", "session_history")
        return ws

    yield factory
    for ws in opened:
        await ws.close()


def cmid() -> str:
    return uuid.uuid4().hex


# --- read-only on every write ------------------------------------------------------------


async def test_rest_refuses_every_write_into_a_read_only_linked_dialog(
    bot: Bot, user: Any, fake_model
) -> None:
    # covers: A1, F2 (read-only links: sends, steer, inject, stop, retry, continue, rename,
    # delete and compact all answer 403 read_only and change nothing)
    session = await linked(bot, user, writable=False)
    api = Api(AsyncClient(), {"Authorization": f"Bearer {await issue_token(user)}"})
    base = f"/sessions/{session.session_id}"
    writes = [
        ("POST", f"{base}/messages", {"content": "web send"}),
        ("POST", f"{base}/messages", {"content": "web steer", "mode": "steer"}),
        ("POST", f"{base}/messages", {"content": "web inject", "mode": "inject"}),
        ("POST", f"{base}/stop", None),
        ("POST", f"{base}/retry", None),
        ("POST", f"{base}/continue", None),
        ("POST", f"{base}/compact", None),
        ("PATCH", base, {"title": "renamed from the web"}),
        ("PATCH", base, {"model": "fake"}),  # H4
        ("PATCH", base, {"system_prompt": "Be brief."}),
        ("DELETE", base, None),
    ]
    for method, path, body in writes:
        status, answer, _ = await api.call(method, path, body)
        assert (status, answer["code"]) == (403, "read_only"), (method, path, answer)
    # Reads still work, and nothing changed.
    status, body, _ = await api.call("GET", base)
    assert status == 200 and body["title"] == session.title
    status, body, _ = await api.call("GET", f"{base}/messages")
    assert status == 200
    assert [m["content"] for m in body["messages"] if m["role"] == "user"] == [
        "hello from telegram"
    ]
    fresh = await sync_to_async(Session.objects.get)(pk=session.pk)
    assert fresh.deleted_at is None and fresh.title == session.title
    assert len(await turns()) == 1
    # A writable link lets the same writes in.
    account = await sync_to_async(ChannelAccount.objects.get)()
    await sync_to_async(store.account_link)(account=account, user=user, writable=True)
    status, body, _ = await api.call("PATCH", base, {"title": "renamed from the web"})
    assert status == 200 and body["title"] == "renamed from the web"
    status, body, _ = await api.call("POST", f"{base}/stop")
    assert status == 200


async def test_websocket_refuses_every_write_into_a_read_only_linked_dialog(
    bot: Bot, user: Any, connect: Any, fake_model
) -> None:
    # covers: A1, F2, B3 (the same refusals as `error` frames; commands that only read or
    # that do not change the dialog still answer)
    session = await linked(bot, user, writable=False)
    ws = await connect(user)
    sid = session.session_id
    writes: list[dict[str, Any]] = [
        {"type": "send", "content": "web send"},
        {"type": "steer", "content": "web steer"},
        {"type": "inject", "content": "web inject"},
        {"type": "stop"},
        {"type": "retry"},
        {"type": "continue"},
        {"type": "send", "content": "/rename from the web"},
        {"type": "send", "content": "/delete"},
        {"type": "send", "content": "/compact"},
        {"type": "send", "content": "/stop"},
        {"type": "settings", "model": "fake"},  # H4
        {"type": "settings", "system_prompt": "Be brief."},
        {"type": "send", "content": "/model fake"},
    ]
    for frame in writes:
        answer = await ws.ask({**frame, "session_id": sid, "client_msg_id": cmid()})
        assert (answer["type"], answer["code"]) == ("error", "read_only"), (frame, answer)
    info = await ws.ask(
        {"type": "send", "content": "/info", "session_id": sid, "client_msg_id": cmid()}
    )
    assert info["type"] == "command_result" and sid in info["content"]
    # After following the dialog, frames without a dialog name are refused the same way.
    await ws.ask({"type": "history", "session_id": sid, "follow": True, "client_msg_id": cmid()})
    answer = await ws.ask({"type": "send", "content": "web send", "client_msg_id": cmid()})
    assert answer["code"] == "read_only"
    answer = await ws.ask({"type": "send", "content": "/rename x", "client_msg_id": cmid()})
    assert answer["code"] == "read_only"
    fresh = await sync_to_async(Session.objects.get)(pk=session.pk)
    assert fresh.deleted_at is None and fresh.title == session.title
    assert (fresh.model, fresh.system_prompt) == ("", "")
    assert len(await turns()) == 1


# --- linked dialogs in the web chat --------------------------------------------------------


async def test_the_sessions_frame_lists_linked_dialogs_with_their_platform(
    bot: Bot, user: Any, other_user: Any, connect: Any, fake_model
) -> None:
    # covers: A1, F2, D2 (linked dialogs in the sidebar; a session_id is checked to be the
    # caller's)
    session = await linked(bot, user, writable=False)
    ws = await connect(user)
    items = {item["session_id"]: item for item in ws.sessions["items"]}
    web = ws.history["session_id"]
    assert items[web]["channel"] == "web" and items[web]["read_only"] is False
    item = items[session.session_id]
    assert (item["channel"], item["chat_id"], item["read_only"]) == ("telegram", "42", True)
    assert ws.sessions["current_session_id"] == web
    hist = await ws.ask({"type": "history", "session_id": session.session_id, "client_msg_id": "h"})
    assert hist["type"] == "session_history" and hist["session_id"] == session.session_id
    assert [m["content"] for m in hist["messages"] if m["role"] != "system"][-2:] == [
        "hello from telegram",
        "echo: hello from telegram",
    ]
    # Both names at once, another user's dialog: refused.
    answer = await ws.ask(
        {
            "type": "history",
            "session_id": session.session_id,
            "dialog_id": "x",
            "client_msg_id": "b",
        }
    )
    assert answer["code"] == "bad_request"
    other = await connect(other_user)
    answer = await other.ask(
        {"type": "history", "session_id": session.session_id, "client_msg_id": "o"}
    )
    assert answer["code"] == "not_found"
    assert all(i["channel"] == "web" for i in other.sessions["items"])
    api_dialog = await sync_to_async(Session.objects.create)(
        owner=user, channel="api", chat_id=f"u{user.pk}", dialog_id="api1", title="api"
    )
    # The user's own API dialog is theirs to open in the web chat (its list shows it too).
    answer = await ws.ask(
        {"type": "history", "session_id": api_dialog.session_id, "client_msg_id": "a"}
    )
    assert answer["type"] == "session_history" and answer["session_id"] == api_dialog.session_id


async def test_a_followed_linked_dialog_streams_its_turns_live(
    bot: Bot, user: Any, connect: Any, fake_model
) -> None:
    # covers: A1, D1, D2, D3 (a platform user's turn streams into the web chat that follows
    # the linked dialog: user message, snapshots, committed answer, terminal)
    session = await linked(bot, user, writable=False)
    ws = await connect(user)
    sid = session.session_id
    await ws.ask({"type": "history", "session_id": sid, "follow": True, "client_msg_id": "f"})
    fake_model.script(Reply(text="streamed to both sides", delay=0.05, chunk=4))
    await bot.say("a new question", user_id=7)
    frames = await ws.until(
        lambda f: f["type"] == "turn_updated" and f["session_id"] == sid, timeout=30
    )
    kinds = [f["type"] for f in frames if f.get("session_id") == sid]
    assert "turn_snapshot" in kinds and kinds[-1] == "turn_updated"
    contents = [m["content"] for f in frames if f["type"] == "history_delta" for m in f["messages"]]
    assert "a new question" in contents and "streamed to both sides" in contents
    await bot.idle()


async def test_a_writable_linked_dialog_takes_web_sends_by_session_id(
    bot: Bot, user: Any, connect: Any, fake_model
) -> None:
    # covers: A1, C1 (a writable link: a web send goes into the chat-app dialog and its
    # answer reaches the platform chat too)
    session = await linked(bot, user, writable=True)
    ws = await connect(user)
    answer = await ws.ask(
        {
            "type": "send",
            "content": "from the web chat",
            "session_id": session.session_id,
            "client_msg_id": "w1",
        }
    )
    assert answer["type"] == "queued" and answer["session_id"] == session.session_id
    await ws.until(lambda f: f["type"] == "turn_updated" and f.get("client_msg_id") == "w1")
    await bot.idle()
    assert any(m.text == "echo: from the web chat" for m in bot.fake.bot_messages("42"))
    assert [t.content for t in await turns()][-1] == "from the web chat"
    assert await sync_to_async(Turn.objects.filter(session_id=session.pk).count)() == 2
