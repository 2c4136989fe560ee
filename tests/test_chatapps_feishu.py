"""Feishu / Lark through the real stack: the event callback route (AsyncClient on the real
ASGI handler), the real engine with the fake model, and a fake Open API server on loopback
that keeps every card and its updates. Covers SPEC A1, B1-B4, C1, C4, C6, D4, D5 and
PROTOCOL "Chat apps"."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from django.conf import settings
from django.test import AsyncClient, override_settings

from chatcore.engine import runtime
from chatcore.engine.engine import Engine
from sessions_app.models import ChannelChat, ChannelEvent, Message, Session, Turn
from tests.engine_helpers import unwrap_engine_statements, wrap_engine_statements
from tests.fakemodel import Reply
from tests.fakeplatforms import (
    FEISHU_APP_ID,
    FEISHU_APP_SECRET,
    FEISHU_BOT_OPEN_ID,
    Failure,
    FakeFeishu,
)

pytestmark = [pytest.mark.django_db(transaction=True)]

EVENTS = "/channels/feishu/events"
VERIFY = "verify-token-1"
ENCRYPT_KEY = "encrypt-key-1"


def encrypt(plaintext: str, key: str = ENCRYPT_KEY) -> str:
    """Feishu's callback encryption: AES-256-CBC, key = SHA-256(encrypt key), IV prefixed."""
    padder = padding.PKCS7(128).padder()
    data = padder.update(plaintext.encode()) + padder.finalize()
    iv = os.urandom(16)
    encryptor = Cipher(algorithms.AES(hashlib.sha256(key.encode()).digest()), modes.CBC(iv))
    enc = encryptor.encryptor()
    return base64.b64encode(iv + enc.update(data) + enc.finalize()).decode()


def signed(body: bytes, key: str = ENCRYPT_KEY) -> dict[str, str]:
    timestamp, nonce = str(int(time.time())), "nonce-1"
    signature = hashlib.sha256((timestamp + nonce + key).encode() + body).hexdigest()
    return {
        "X-Lark-Request-Timestamp": timestamp,
        "X-Lark-Request-Nonce": nonce,
        "X-Lark-Signature": signature,
    }


@dataclass
class App:
    fake: FakeFeishu
    engine: Engine
    http: AsyncClient
    encrypted: bool
    _events: int = 0

    def event(
        self,
        text: str,
        *,
        chat_id: str = "oc_chat1",
        sender: str = "ou_user1",
        group: bool = False,
        mentions: list[dict[str, Any]] | None = None,
        parent_id: str | None = None,
        event_id: str | None = None,
    ) -> dict[str, Any]:
        self._events += 1
        message: dict[str, Any] = {
            "message_id": self.fake.user_message(chat_id),
            "chat_id": chat_id,
            "chat_type": "group" if group else "p2p",
            "message_type": "text",
            "content": json.dumps({"text": text}),
            "mentions": mentions or [],
        }
        if parent_id:
            message["parent_id"] = message["root_id"] = parent_id
        return {
            "schema": "2.0",
            "header": {
                "event_id": event_id or f"ev-{self._events}-{os.urandom(4).hex()}",
                "event_type": "im.message.receive_v1",
                "create_time": str(int(time.time() * 1000)),
                "token": VERIFY,
                "app_id": FEISHU_APP_ID,
            },
            "event": {
                "sender": {"sender_id": {"open_id": sender}, "sender_type": "user"},
                "message": message,
            },
        }

    async def post(
        self, payload: dict[str, Any], *, sign: bool = True, key: str = ENCRYPT_KEY
    ) -> Any:
        if self.encrypted:
            body = json.dumps({"encrypt": encrypt(json.dumps(payload), key)}).encode()
        else:
            body = json.dumps(payload).encode()
        headers = signed(body, key) if sign and self.encrypted else {}
        return await self.http.post(EVENTS, body, content_type="application/json", headers=headers)

    async def say(self, text: str, **kw: Any) -> tuple[dict[str, Any], str]:
        event = self.event(text, **kw)
        response = await self.post(event)
        assert response.status_code == 200, response.content
        return event, response.json()["result"]

    async def idle(self) -> None:
        await self.engine.wait_idle(timeout=30)

    def answers_to(self, event: dict[str, Any]) -> list[Any]:
        own = event["event"]["message"]["message_id"]
        return [m for m in self.fake.bot_messages() if m.reply_to == own]


