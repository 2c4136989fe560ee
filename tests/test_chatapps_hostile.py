"""Malformed platform bodies (issue 56 rows 5-8; SPEC F3, I3): every field of a Telegram
update is checked before anything is claimed or stored. A malformed body answers 400 and
leaves no row; a wrong secret of any characters answers 403; a well-formed update after them
is answered as usual. The Feishu rows are in test_chatapps_feishu.py (its fixtures)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from sessions_app.chatapps import events, telegram
from sessions_app.models import ChannelEvent, Session
from tests.telegram_helpers import SECRET, WEBHOOK, Bot

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


def broken_updates(update: dict[str, Any]) -> list[bytes]:
    message = update["message"]
    no_id = {k: v for k, v in message.items() if k != "message_id"}
    return [
        b"[" * 100_000,  # nesting past any parser's depth
        b'{"update_id": 1, "message": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        json.dumps({**update, "message": no_id}).encode(),
        json.dumps({**update, "message": {**message, "chat": "42"}}).encode(),
        json.dumps({**update, "message": {**message, "reply_to_message": "x"}}).encode(),
        json.dumps({**update, "message": {**message, "from": {"id": "7"}}}).encode(),
        json.dumps({**update, "message": {**message, "text": ["hi"]}}).encode(),
        json.dumps({**update, "update_id": "12"}).encode(),
        json.dumps([update]).encode(),
        b'"just a string"',
        b"\xff\xfe not json",
    ]


async def no_rows() -> None:
    assert await sync_to_async(ChannelEvent.objects.count)() == 0
    assert await sync_to_async(Session.objects.count)() == 0


async def test_a_malformed_update_is_400_and_claims_nothing(bot: Bot) -> None:
    # covers: F3, I3 (issue 56 row 7: a 100,000-deep `[`, no message_id, `chat` or
    # `reply_to_message` a string answered 500 and left claimed events behind)
    for body in broken_updates(bot.fake.update("hello")):
        response = await bot.http.post(
            WEBHOOK,
            body,
            content_type="application/json",
            headers={"X-Telegram-Bot-Api-Secret-Token": SECRET},
        )
        assert response.status_code == 400, (body[:80], response.content)
        assert "error" in response.json()
        await no_rows()
    # A well-formed update afterwards is answered as usual.
    update, outcome = await bot.say("still here?")
    assert outcome == "send"
    await bot.idle()
    assert bot.answers_to(update)


@pytest.mark.parametrize("secret", ["é", "\u00ff" * 40, SECRET + "x", ""])
async def test_a_wrong_secret_of_any_characters_is_403(bot: Bot, secret: str) -> None:
    # covers: F2, I3 (the secret is compared as bytes: any header value is a refusal)
    response = await bot.post(bot.fake.update("hello"), secret=secret)
    assert response.status_code == 403
    await no_rows()


async def test_polled_malformed_updates_are_skipped_without_a_claim(bot: Bot) -> None:
    # covers: I3 (the polling path checks updates the same way)
    adapter = await telegram.telegram_adapter(bot.engine)
    assert await adapter.handle_update({"update_id": 5, "message": {"chat": "x"}}) == "invalid"
    assert await adapter.handle_update({"update_id": "5"}) == "invalid"
    await no_rows()


def test_the_update_shape_keeps_what_the_adapter_reads() -> None:
    # covers: I3 (fields no adapter reads are ignored, so new platform fields break nothing)
    checked = events.telegram_update(
        {
            "update_id": 3,
            "message": {
                "message_id": 9,
                "chat": {"id": -100, "type": "supergroup", "title": "T", "extra": [1]},
                "from": {"id": 7, "first_name": "Ann", "is_premium": True},
                "text": "hi",
                "entities": [{"type": "bot_command"}],
            },
            "edited_message": {"anything": 1},
        }
    )
    assert checked == {
        "update_id": 3,
        "message": {
            "message_id": 9,
            "chat": {"id": -100, "type": "supergroup", "title": "T"},
            "from": {"id": 7, "first_name": "Ann"},
            "text": "hi",
        },
    }


async def test_polling_passes_a_malformed_update_and_answers_the_next(bot: Bot) -> None:
    # covers: I3, D5 (getUpdates: a malformed update claims nothing and holds up nothing)
    good = bot.fake.update("after the broken one")
    broken = {"update_id": good["update_id"] - 1, "message": {"message_id": 1, "chat": "x"}}
    bot.fake.queue_update(broken)
    bot.fake.queue_update(good)
    stop = asyncio.Event()
    poller = asyncio.ensure_future(telegram.poll(bot.engine, stop=stop, timeout=1))
    await bot.fake.wait_for(lambda: bot.answers_to(good))
    stop.set()
    await asyncio.wait_for(poller, 10)
    claimed = await sync_to_async(
        lambda: list(ChannelEvent.objects.values_list("event_id", flat=True))
    )()
    assert claimed == [str(good["update_id"])]
