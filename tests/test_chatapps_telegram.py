"""Telegram through the real stack: webhook route (AsyncClient on the real ASGI handler) or
polling, the real engine with the fake model, and a fake Bot API server on loopback that
keeps every message and edit a user would see. Covers SPEC A1, B1-B4, C1, C4, C6, C11, D4,
D5, F6 and PROTOCOL "Chat apps"."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import AsyncClient, override_settings
from django.utils import timezone

from chatcore.engine import runtime
from chatcore.engine.engine import Engine
from sessions_app.chatapps import store, telegram
from sessions_app.chatapps.render import telegram_html
from sessions_app.models import (
    ChannelAccount,
    ChannelChat,
    ChannelDelivery,
    ChannelEvent,
    Message,
    Session,
    StagedInput,
    Turn,
)
from tests.fakemodel import Reply
from tests.fakeplatforms import BOT_USERNAME, TELEGRAM_TOKEN, Failure, FakeTelegram

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]

SECRET = "webhook-s3cret"
WEBHOOK = "/channels/telegram/webhook"


def telegram_settings(fake: FakeTelegram, **chat: Any) -> dict[str, Any]:
    return {
        "CHATAPPS": {
            **settings.CHATAPPS,
            "telegram": {
                "BOT_TOKEN": TELEGRAM_TOKEN,
                "WEBHOOK_SECRET": SECRET,
                "API_BASE": fake.url,
                "EDIT_INTERVAL_SECONDS": 0.05,
                "POLL_TIMEOUT_SECONDS": 1,
            },
        },
        "CHAT": {
            **settings.CHAT,
            "SINKS": {"telegram": "sessions_app.chatapps.telegram.TelegramSink"},
            "SINK_BACKOFF_SECONDS": 0.01,
            **chat,
        },
    }


@dataclass
class Bot:
    fake: FakeTelegram
    engine: Engine
    http: AsyncClient

    async def post(self, update: dict[str, Any], secret: str | None = SECRET) -> Any:
        headers = {"X-Telegram-Bot-Api-Secret-Token": secret} if secret is not None else {}
        return await self.http.post(
            WEBHOOK, update, content_type="application/json", headers=headers
        )

    async def say(self, text: str, **kw: Any) -> tuple[dict[str, Any], str]:
        """A user's message through the webhook; returns the update and the outcome."""
        update = self.fake.update(text, **kw)
        response = await self.post(update)
        assert response.status_code == 200, response.content
        return update, response.json()["result"]

    async def idle(self) -> None:
        await self.engine.wait_idle(timeout=30)

    def answers_to(self, update: dict[str, Any]) -> list[Any]:
        own = str(update["message"]["message_id"])
        return [m for m in self.fake.bot_messages() if m.reply_to == own]


@pytest.fixture
def fake_telegram() -> Iterator[FakeTelegram]:
    server = FakeTelegram().start()
    try:
        yield server
    finally:
        server.stop()


@pytest_asyncio.fixture
async def bot_with(fake_telegram: FakeTelegram, make_engine: Any) -> AsyncIterator[Any]:
    overrides: list[Any] = []

    async def make(**chat: Any) -> Bot:
        override = override_settings(**telegram_settings(fake_telegram, **chat))
        override.enable()
        overrides.append(override)
        engine = await make_engine()
        runtime.set_engine(engine)
        return Bot(fake_telegram, engine, AsyncClient())

    yield make
    runtime.set_engine(None)
    for override in reversed(overrides):
        override.disable()


@pytest_asyncio.fixture
async def bot(bot_with: Any) -> Bot:
    return await bot_with()


async def turns() -> list[Turn]:
    return await sync_to_async(lambda: list(Turn.objects.order_by("received_at", "number")))()


async def user_messages() -> list[Message]:
    return await sync_to_async(
        lambda: list(Message.objects.filter(role="user").order_by("created_at"))
    )()


# --- inbound: secret, de-duplication, groups -------------------------------------------------


@pytest.mark.parametrize("secret", [None, "wrong"])
async def test_webhook_refuses_a_missing_or_wrong_secret_and_changes_nothing(
    bot: Bot, secret: str | None
) -> None:
    # covers: D5, F2 (PROTOCOL "Chat apps": the secret token is checked on every update)
    response = await bot.post(bot.fake.update("hello"), secret=secret)
    assert response.status_code == 403
    assert await sync_to_async(ChannelEvent.objects.count)() == 0
    assert await sync_to_async(Session.objects.count)() == 0
    assert bot.fake.bot_messages() == []


