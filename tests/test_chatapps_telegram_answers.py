"""Telegram answers (SPEC B1-B4, C1, C4, C6, D4; PROTOCOL "Chat apps"): streamed into one
message edited as it grows, rate limits, fallbacks, long answers, and the web chat's scenario
table (sends, stop, steering replies, the nine commands, titles, errors)."""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone

from sessions_app.chatapps.render import telegram_html
from sessions_app.models import (
    ChannelChat,
    Message,
    Session,
    StagedInput,
)
from tests.fakemodel import Reply
from tests.fakeplatforms import BOT_USERNAME, Failure
from tests.telegram_helpers import (
    Bot,
    turns,
    user_messages,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


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


async def test_set_my_commands_lists_the_ten_commands(bot: Bot) -> None:
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
        "model",
        "help",
    ]
    assert all(c["description"] for c in bot.fake.commands)


@pytest.mark.usefixtures("within_a_minute")
async def test_errors_answer_the_original_message(bot_with: Any, fake_model) -> None:
    # covers: D5, F6 (the rate limit applies to the platform account)
    from django.core.cache import cache

    await sync_to_async(cache.clear)()
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


async def test_commands_are_refused_during_shutdown_like_sends(bot: Bot) -> None:
    # covers: B3, F1 (a closing engine writes nothing new, whichever command arrives)
    await bot.say("/new Before")
    dialogs = await sync_to_async(Session.objects.count)()
    bot.engine.supervisor.close()
    for text in ("/new Late", "/rename Late", "hello"):
        update, outcome = await bot.say(text)
        assert outcome == "error", text
        (reply,) = bot.answers_to(update)
        assert "shutting down" in reply.text
    assert await sync_to_async(Session.objects.count)() == dialogs
    assert not await sync_to_async(Session.objects.filter(title="Late").exists)()
