"""Telegram through the real stack: webhook route (AsyncClient on the real ASGI handler) or
polling, the real engine with the fake model, and a fake Bot API server on loopback that
keeps every message and edit a user would see: inbound updates (secret, de-duplication,
groups), accounts and the sender's language. Covers SPEC A1, D5, F5, F6 and PROTOCOL "Chat
apps"; streaming and the web chat's scenarios are in test_chatapps_telegram_answers.py,
polling and restarts in test_chatapps_telegram_poll.py."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import AsyncClient, override_settings
from django.utils import timezone

from chatcore.engine import runtime
from sessions_app.chatapps import store, telegram
from sessions_app.models import (
    ChannelAccount,
    ChannelChat,
    ChannelEvent,
    Session,
    Turn,
)
from tests.engine_helpers import unwrap_engine_statements, wrap_engine_statements
from tests.fakeplatforms import BOT_USERNAME, FakeTelegram
from tests.telegram_helpers import (
    WEBHOOK,
    Bot,
    turns,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


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


async def test_an_update_whose_turn_could_not_be_stored_is_handled_on_redelivery(
    bot_with: Any, fake_model
) -> None:
    # covers: D5, C2, A4 (exactly once: the update is marked handled with its turn, not before)
    from tests.storage_helpers import FailStatements

    bot = await bot_with(STORAGE_RETRY_DELAYS_MS=[1, 2])
    update = bot.fake.update("do not lose me")
    fail = FailStatements(Turn._meta.db_table, "INSERT", failures=1000)
    await wrap_engine_statements(fail)
    try:
        response = await bot.post(update)
    finally:
        await unwrap_engine_statements(fail)
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
    await wrap_engine_statements(fail)
    stop = asyncio.Event()
    poller = asyncio.ensure_future(telegram.poll(bot.engine, stop=stop, timeout=1))
    try:
        await bot.fake.wait_for(lambda: bot.answers_to(update), timeout=30)
    finally:
        stop.set()
        await asyncio.wait_for(poller, 10)
        await unwrap_engine_statements(fail)
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

    from tests.api_helpers import Api, issue_token

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


async def test_replies_follow_the_senders_language(bot: Bot) -> None:
    # covers: F5 (Telegram tells the sender's language)
    update, _ = await bot.say("/frobnicate", language_code="zh-hans")
    answer = bot.answers_to(update)[0].text
    assert "/frobnicate" in answer and any("\u4e00" <= ch <= "\u9fff" for ch in answer)
    update, _ = await bot.say("/frobnicate", language_code="en")
    assert bot.answers_to(update)[0].text.startswith("Unknown command /frobnicate")