async def test_webhook_is_not_found_when_telegram_is_not_configured(
    fake_telegram: FakeTelegram,
) -> None:
    # covers: PROTOCOL "Chat apps" (off when the variables are unset)
    cfg = {**settings.CHATAPPS, "telegram": {**settings.CHATAPPS["telegram"], "BOT_TOKEN": ""}}
    with override_settings(CHATAPPS=cfg):
        response = await AsyncClient().post(
            WEBHOOK, fake_telegram.update("hi"), content_type="application/json"
        )
    assert response.status_code == 404


async def test_a_redelivered_update_is_never_a_second_turn(bot: Bot) -> None:
    # covers: D5, C1 (update_id de-duplicated durably)
    update = bot.fake.update("hello there")
    first = await bot.post(update)
    second = await bot.post(update)
    assert first.json()["result"] == "send"
    assert second.json()["result"] == "duplicate"
    await bot.idle()
    assert len(await turns()) == 1
    # Durable: a new process (another engine) refuses it too.
    runtime.set_engine(None)
    again = await bot.post(update)
    assert again.json()["result"] == "duplicate"
    assert len(await turns()) == 1


async def _with_failing(fail: Any) -> Any:
    """Install an execute wrapper on the connection of the thread the ORM calls run in."""
    from django.db import connection

    def install() -> Any:
        wrapper = connection.execute_wrapper(fail)
        wrapper.__enter__()
        return wrapper

    return await sync_to_async(install)()


async def test_an_update_whose_turn_could_not_be_stored_is_handled_on_redelivery(
    bot_with: Any, fake_model
) -> None:
    # covers: D5, C2, A4 (exactly once: the update is marked handled with its turn, not before)
    from tests.storage_helpers import FailStatements

    bot = await bot_with(STORAGE_RETRY_DELAYS_MS=[1, 2])
    update = bot.fake.update("do not lose me")
    fail = FailStatements(Turn._meta.db_table, "INSERT", failures=1000)
    wrapper = await _with_failing(fail)
    try:
        response = await bot.post(update)
    finally:
        await sync_to_async(wrapper.__exit__)(None, None, None)
    assert fail.attempts == 3
    # Nothing was accepted: the platform is told to deliver it again, the user sees no error.
    assert response.status_code == 503 and response.json()["result"] == "retry"
    assert await turns() == [] and bot.answers_to(update) == []
    again = await bot.post(update)
    assert again.status_code == 200 and again.json()["result"] == "send"
    assert (await bot.post(update)).json()["result"] == "duplicate"
    await bot.idle()
    assert [t.content for t in await turns()] == ["do not lose me"]
    assert [m.text for m in bot.answers_to(update)] == ["echo: do not lose me"]


async def test_an_update_taken_by_a_process_that_died_is_handled_on_redelivery(
    bot: Bot, fake_model
) -> None:
    # covers: D5, C2 (a crash between taking the update and accepting its turn loses nothing)
    update = bot.fake.update("taken, then the process died")
    event_id = str(update["update_id"])
    dead = await sync_to_async(store.event_take)(channel="telegram", event_id=event_id)
    assert dead is not None
    # While the claim is fresh its holder may still be working: a redelivery waits.
    assert (await bot.post(update)).json()["result"] == "duplicate"
    # The holder is gone: once its claim is old, the redelivery is handled.
    await sync_to_async(ChannelEvent.objects.filter(event_id=event_id).update)(
        claimed_at=timezone.now() - store.EVENT_CLAIM_TIMEOUT - timedelta(seconds=1)
    )
    assert (await bot.post(update)).json()["result"] == "send"
    assert (await bot.post(update)).json()["result"] == "duplicate"
    # The dead process's late accept cannot make a second turn either.
    with pytest.raises(store.EventAlreadyAccepted):
        await sync_to_async(store.event_accept)(dead)
    await bot.idle()
    assert [t.content for t in await turns()] == ["taken, then the process died"]
    assert len(bot.answers_to(update)) == 1


