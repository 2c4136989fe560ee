"""Helpers and fixtures of the Telegram tests: the settings that point the adapter at a fake
Bot API server, a `Bot` that speaks to the real webhook route, and readers of what was stored.
Test modules import the fixtures they use (`fake_telegram`, `bot_with`, `bot`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import AsyncClient, override_settings

from chatcore.engine import runtime
from chatcore.engine.engine import Engine
from sessions_app.models import (
    Message,
    Turn,
)
from tests.fakeplatforms import TELEGRAM_TOKEN, FakeTelegram

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
