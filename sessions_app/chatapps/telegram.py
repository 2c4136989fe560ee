"""Telegram (PROTOCOL "Chat apps"): Bot API over plain httpx.

Why not python-telegram-bot: its `Application` owns the update loop, persistence and
handler dispatch, which here belong to the engine and the database (durable de-duplication,
queue, leases); its `Bot` needs an `initialize()` round trip per instance and wraps every
call in its own request/retry layer, while the sink needs to see each 429's `retry_after`
itself to throttle edits (latest wins). The Bot API is a handful of JSON POSTs, so the
client below is a thin httpx wrapper with the same async stack as the rest of the project.

Inbound: `POST /channels/telegram/webhook` (the `X-Telegram-Bot-Api-Secret-Token` header
must equal TELEGRAM_WEBHOOK_SECRET) or `manage.py telegram_poll` (getUpdates with offset).
Each `update_id` is handled exactly once (taken, then marked handled with its work). Group
messages count only when they mention the bot, reply to it, or are commands addressed to it
(`/new@bot`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import IO, Any

import httpx
from django.conf import settings

from chatcore.common.dbthreads import on_db
from chatcore.engine import commands
from chatcore.engine.delivery import DeliveryError, TargetNotFound
from chatcore.engine.engine import Engine

from . import store
from .base import (
    Adapter,
    IncomingMessage,
    PlatformClient,
    RetryAfter,
    StreamingSink,
    adapter_for,
    handle_incoming,
    settle_event,
)
from .events import Malformed, telegram_update
from .media import PlatformMedia, download, unavailable
from .render import telegram_html

logger = logging.getLogger(__name__)

CHANNEL = "telegram"
MESSAGE_LIMIT = 4096
_NOT_FOUND = ("message to edit not found", "chat not found", "message_id_invalid")


def config() -> dict[str, Any]:
    return dict(settings.CHATAPPS[CHANNEL])


def enabled() -> bool:
    return bool(config()["BOT_TOKEN"])


class TelegramClient(PlatformClient):
    channel = CHANNEL
    limit = MESSAGE_LIMIT

    def __init__(self, *, timeout: float = 15.0) -> None:
        cfg = config()
        self.base = f"{cfg['API_BASE']}/bot{cfg['BOT_TOKEN']}"
        self.http = httpx.AsyncClient(timeout=timeout)

    async def call(self, method: str, payload: dict[str, Any]) -> Any:
        try:
            response = await self.http.post(f"{self.base}/{method}", json=payload)
        except httpx.HTTPError as exc:
            raise DeliveryError(f"{method}: {type(exc).__name__}") from exc
        try:
            body = response.json()
        except ValueError as exc:
            raise DeliveryError(f"{method}: HTTP {response.status_code}") from exc
        if body.get("ok"):
            return body.get("result")
        description = str(body.get("description", ""))
        code = body.get("error_code", response.status_code)
        if code == 429:
            retry = (body.get("parameters") or {}).get("retry_after", 1)
            raise RetryAfter(float(retry))
        if "message is not modified" in description:
            return None  # the same text again: nothing to change
        if code in (400, 403) and any(s in description.lower() for s in _NOT_FOUND):
            raise TargetNotFound(f"{method}: {description}")
        raise DeliveryError(f"{method}: {code} {description}")

    def render(self, markdown: str) -> str:
        return telegram_html(markdown)

    async def send(self, chat_id: str, rendered: str, *, reply_to: str | None) -> str:
        payload: dict[str, Any] = {"chat_id": chat_id, "text": rendered, "parse_mode": "HTML"}
        if reply_to:
            payload["reply_parameters"] = {
                "message_id": int(reply_to),
                "allow_sending_without_reply": True,
            }
        result = await self.call("sendMessage", payload)
        return str(result["message_id"])

    async def edit(self, chat_id: str, message_id: str, rendered: str) -> None:
        await self.call(
            "editMessageText",
            {
                "chat_id": chat_id,
                "message_id": int(message_id),
                "text": rendered,
                "parse_mode": "HTML",
            },
        )

    async def send_text(self, chat_id: str, text: str, *, reply_to: str | None) -> str:
        payload: dict[str, Any] = {"chat_id": chat_id, "text": text}
        if reply_to:
            payload["reply_parameters"] = {
                "message_id": int(reply_to),
                "allow_sending_without_reply": True,
            }
        result = await self.call("sendMessage", payload)
        return str(result["message_id"])

    async def download(
        self, message: IncomingMessage, media: PlatformMedia
    ) -> tuple[IO[bytes], int]:
        """H3: `getFile`, then the file's bytes from the Bot API's file path."""
        try:
            found = await self.call("getFile", {"file_id": media.key})
        except DeliveryError:
            raise unavailable() from None
        path = str((found or {}).get("file_path") or "")
        if not path:
            raise unavailable()
        cfg = config()
        return await download(self.http, f"{cfg['API_BASE']}/file/bot{cfg['BOT_TOKEN']}/{path}")

    async def aclose(self) -> None:
        await self.http.aclose()


class TelegramSink(StreamingSink):
    channel = CHANNEL

    def make_client(self) -> PlatformClient:
        return TelegramClient()


class TelegramAdapter(Adapter):
    channel = CHANNEL

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.bot_id = ""
        self.username = ""

    def client(self) -> TelegramClient:
        return TelegramClient()

    async def on_start(self) -> None:
        """Learn who the bot is (for mentions) and set its command menu (B3)."""
        client = self.client()
        try:
            me = await client.call("getMe", {})
            self.bot_id = str(me.get("id", ""))
            self.username = str(me.get("username", ""))
            await client.call(
                "setMyCommands",
                {
                    "commands": [
                        {"command": item["name"], "description": item["help"][:256]}
                        for item in commands.describe_registry()
                    ]
                },
            )
        finally:
            await client.aclose()

    def parse(self, update: dict[str, Any]) -> IncomingMessage | None:
        """The message of an update, or None for anything this bot does not answer."""
        message = update.get("message")
        if not isinstance(message, dict):
            return None
        media = _media(message)
        # H3: a photo or document carries its text as a caption.
        text = message.get("caption", "") if media else message.get("text")
        chat = message.get("chat") or {}
        sender = message.get("from") or {}
        if not isinstance(text, str) or "id" not in chat or "id" not in sender:
            return None
        is_group = chat.get("type") in ("group", "supergroup")
        addressed = not is_group
        reply = message.get("reply_to_message") or {}
        replied_to_bot = str((reply.get("from") or {}).get("id", "")) == self.bot_id != ""
        mention = f"@{self.username}" if self.username else ""
        if is_group:
            addressed = replied_to_bot or bool(mention and mention.lower() in text.lower())
        if text.startswith("/"):
            head, sep, rest = text.partition(" ")
            name, at, bot = head.partition("@")
            if at:
                if self.username and bot.lower() != self.username.lower():
                    return None  # a command for another bot
                addressed = True
            # Telegram clients send /start when a user opens the bot: show the commands.
            text = "/help" if name == "/start" else name + sep + rest
        if mention:
            text = _strip_mention(text, mention)
        name = " ".join(
            str(part) for part in (sender.get("first_name"), sender.get("last_name")) if part
        )
        return IncomingMessage(
            channel=CHANNEL,
            chat_id=str(chat["id"]),
            is_group=is_group,
            chat_title=str(chat.get("title") or ""),
            sender_id=str(sender["id"]),
            sender_name=name or str(sender.get("username") or ""),
            message_id=str(message["message_id"]),
            text=text,
            addressed=addressed,
            reply_to_message_id=str(reply["message_id"]) if "message_id" in reply else None,
            language=str(sender.get("language_code") or ""),
            media=media,
        )

    async def handle_update(self, update: dict[str, Any]) -> str:
        """One update, exactly once: its update_id is taken durably first and marked handled
        with the work it causes ("retry": nothing was stored, deliver it again). Its fields
        are checked first (`events`): a malformed update is "invalid" and claims nothing."""
        try:
            update = telegram_update(update)
        except Malformed:
            return "invalid"
        update_id = update["update_id"]
        claim = await on_db(store.event_take)(channel=CHANNEL, event_id=str(update_id))
        if claim is None:
            return "duplicate"
        message = self.parse(update)
        if message is None:
            await settle_event(claim)
            return "ignored"
        client = self.client()
        try:
            return await handle_incoming(
                engine=self.engine, client=client, message=message, claim=claim
            )
        finally:
            await client.aclose()


def _media(message: dict[str, Any]) -> tuple[PlatformMedia, ...]:
    """H3: the file of a message: a photo (its largest size) or a document."""
    photos = message.get("photo")
    if isinstance(photos, list) and photos and isinstance(photos[-1], dict):
        largest = photos[-1]
        if largest.get("file_id"):
            return (
                PlatformMedia(
                    key=str(largest["file_id"]),
                    name=f"photo-{message.get('message_id', '')}.jpg",
                    size=largest.get("file_size"),
                ),
            )
    document = message.get("document")
    if isinstance(document, dict) and document.get("file_id"):
        return (
            PlatformMedia(
                key=str(document["file_id"]),
                name=str(document.get("file_name") or "document"),
                size=document.get("file_size"),
            ),
        )
    return ()


def _strip_mention(text: str, mention: str) -> str:
    lowered = text.lower()
    at = lowered.find(mention.lower())
    if at < 0:
        return text
    return (text[:at] + text[at + len(mention) :]).strip()


def secret_ok(header: str | None) -> bool:
    secret = config()["WEBHOOK_SECRET"]
    if not secret:
        return False
    return header is not None and hmac.compare_digest(header.encode(), secret.encode())


async def telegram_adapter(engine: Engine) -> TelegramAdapter:
    adapter = await adapter_for(engine, CHANNEL, TelegramAdapter)
    assert isinstance(adapter, TelegramAdapter)
    return adapter


async def poll(engine: Engine, *, stop: asyncio.Event, timeout: int | None = None) -> int:
    """Polling mode: getUpdates with an offset until `stop` is set; returns updates handled.
    Telegram refuses getUpdates while a webhook is set (delete it first)."""
    adapter = await telegram_adapter(engine)
    wait = config()["POLL_TIMEOUT_SECONDS"] if timeout is None else timeout
    offset: int | None = None
    handled = 0
    client = TelegramClient(timeout=wait + 15)
    try:
        while not stop.is_set():
            payload: dict[str, Any] = {"timeout": wait, "allowed_updates": ["message"]}
            if offset is not None:
                payload["offset"] = offset
            try:
                updates = await client.call("getUpdates", payload)
            except RetryAfter as exc:
                await asyncio.sleep(exc.seconds)
                continue
            except DeliveryError as exc:
                logger.warning("getUpdates failed: %s", exc)
                await asyncio.sleep(1)
                continue
            for update in updates or []:
                if await adapter.handle_update(update) == "retry":
                    # Not stored: confirm nothing from here on, so getUpdates brings it again.
                    await asyncio.sleep(1)
                    break
                if isinstance(update, dict) and isinstance(update.get("update_id"), int):
                    offset = max(offset or 0, update["update_id"] + 1)
                handled += 1
    finally:
        await client.aclose()
    return handled