async def test_polling_fetches_an_update_again_when_it_could_not_be_stored(
    bot_with: Any, fake_model
) -> None:
    # covers: D5, PROTOCOL "Chat apps" (telegram_poll confirms only what was stored)
    from tests.storage_helpers import FailStatements

    bot = await bot_with(STORAGE_RETRY_DELAYS_MS=[1])
    update = bot.fake.update("polled while the disk hiccups")
    bot.fake.queue_update(update)
    fail = FailStatements(Turn._meta.db_table, "INSERT", failures=2)
    wrapper = await _with_failing(fail)
    stop = asyncio.Event()
    poller = asyncio.ensure_future(telegram.poll(bot.engine, stop=stop, timeout=1))
    try:
        await bot.fake.wait_for(lambda: bot.answers_to(update), timeout=30)
    finally:
        stop.set()
        await asyncio.wait_for(poller, 10)
        await sync_to_async(wrapper.__exit__)(None, None, None)
    await bot.idle()
    assert fail.attempts == 3
    assert [t.content for t in await turns()] == ["polled while the disk hiccups"]


async def test_group_answers_only_when_mentioned_or_replied_to(bot: Bot) -> None:
    # covers: PROTOCOL "Chat apps" (groups), A1
    _update, outcome = await bot.say("just chatting", group=True, chat_id=-100500)
    assert outcome == "ignored"
    mention, outcome = await bot.say(f"@{BOT_USERNAME} what is 2+2?", group=True, chat_id=-100500)
    assert outcome == "send"
    await bot.idle()
    answer = bot.answers_to(mention)
    assert len(answer) == 1 and answer[0].text == "echo: what is 2+2?"
    # A reply to the bot's answer is addressed to it, from another member too.
    reply, outcome = await bot.say(
        "and 3+3?", group=True, chat_id=-100500, user_id=8, reply_to=answer[0].message_id
    )
    assert outcome == "send"
    await bot.idle()
    assert bot.answers_to(reply)[0].text == "echo: and 3+3?"
    # A command addressed to another bot is not ours.
    _update, outcome = await bot.say("/help@otherbot", group=True, chat_id=-100500)
    assert outcome == "ignored"
    # Both members wrote into the chat the first one connected (A1).
    chat = await sync_to_async(ChannelChat.objects.select_related("account").get)()
    assert chat.is_group and chat.account.external_id == "7"
    sessions = await sync_to_async(lambda: list(Session.objects.all()))()
    assert [s.session_id for s in sessions] == ["telegram:-100500:" + sessions[0].dialog_id]
    assert len(await turns()) == 2


# --- streaming answers (D4) -----------------------------------------------------------------


async def test_a_send_streams_into_one_message_edited_as_it_grows(bot: Bot, fake_model) -> None:
    # covers: D4, D5, C1
    answer = "Here is **bold** and `code` with <tags> & more text " * 3
    fake_model.script(Reply(text=answer, chunk=6, delay=0.02))
    update, outcome = await bot.say("tell me")
    assert outcome == "send"
    await bot.idle()
    mine = bot.answers_to(update)
    assert len(mine) == 1, "one platform message per turn"
    message = mine[0]
    assert message.parse_mode == "HTML"
    assert message.text == telegram_html(answer)
    assert "<b>bold</b>" in message.text and "&lt;tags&gt; &amp;" in message.text
    assert len(message.edits) >= 2, "edited as the answer grows"
    grown = [e for e in message.edits[:-1] if e != message.text]
    assert grown and all(len(e) <= len(message.text) + 2 for e in grown)
    # D5: the user message keeps sender, received time and reply-to.
    (stored,) = await user_messages()
    assert stored.content == "tell me"
    assert stored.source["from_channel"] == "telegram"
    assert stored.source["from_user_id"] == "7"
    assert stored.source["reply_to"] == str(update["message"]["message_id"])
    assert stored.source["client_msg_id"] == str(update["message"]["message_id"])
    assert abs((timezone.now() - stored.created_at).total_seconds()) < 120


async def test_a_429_during_streaming_is_honoured(bot: Bot, fake_model) -> None:
    # covers: D4 (retry_after honoured; no edit inside the wait; the final edit arrives)
    bot.fake.fail(
        Failure(
            "editMessageText",
            bot.fake.rate_limited(1),
            times=1,
            block_seconds=1,
        )
    )
    answer = "streaming " * 40
    fake_model.script(Reply(text=answer, chunk=5, delay=0.02))
    update, _outcome = await bot.say("go")
    await bot.idle()
    (message,) = bot.answers_to(update)
    assert message.text == telegram_html(answer)
    assert bot.fake.early_calls == 0, "no edit was sent while retry_after ran"
    assert len(bot.fake.bot_messages()) == 1, "no fallback message"