@pytest.fixture
def fake_feishu() -> Iterator[FakeFeishu]:
    server = FakeFeishu().start()
    try:
        yield server
    finally:
        server.stop()


def feishu_settings(fake: FakeFeishu, *, encrypted: bool, **chat: Any) -> dict[str, Any]:
    return {
        "CHATAPPS": {
            **settings.CHATAPPS,
            "feishu": {
                "APP_ID": FEISHU_APP_ID,
                "APP_SECRET": FEISHU_APP_SECRET,
                "VERIFICATION_TOKEN": VERIFY,
                "ENCRYPT_KEY": ENCRYPT_KEY if encrypted else "",
                "API_BASE": fake.url,
                "EDIT_INTERVAL_SECONDS": 0.05,
            },
        },
        "CHAT": {
            **settings.CHAT,
            "SINKS": {"feishu": "sessions_app.chatapps.feishu.FeishuSink"},
            "SINK_BACKOFF_SECONDS": 0.01,
            **chat,
        },
    }


@pytest_asyncio.fixture
async def app_with(fake_feishu: FakeFeishu, make_engine: Any) -> AsyncIterator[Any]:
    overrides: list[Any] = []

    async def make(*, encrypted: bool = True, **chat: Any) -> App:
        override = override_settings(**feishu_settings(fake_feishu, encrypted=encrypted, **chat))
        override.enable()
        overrides.append(override)
        engine = await make_engine()
        runtime.set_engine(engine)
        return App(fake_feishu, engine, AsyncClient(), encrypted)

    yield make
    runtime.set_engine(None)
    for override in reversed(overrides):
        override.disable()


@pytest_asyncio.fixture
async def app(app_with: Any) -> App:
    return await app_with()


async def turns() -> list[Turn]:
    return await sync_to_async(lambda: list(Turn.objects.order_by("received_at", "number")))()


# --- callbacks: verification, signature, encryption, de-duplication ---------------------------


async def test_url_verification_is_answered_with_its_challenge(app_with: Any) -> None:
    # covers: PROTOCOL "Chat apps" (url_verification)
    plain = await app_with(encrypted=False)
    challenge = {"type": "url_verification", "challenge": "ch-123", "token": VERIFY}
    response = await plain.post(challenge)
    assert response.status_code == 200 and response.json() == {"challenge": "ch-123"}
    wrong = await plain.post({**challenge, "token": "nope"})
    assert wrong.status_code == 403


async def test_an_encrypted_url_verification_is_decrypted(app: App) -> None:
    # covers: PROTOCOL "Chat apps" (FEISHU_ENCRYPT_KEY)
    challenge = {"type": "url_verification", "challenge": "ch-enc", "token": VERIFY}
    response = await app.post(challenge, sign=False)
    assert response.json() == {"challenge": "ch-enc"}


@pytest.mark.parametrize("problem", ["bad-signature", "no-signature", "wrong-key", "bad-token"])
async def test_a_callback_failing_its_checks_is_refused_and_changes_nothing(
    app: App, problem: str
) -> None:
    # covers: F2, D5 (signature and verification token checked before anything is read)
    event = app.event("hello")
    if problem == "bad-token":
        event["header"]["token"] = "forged"
        response = await app.post(event)
    elif problem == "wrong-key":
        response = await app.post(event, key="another-key")
    else:
        body = json.dumps({"encrypt": encrypt(json.dumps(event))}).encode()
        headers = signed(body) if problem == "bad-signature" else {}
        if problem == "bad-signature":
            headers["X-Lark-Signature"] = "0" * 64
        response = await app.http.post(
            EVENTS, body, content_type="application/json", headers=headers
        )
    assert response.status_code in (400, 403)
    assert await sync_to_async(ChannelEvent.objects.count)() == 0
    assert await sync_to_async(Session.objects.count)() == 0
    assert app.fake.bot_messages() == []


