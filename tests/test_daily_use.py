"""The web chat in daily use, server side (issue 54; PROTOCOL `send` `literal`, SPEC B2, B3,
E3): a message that starts with `/` sent as a message, the user's API dialogs in the web
chat's list and open there, REST validation that speaks of characters, and counts that are
pluralised. Through the real ASGI stack, engine and fake model server."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.utils import translation

from chatcore.engine.commands import CommandContext, run_command
from sessions_app import services
from sessions_app.models import Message, MessageKind, Session
from tests.api_helpers import Api, wait_turn_row
from tests.ws_helpers import terminal

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


# --- 2. A message that starts with `/` ------------------------------------------------------


async def test_a_literal_send_is_a_message_even_with_a_leading_slash(
    connect: Any, fake_model: Any, user: Any
) -> None:
    # covers: B3, E1 (PROTOCOL `send` literal)
    ws = await connect(user)
    text = "/usr/bin/python crashes on start"

    refused = await ws.ask({"type": "send", "content": text, "client_msg_id": "c"})
    assert refused["type"] == "error" and refused["code"] == "unknown_command"

    queued = await ws.ask({"type": "send", "content": text, "literal": True, "client_msg_id": "m"})
    assert queued["type"] == "queued"
    await ws.until(terminal(queued["turn_id"]))
    stored = await sync_to_async(list)(
        Message.objects.filter(role="user").values_list("content", flat=True)
    )
    assert stored == [text]
    assert fake_model.turn_requests()[-1].messages[-1]["content"].startswith(text)

    # A known command still runs when not literal; `literal: false` is the default.
    info = await ws.ask(
        {"type": "send", "content": "/info", "literal": False, "client_msg_id": "i"}
    )
    assert info["type"] == "command_result" and info["command"] == "info"


async def test_literal_must_be_a_boolean(connect: Any, user: Any) -> None:
    # covers: B3 (bad input gets a clear error and changes nothing)
    ws = await connect(user)
    answer = await ws.ask(
        {"type": "send", "content": "/help", "literal": "yes", "client_msg_id": "x"}
    )
    assert answer["type"] == "error" and answer["code"] == "bad_request"
    assert "literal" in answer["message"]
    assert await Message.objects.filter(role="user").acount() == 0


async def test_rest_sends_a_slash_text_as_a_message_literal_or_not(
    api: Api, fake_model: Any
) -> None:
    # covers: E3 (PROTOCOL `send` literal: the REST API runs no slash commands, so every
    # message it takes is literal; a client that says so is not refused)
    data = await api.create()
    for content, extra in (("/etc/hosts", {}), ("/help me", {"literal": True})):
        ack = await api.send(data["session_id"], content, **extra)
        await wait_turn_row(ack["turn_id"])
    stored = await sync_to_async(list)(
        Message.objects.filter(role="user").order_by("seq").values_list("content", flat=True)
    )
    assert stored == ["/etc/hosts", "/help me"]


# --- 9. REST dialogs in the web chat; messages that read right -------------------------------


async def test_an_api_dialog_is_listed_in_the_web_chat_and_opens_there(
    api: Api, connect: Any, fake_model: Any, user: Any
) -> None:
    # covers: E1, E3, A1 (the user's own dialogs, whatever channel made them)
    made = await api.create(title="From a script")
    ws = await connect(user)

    items = {i["session_id"]: i for i in ws.sessions["items"]}
    item = items[made["session_id"]]
    assert (item["channel"], item["title"], item["read_only"]) == ("api", "From a script", False)
    web = ws.history["session_id"]
    assert items[web]["channel"] == "web"

    hist = await ws.ask(
        {"type": "history", "session_id": made["session_id"], "follow": True, "client_msg_id": "h"}
    )
    assert hist["type"] == "session_history" and hist["title"] == "From a script"
    queued = await ws.ask(
        {"type": "send", "session_id": made["session_id"], "content": "hi", "client_msg_id": "s"}
    )
    assert queued["type"] == "queued" and queued["session_id"] == made["session_id"]
    await ws.until(terminal(queued["turn_id"]))
    status, page, _ = await api.call("GET", f"/sessions/{made['session_id']}/messages")
    assert status == 200
    assert [m["content"] for m in page["messages"] if m["role"] != "system"] == ["hi", "echo: hi"]


async def test_another_users_api_dialog_stays_out_of_reach(
    api: Api, connect: Any, make_user: Any
) -> None:
    # covers: F2, A1
    made = await api.create()
    other = await connect(await sync_to_async(make_user)("mallory"))
    assert made["session_id"] not in {i["session_id"] for i in other.sessions["items"]}
    answer = await other.ask(
        {"type": "history", "session_id": made["session_id"], "client_msg_id": "o"}
    )
    assert answer["code"] == "not_found"


async def test_a_too_long_title_is_refused_in_characters(api: Api) -> None:
    # covers: E3
    status, body, _ = await api.call("POST", "/sessions", {"title": "x" * 201})
    assert status == 422
    assert "200 characters" in body["message"] and "items" not in body["message"]
    made = await api.create()
    status, body, _ = await api.call("PATCH", f"/sessions/{made['session_id']}", {"title": ""})
    assert status == 422 and "1 character" in body["message"] and "item" not in body["message"]
    assert await Session.objects.filter(title="x" * 201).acount() == 0


@pytest.mark.parametrize(
    ("language", "one", "two"),
    [("en", "(1 message)", "(2 messages)"), ("zh-hans", "（1 条消息）", "（2 条消息）")],
)
async def test_message_counts_are_pluralised(user: Any, language: str, one: str, two: str) -> None:
    # covers: B3, F5
    def make() -> tuple[Session, Session]:
        a = services.session_create(owner=user, channel="web", chat_id=f"u{user.pk}")
        b = services.session_create(owner=user, channel="web", chat_id=f"u{user.pk}")
        for session, n in ((a, 1), (b, 2)):
            services.messages_append(
                session_pk=session.pk,
                messages=[
                    services.NewMessage(role="user", content="q", kind=MessageKind.USER_INPUT)
                ]
                * n,
            )
        return a, b

    a, b = await sync_to_async(make)()
    ctx = CommandContext(owner=user, channel="web", chat_id=f"u{user.pk}", current=a)
    with translation.override(language):
        listing = (await run_command(ctx, "/sessions")).content
    lines = {
        line.split(" ")[1]: line
        for line in listing.splitlines()
        if a.dialog_id in line or b.dialog_id in line
    }
    assert lines[a.dialog_id].endswith(one) and lines[b.dialog_id].endswith(two)


# --- 5. The web chat's welcome --------------------------------------------------------------


async def test_the_web_welcome_speaks_of_the_web_chat_and_others_keep_b2s(user: Any) -> None:
    # covers: B2
    def welcome(channel: str) -> tuple[str, str]:
        session = services.session_create(owner=user, channel=channel, chat_id=f"u{user.pk}")
        return session.dialog_id, Message.objects.get(session=session, seq=1).content

    dialog_id, web = await sync_to_async(welcome)("web")
    assert dialog_id not in web and "/switch" not in web and "your list of dialogs" in web
    dialog_id, api = await sync_to_async(welcome)("api")
    assert dialog_id in api and "/sessions" in api and "/switch" in api


async def test_a_dialog_made_through_the_api_appears_in_an_open_web_chat(
    api: Api, connect: Any, user: Any
) -> None:
    # covers: E1, E3, D3
    ws = await connect(user)
    assert all(i["channel"] == "web" for i in ws.sessions["items"])

    made = await api.create(title="Made while the page is open")

    frames = await ws.until(
        lambda f: (
            f["type"] == "sessions" and made["session_id"] in {i["session_id"] for i in f["items"]}
        )
    )
    item = next(i for i in frames[-1]["items"] if i["session_id"] == made["session_id"])
    assert (item["channel"], item["read_only"]) == ("api", False)