async def test_a_failed_final_edit_falls_back_to_exactly_one_plain_message(
    bot: Bot, fake_model
) -> None:
    # covers: D4
    bot.fake.fail(
        Failure("editMessageText", bot.fake.error(500, "Internal Server Error"), times=-1)
    )
    fake_model.script(Reply(text="the **whole** answer"))
    update, _outcome = await bot.say("hi")
    await bot.idle()
    sent = bot.answers_to(update)
    assert [m.text for m in sent] == ["…", "the **whole** answer"]
    assert sent[1].parse_mode is None  # the fallback is plain
    finals = [c for c in bot.fake.calls_of("editMessageText") if "whole" in c.body["text"]]
    assert len(finals) == settings.CHAT["SINK_RETRIES"] + 1


async def test_a_long_answer_is_split_without_breaking_a_code_block(bot: Bot, fake_model) -> None:
    # covers: D4 (Telegram's 4096 limit)
    code = "\n".join(f"    value_{i} = compute({i}) < limit" for i in range(160))
    answer = "Intro paragraph.\n\n```python\n" + code + "\n```\n\nThe end."
    fake_model.script(Reply(text=answer, chunk=400))
    update, _outcome = await bot.say("code please")
    await bot.idle()
    first = bot.answers_to(update)
    assert len(first) == 1
    pieces = [first[0].text] + [
        m.text for m in bot.fake.bot_messages() if m.reply_to is None and m is not first[0]
    ]
    assert len(pieces) >= 2
    for piece in pieces:
        assert len(piece) <= 4096
        assert piece.count("<pre>") == piece.count("</pre>")
    joined = "".join(pieces)
    assert "value_0 = compute(0) &lt; limit" in joined and "value_159" in joined
    assert pieces[-1].endswith("The end.")


# --- the scenario table of the web chat --------------------------------------------------------


async def test_two_sends_are_two_turns_each_answering_its_message(bot: Bot, fake_model) -> None:
    # covers: C1, D4
    gate = threading.Event()
    fake_model.script(Reply(text="first answer", gate=gate))
    one, _ = await bot.say("one")
    two, outcome = await bot.say("two")
    assert outcome == "send"
    gate.set()
    await bot.idle()
    assert [m.text for m in bot.answers_to(one)] == ["first answer"]
    assert [m.text for m in bot.answers_to(two)] == ["echo: two"]
    assert [t.status for t in await turns()] == ["completed", "completed"]


async def test_stop_ends_the_running_answer_with_its_partial(bot: Bot, fake_model) -> None:
    # covers: C6, D4
    fake_model.script(Reply(text="partial words ", endless=True, delay=0.02))
    update, _ = await bot.say("write forever")
    await fake_model.requests_made(1)
    await bot.fake.wait_for(lambda: any(m.edits for m in bot.answers_to(update)))
    stop, outcome = await bot.say("/stop")
    assert outcome == "command"
    await bot.idle()
    (reply,) = bot.answers_to(stop)
    assert reply.text == "Stopped the running answer."
    (answer,) = bot.answers_to(update)
    assert answer.text.startswith("partial words") and answer.text.endswith("⏹ Stopped.")
    assert [t.status for t in await turns()] == ["cancelled"]


async def test_a_reply_to_the_running_answer_steers_it(bot: Bot, fake_model) -> None:
    # covers: C4
    gate = threading.Event()
    fake_model.script(Reply(text="working on it", gate=gate))
    update, _ = await bot.say("start")
    await fake_model.requests_made(1)
    (answer,) = await bot.fake.wait_for(lambda: bot.answers_to(update))
    _steer, outcome = await bot.say("actually, in French", reply_to=answer.message_id)
    assert outcome == "steer"
    staged = await sync_to_async(lambda: list(StagedInput.objects.all()))()
    assert [(s.mode, s.content) for s in staged] == [("steer", "actually, in French")]
    gate.set()
    await bot.idle()
    # The steer reached the running turn at its next step boundary (C4): the model saw it,
    # and the one streamed message ends with the steered answer.
    assert [t.status for t in await turns()] == ["completed"]
    assert fake_model.requests[-1].messages[-1]["content"] == "actually, in French"
    steer = await sync_to_async(Message.objects.get)(content="actually, in French")
    assert steer.kind == "steer" and steer.source["context"]["in_reply_to"] == answer.message_id
    assert answer.text.endswith("echo: actually, in French")