async def test_a_redelivered_event_is_never_a_second_turn(app: App) -> None:
    # covers: D5, C1 (event_id de-duplicated durably)
    event = app.event("hello")
    first = await app.post(event)
    second = await app.post(event)
    assert first.json()["result"] == "send" and second.json()["result"] == "duplicate"
    await app.idle()
    assert len(await turns()) == 1
    assert [m.text for m in app.answers_to(event)] == ["echo: hello"]


async def test_an_event_whose_turn_could_not_be_stored_is_handled_on_redelivery(
    app_with: Any, fake_model
) -> None:
    # covers: D5, C2, A4 (exactly once: the event is marked handled with its turn)
    from tests.storage_helpers import FailStatements

    app = await app_with(STORAGE_RETRY_DELAYS_MS=[1])
    event = app.event("keep me")
    fail = FailStatements(Turn._meta.db_table, "INSERT", failures=1000)
    await wrap_engine_statements(fail)
    try:
        refused = await app.post(event)
    finally:
        await unwrap_engine_statements(fail)
    # A non-2xx answer makes Feishu deliver the event again; nothing was stored or answered.
    assert refused.status_code == 503 and refused.json()["result"] == "retry"
    assert await turns() == [] and app.answers_to(event) == []
    assert (await app.post(event)).json()["result"] == "send"
    assert (await app.post(event)).json()["result"] == "duplicate"
    await app.idle()
    assert len(await turns()) == 1
    assert [m.text for m in app.answers_to(event)] == ["echo: keep me"]


async def test_a_send_streams_into_one_card_updated_as_it_grows(app: App, fake_model) -> None:
    # covers: D4, D5
    answer = "# Plan\nStep **one** then step two, " * 4
    fake_model.script(Reply(text=answer, chunk=6, delay=0.02))
    event, outcome = await app.say("plan it")
    assert outcome == "send"
    await app.idle()
    (card,) = app.answers_to(event)
    assert card.msg_type == "interactive"
    assert card.text.startswith("**Plan**\nStep **one**")  # headings as bold lines
    assert len(card.edits) >= 2
    stored = await sync_to_async(Message.objects.get)(role="user")
    assert stored.source["from_user_id"] == "ou_user1"
    assert stored.source["reply_to"] == event["event"]["message"]["message_id"]


async def test_group_answers_only_when_the_bot_is_mentioned_or_replied_to(app: App) -> None:
    # covers: PROTOCOL "Chat apps" (groups)
    other = [{"key": "@_user_1", "id": {"open_id": "ou_someone"}, "name": "Sam"}]
    _e, outcome = await app.say("@_user_1 lunch?", group=True, chat_id="oc_team", mentions=other)
    assert outcome == "ignored"
    bot = [{"key": "@_user_1", "id": {"open_id": FEISHU_BOT_OPEN_ID}, "name": "Bot"}]
    event, outcome = await app.say(
        "@_user_1 summarise", group=True, chat_id="oc_team", mentions=bot
    )
    assert outcome == "send"
    await app.idle()
    (card,) = app.answers_to(event)
    assert card.text == "echo: summarise"
    reply, outcome = await app.say(
        "more", group=True, chat_id="oc_team", sender="ou_user2", parent_id=card.message_id
    )
    assert outcome == "send"
    await app.idle()
    assert app.answers_to(reply)[0].text == "echo: more"


async def test_a_429_while_updating_the_card_is_honoured(app: App, fake_model) -> None:
    # covers: D4
    app.fake.fail(Failure("update", app.fake.rate_limited(1), times=1, block_seconds=1))
    answer = "growing " * 40
    fake_model.script(Reply(text=answer, chunk=5, delay=0.02))
    event, _ = await app.say("go")
    await app.idle()
    (card,) = app.answers_to(event)
    assert card.text == answer
    assert app.fake.early_calls == 0
    assert len(app.fake.bot_messages()) == 1


