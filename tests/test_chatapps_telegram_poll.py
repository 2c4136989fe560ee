"""Telegram polling and restarts (SPEC C11, D5; PROTOCOL "Chat apps"): offsets, a turn
interrupted by a restart, /start, and the `telegram_poll` command as a real process."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import override_settings
from django.utils import timezone

from chatcore.engine import runtime
from sessions_app.chatapps import store, telegram
from sessions_app.models import (
    ChannelDelivery,
    Session,
    Turn,
)
from tests.fakeplatforms import FakeTelegram
from tests.telegram_helpers import (
    Bot,
    telegram_settings,
    turns,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


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
    # The open answer is looked for every second, a second after its turn ended (5 s and
    # every 2 s by default).
    fast = {"DELIVERY_ORPHAN_GRACE_SECONDS": 1, "DELIVERY_RECONCILE_SECONDS": 1}
    with override_settings(**telegram_settings(fake_telegram, **fast)):

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