async def test_named_dialogs_with_all_nine_commands(bot: Bot, fake_model) -> None:
    # covers: B1, B2, B3
    await bot.say("hello")
    await bot.idle()
    first = (await sync_to_async(Session.objects.get)()).dialog_id

    async def command(text: str) -> str:
        update, outcome = await bot.say(text)
        assert outcome in ("command", "error")
        (reply,) = bot.answers_to(update)
        return str(reply.text)

    created = await command("/new Trip plans")
    new_id = re.search(r"Created dialog (\S+):", created).group(1)  # type: ignore[union-attr]
    assert created.endswith("Trip plans")
    listing = await command("/sessions")
    assert f"* {new_id} — Trip plans" in listing and f"- {first}" in listing
    assert "Title: Trip plans" in await command("/info")
    assert "Renamed to: Kyoto" == await command("/rename Kyoto")
    assert "compaction" in (await command("/compact")).lower()
    assert await command("/stop") == "Nothing to stop."
    assert "/switch <dialog_id>" in await command("/help")
    assert "does not exist" in await command("/switch nope")
    assert await command(f"/switch {first}") == f"Switched to {first}: Dialog {first}"
    await command(f"/switch {new_id}")
    deleted = await command("/delete")
    assert deleted.startswith(f"Deleted dialog {new_id}.")
    assert "Unknown command /frobnicate" in await command("/frobnicate")
    # The chat's current dialog is persisted: after /delete it is the remaining one.
    chat = await sync_to_async(ChannelChat.objects.get)()
    assert chat.current_dialog_id == first
    # Commands are not turns and not history (B3).
    assert len(await turns()) == 1


async def test_the_current_dialog_survives_a_restart(bot: Bot, bot_with: Any, fake_model) -> None:
    # covers: B1 (the chat's current dialog is persisted)
    await bot.say("/new Work")
    work = await sync_to_async(lambda: Session.objects.get(title="Work"))()
    await bot.say("/new Home")
    await bot.say(f"/switch {work.dialog_id}")
    # A new process: a new engine and adapter, nothing in memory.
    await bot.engine.shutdown(grace=2)
    restarted = await bot_with()
    update, outcome = await restarted.say("where am I?")
    assert outcome == "send"
    await restarted.idle()
    stored = await sync_to_async(
        lambda: Message.objects.select_related("session").get(role="user")
    )()
    assert stored.session.pk == work.pk
    assert restarted.answers_to(update)[0].text == "echo: where am I?"


async def test_the_title_follows_rename_and_the_automatic_title(bot_with: Any, fake_model) -> None:
    # covers: B4
    bot = await bot_with(AUTO_TITLE_AFTER=1)

    def model(body: dict[str, Any]) -> Reply:
        if body.get("tools"):
            return Reply(text="sure")
        return Reply(text="Weekend hiking")

    fake_model.default = model
    await bot.say("plan a hike")
    await bot.idle()

    async def title() -> str:
        return str((await sync_to_async(Session.objects.get)()).title)

    for _ in range(200):
        if await title() == "Weekend hiking":
            break
        await asyncio.sleep(0.05)
    assert await title() == "Weekend hiking"
    update, _ = await bot.say("/rename Mountains")
    assert bot.answers_to(update)[0].text == "Renamed to: Mountains"
    assert await title() == "Mountains"


async def test_set_my_commands_lists_the_nine_commands(bot: Bot) -> None:
    # covers: B3 (Telegram's command menu)
    await bot.say("/help")
    names = [c["command"] for c in bot.fake.commands]
    assert names == [
        "new",
        "sessions",
        "switch",
        "rename",
        "delete",
        "info",
        "stop",
        "compact",
        "help",
    ]
    assert all(c["description"] for c in bot.fake.commands)


async def test_errors_answer_the_original_message(bot_with: Any, fake_model) -> None:
    # covers: D5, F6 (the rate limit applies to the platform account)
    bot = await bot_with(RATE_LIMIT_PER_MINUTE=1)
    await bot.say("first")
    limited, outcome = await bot.say("second")
    assert outcome == "error"
    (reply,) = bot.answers_to(limited)
    assert "too many" in reply.text.lower() or "rate" in reply.text.lower()
    # Another account in a group has its own budget.
    other, outcome = await bot.say(f"@{BOT_USERNAME} hi", group=True, chat_id=-5, user_id=99)
    assert outcome == "send"
    await bot.idle()
    assert len(await turns()) == 2