async def test_a_failed_final_update_falls_back_to_one_plain_message(app: App, fake_model) -> None:
    # covers: D4
    app.fake.fail(Failure("update", app.fake.error(230020, "edit failed"), times=-1))
    fake_model.script(Reply(text="final words"))
    event, _ = await app.say("hi")
    await app.idle()
    sent = app.answers_to(event)
    assert [(m.msg_type, m.text) for m in sent] == [("interactive", "…"), ("text", "final words")]


# --- the scenario table of the web chat --------------------------------------------------------


async def test_two_sends_stop_and_steer(app: App, fake_model) -> None:
    # covers: C1, C4, C6
    gate = threading.Event()
    fake_model.script(Reply(text="first", gate=gate))
    one, _ = await app.say("one")
    two, _ = await app.say("two")
    gate.set()
    await app.idle()
    assert [m.text for m in app.answers_to(one)] == ["first"]
    assert [m.text for m in app.answers_to(two)] == ["echo: two"]
    # Steer: a reply to the card being written.
    gate = threading.Event()
    fake_model.script(Reply(text="drafting", gate=gate))
    three, _ = await app.say("three")
    (card,) = await app.fake.wait_for(lambda: app.answers_to(three))
    _s, outcome = await app.say("shorter please", parent_id=card.message_id)
    assert outcome == "steer"
    gate.set()
    await app.idle()
    assert app.answers_to(three)[0].text.endswith("echo: shorter please")
    # Stop: the card ends with its partial and a note.
    fake_model.script(Reply(text="going on ", endless=True, delay=0.02))
    four, _ = await app.say("four")
    await app.fake.wait_for(lambda: any(m.edits for m in app.answers_to(four)))
    stop, outcome = await app.say("/stop")
    assert outcome == "command"
    await app.idle()
    assert app.answers_to(stop)[0].text == "Stopped the running answer."
    assert app.answers_to(four)[0].text.endswith("⏹ Stopped.")
    assert [t.status for t in await turns()] == ["completed", "completed", "completed", "cancelled"]


async def test_named_dialogs_and_title_with_slash_commands(app: App) -> None:
    # covers: B1, B2, B3
    async def command(text: str) -> str:
        event, outcome = await app.say(text)
        assert outcome in ("command", "error")
        (reply,) = app.answers_to(event)
        assert reply.msg_type == "text"
        return str(reply.text)

    created = await command("/new Budget")
    new_id = re.search(r"Created dialog (\S+):", created).group(1)  # type: ignore[union-attr]
    assert f"* {new_id} — Budget" in await command("/sessions")
    assert await command("/rename Budget 2027") == "Renamed to: Budget 2027"
    assert "Title: Budget 2027" in await command("/info")
    assert "does not exist" in await command("/switch missing")
    assert "/new [title]" in await command("/help")
    assert await command("/stop") == "Nothing to stop."
    assert "compaction" in (await command("/compact")).lower()
    second = re.search(r"Created dialog (\S+):", await command("/new")).group(1)  # type: ignore[union-attr]
    assert (await command(f"/switch {new_id}")).startswith(f"Switched to {new_id}")
    assert (await command("/delete")).startswith(f"Deleted dialog {new_id}.")
    chat = await sync_to_async(ChannelChat.objects.get)()
    assert chat.current_dialog_id == second
    assert len(await turns()) == 0


# --- malformed and replayed callbacks (issue 56 rows 5, 6, 8) ---------------------------------


async def nothing_stored() -> None:
    assert await sync_to_async(ChannelEvent.objects.count)() == 0
    assert await sync_to_async(Session.objects.count)() == 0