# --- accounts (A1, F6, F7) ----------------------------------------------------------------------


async def test_accounts_map_platform_users_and_an_operator_links_one(
    bot: Bot, user: Any, fake_model
) -> None:
    # covers: A1, F2 (a linked account's dialogs are listed for the web user)
    await bot.say("hello", user_id=7, first_name="Ann")
    await bot.idle()
    account = await sync_to_async(
        lambda: ChannelAccount.objects.select_related("service_user").get()
    )()
    assert (account.channel, account.external_id, account.display_name) == ("telegram", "7", "Ann")
    assert not account.service_user.has_usable_password()
    session = await sync_to_async(Session.objects.get)()
    assert session.owner_id == account.service_user_id

    from tests.test_api import Api, issue_token

    api = Api(AsyncClient(), {"Authorization": f"Bearer {await issue_token(user)}"})
    status, body, _ = await api.call("GET", "/sessions?channel=telegram")
    assert status == 200 and body["count"] == 0
    await sync_to_async(store.account_link)(account=account, user=user, writable=False)
    status, body, _ = await api.call("GET", "/sessions?channel=telegram")
    assert [item["session_id"] for item in body["items"]] == [session.session_id]
    # Linked read-only: the web user sees the dialog but cannot write into it.
    path = f"/sessions/{session.session_id}/messages"
    status, body, _ = await api.call("POST", path, {"content": "from the web"})
    assert status == 403 and body["code"] == "read_only"
    assert len(await turns()) == 1
    # Writable: a web send goes into the chat-app dialog and its answer reaches Telegram.
    account = await sync_to_async(store.account_link)(account=account, user=user, writable=True)
    status, body, _ = await api.call("POST", path, {"content": "from the web"})
    assert status == 202, body
    await bot.idle()
    assert any(m.text == "echo: from the web" for m in bot.fake.bot_messages("42"))
    # The chat keeps working under the linked identity.
    update, outcome = await bot.say("still here?", user_id=7)
    assert outcome == "send"
    await bot.idle()
    assert bot.answers_to(update)[0].text == "echo: still here?"
    assert await sync_to_async(Session.objects.count)() == 1


# --- polling and restarts -----------------------------------------------------------------


async def test_polling_takes_each_update_once_with_an_offset(bot: Bot, fake_model) -> None:
    # covers: PROTOCOL "Chat apps" (telegram_poll), D5
    first = bot.fake.update("polled one")
    second = bot.fake.update("polled two")
    bot.fake.queue_update(first)
    bot.fake.queue_update(second)
    bot.fake.queue_update(first)  # a redelivery
    stop = asyncio.Event()
    poller = asyncio.ensure_future(telegram.poll(bot.engine, stop=stop, timeout=1))
    await bot.fake.wait_for(lambda: bot.answers_to(second) and bot.answers_to(first))
    stop.set()
    await asyncio.wait_for(poller, 10)
    await bot.idle()
    assert [t.content for t in await turns()] == ["polled one", "polled two"]
    offsets = [c.body.get("offset") for c in bot.fake.calls_of("getUpdates")]
    assert offsets[0] is None and second["update_id"] + 1 in offsets


async def test_a_turn_interrupted_by_a_restart_ends_on_its_message_once(
    bot: Bot, fake_model
) -> None:
    # covers: C11, D4 (a dead process's streaming message gets one terminal)
    await bot.say("/info")  # makes the chat and its dialog
    session = await sync_to_async(Session.objects.get)()
    past = timezone.now() - timedelta(seconds=60)
    sink = telegram.TelegramSink()

    def crashed_state() -> Turn:
        Session.objects.filter(pk=session.pk).update(
            lease_owner="dead-process", lease_expires_at=past, turn_counter=1
        )
        return Turn.objects.create(
            session_id=session.pk,
            owner_id=session.owner_id,
            number=1,
            content="long question",
            status="running",
            started_at=past,
            partial_text="The first half of",
        )

    turn = await sync_to_async(crashed_state)()
    # The dead process had opened and edited the turn's message.
    handle = await sink.open({"chat_id": "42", "turn_id": str(turn.pk), "reply_to": None})
    handle.interval = 0
    await sink.update(handle, "The first half of")
    await handle.client.aclose()
    # A new process recovers the dialog (C11) and closes the message left open.
    await bot.engine.kick(session.pk)
    for _ in range(300):
        if (await sync_to_async(Turn.objects.get)(pk=turn.pk)).status != "running":
            break
        await asyncio.sleep(0.05)
    adapter = await telegram.telegram_adapter(bot.engine)
    assert await adapter.reconcile(grace=timedelta(0)) == 1
    assert await adapter.reconcile(grace=timedelta(0)) == 0
    message = next(m for m in bot.fake.bot_messages() if m.message_id == handle.message_id)
    assert message.text.startswith("The first half of")
    assert "⚠" in message.text
    assert len([e for e in message.edits if "⚠" in e]) == 1
    delivery = await sync_to_async(ChannelDelivery.objects.get)(turn_id=turn.pk)
    assert delivery.finished_at is not None


async def test_start_shows_the_commands(bot: Bot) -> None:
    # covers: B3 (Telegram clients send /start first)
    update, outcome = await bot.say("/start")
    assert outcome == "command"
    assert "/switch <dialog_id>" in bot.answers_to(update)[0].text


async def test_the_telegram_poll_command_answers_and_stops_on_sigterm(
    fake_telegram: FakeTelegram,
) -> None:
    # covers: PROTOCOL "Chat apps" (`manage.py telegram_poll`), F1
    import os
    import signal

    from django.core.management import CommandError, call_command

    from sessions_app.management.commands.telegram_poll import Command

    with override_settings(CHATAPPS={**settings.CHATAPPS, "telegram": {"BOT_TOKEN": ""}}):
        with pytest.raises(CommandError):
            await sync_to_async(call_command)("telegram_poll")
    update = fake_telegram.update("hello poller")
    fake_telegram.queue_update(update)
    with override_settings(**telegram_settings(fake_telegram)):
        command = Command()
        task = asyncio.ensure_future(command._run(1))
        own = str(update["message"]["message_id"])

        def answered() -> bool:
            return any(
                m.reply_to == own and m.text not in ("…", "") for m in fake_telegram.bot_messages()
            )

        await fake_telegram.wait_for(answered, timeout=30)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(task, 30)
    assert [t.content for t in await turns()] == ["hello poller"]
    assert runtime._engine is None


async def test_the_telegram_poll_command_closes_an_answer_left_open_without_any_update(
    fake_telegram: FakeTelegram,
) -> None:
    # covers: C11, D4 (the poller's engine closes a dead process's answer from the start)
    import os
    import signal

    from sessions_app.management.commands.telegram_poll import Command

    past = timezone.now() - timedelta(seconds=60)
    with override_settings(**telegram_settings(fake_telegram)):

        def crashed_state() -> Turn:
            ctx = store.chat_context(
                channel="telegram",
                chat_id="42",
                is_group=False,
                chat_title="",
                sender_id="7",
                sender_name="Ann",
            )
            Session.objects.filter(pk=ctx.current.pk).update(
                lease_owner="dead-process", lease_expires_at=past, turn_counter=1
            )
            return Turn.objects.create(
                session_id=ctx.current.pk,
                owner_id=ctx.owner.pk,
                number=1,
                content="long question",
                status="running",
                started_at=past,
                partial_text="Half an answer",
            )

        turn = await sync_to_async(crashed_state)()
        sink = telegram.TelegramSink()
        handle = await sink.open({"chat_id": "42", "turn_id": str(turn.pk), "reply_to": None})
        handle.interval = 0
        await sink.update(handle, "Half an answer")
        await handle.client.aclose()

        def closed() -> bool:
            return any(
                m.message_id == handle.message_id and "⚠" in m.text
                for m in fake_telegram.bot_messages()
            )

        task = asyncio.ensure_future(Command()._run(1))
        try:
            await fake_telegram.wait_for(closed, timeout=60)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(task, 30)
    assert fake_telegram.updates == []
    message = next(m for m in fake_telegram.bot_messages() if m.message_id == handle.message_id)
    assert message.text.startswith("Half an answer")


async def test_replies_follow_the_senders_language(bot: Bot) -> None:
    # covers: F5 (Telegram tells the sender's language)
    update, _ = await bot.say("/frobnicate", language_code="zh-hans")
    answer = bot.answers_to(update)[0].text
    assert "/frobnicate" in answer and any("\u4e00" <= ch <= "\u9fff" for ch in answer)
    update, _ = await bot.say("/frobnicate", language_code="en")
    assert bot.answers_to(update)[0].text.startswith("Unknown command /frobnicate")