async def test_unauthenticated_odd_callbacks_are_refused_never_a_500(app_with: Any) -> None:
    # covers: F2, I3 (issue 56 row 5: a non-ASCII token, a header that is a string, a
    # non-ASCII signature answered 500)
    plain = await app_with(encrypted=False)
    event = plain.event("hello")
    assert (
        await plain.post({**event, "header": {**event["header"], "token": "é"}})
    ).status_code == 403
    assert (await plain.post({**event, "header": "x"})).status_code == 400
    assert (await plain.post({"token": ["x"], "type": "url_verification"})).status_code == 400
    body = json.dumps({"encrypt": encrypt(json.dumps(event))}).encode()
    with override_settings(**feishu_settings(plain.fake, encrypted=True)):
        for signature in ("é" * 64, "\u00ff", ""):
            headers = {**signed(body), "X-Lark-Signature": signature}
            response = await plain.http.post(
                EVENTS, body, content_type="application/json", headers=headers
            )
            assert response.status_code == 403
    await nothing_stored()


async def test_a_malformed_event_with_a_valid_token_is_400_and_stores_nothing(
    app_with: Any,
) -> None:
    # covers: F3, I3 (issue 56 row 6: an event body "x" or content "[1]" answered 500 and
    # left a ChannelEvent row behind)
    for encrypted in (False, True):
        app = await app_with(encrypted=encrypted)
        event = app.event("hello")
        message = event["event"]["message"]
        broken = [
            {**event, "event": "x"},
            {**event, "event": {**event["event"], "message": {**message, "content": "[1]"}}},
            {**event, "event": {**event["event"], "message": {**message, "content": "{"}}},
            {**event, "event": {**event["event"], "message": {**message, "mentions": "x"}}},
            {**event, "event": {**event["event"], "message": {**message, "chat_id": 5}}},
            {**event, "event": {**event["event"], "sender": []}},
            {**event, "header": {**event["header"], "event_id": 5}},
        ]
        for payload in broken:
            response = await app.post(payload)
            assert response.status_code == 400, (payload, response.content)
        await nothing_stored()
    # Content nested as deep as the JSON reader allows is read with it, not a 500.
    deep = app.event("deep")
    deep["event"]["message"]["content"] = '{"text": "deep", "x": ' + "[" * 1000 + "]" * 1000 + "}"
    assert (await app.post(deep)).json()["result"] == "send"
    # A well-formed event afterwards is answered as usual.
    sent, outcome = await app.say("still here?")
    assert outcome == "send"
    await app.idle()
    assert app.answers_to(sent)


async def test_a_correctly_signed_old_callback_is_refused_as_a_replay(app: App, fake_model) -> None:
    # covers: F2, D5 (issue 56 row 8: a signed body from 2001 was accepted and answered;
    # replays stay refused past the 7 days event ids are kept)
    event = app.event("hello from the past")
    body = json.dumps({"encrypt": encrypt(json.dumps(event))}).encode()
    for timestamp in ("978307200", str(int(time.time()) - 3600), str(int(time.time()) + 3600), "x"):
        nonce = "nonce-old"
        signature = hashlib.sha256((timestamp + nonce + ENCRYPT_KEY).encode() + body).hexdigest()
        headers = {
            "X-Lark-Request-Timestamp": timestamp,
            "X-Lark-Request-Nonce": nonce,
            "X-Lark-Signature": signature,
        }
        response = await app.http.post(
            EVENTS, body, content_type="application/json", headers=headers
        )
        assert response.status_code == 403
    await nothing_stored()
    assert fake_model.turn_requests() == []
    # The same event signed now is accepted.
    assert (await app.post(event)).json()["result"] == "send"


async def test_an_event_created_before_its_id_is_remembered_is_refused(
    app_with: Any, fake_model
) -> None:
    # covers: D5, F2 (issue 56 row 8: event ids are forgotten after 7 days; an older event,
    # signed or not, is refused by its create_time instead of being handled again)
    for encrypted in (False, True):
        app = await app_with(encrypted=encrypted)
        for create_time in ("978307200000", str(int((time.time() - 8 * 86400) * 1000)), "soon"):
            event = app.event("an old event")
            event["header"]["create_time"] = create_time
            assert (await app.post(event)).status_code == 403
        await nothing_stored()
    assert fake_model.turn_requests() == []
