"""Feishu / Lark (PROTOCOL "Chat apps"): event callbacks v2.0 in, Open API messages out.

The SDK (`lark-oapi`) is used for what it does well here: the documented AES-256-CBC
decryption of encrypted callbacks (`AESCipher`, key = SHA-256 of FEISHU_ENCRYPT_KEY). Its
event dispatcher and API client are synchronous (`requests`) and would block the event loop
or need a thread per call, so outbound calls use httpx directly against the documented API:
`auth/v3/tenant_access_token/internal`, `im/v1/messages` (create, reply) and
`PATCH im/v1/messages/:message_id` (update an interactive card; cards are what Feishu lets a
bot edit in place, with a markdown element for the answer).

Inbound: `POST /channels/feishu/events`. `url_verification` is answered with its challenge;
every callback's verification token must match; with FEISHU_ENCRYPT_KEY set, bodies arrive
encrypted and carry `X-Lark-Signature` = sha256(timestamp + nonce + key + body), checked
before anything is read. Each `event_id` is handled exactly once (taken durably, marked
handled with the work it causes). Group messages count only
when they @mention the bot or reply to one of its answers.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from typing import IO, Any

import httpx
from django.conf import settings

from chatcore.common.dbthreads import on_db
from chatcore.engine.delivery import DeliveryError, TargetNotFound
from chatcore.engine.engine import Engine

from . import store
from .base import (
    EVENT_KEEP,
    Adapter,
    IncomingMessage,
    PlatformClient,
    RetryAfter,
    StreamingSink,
    adapter_for,
    handle_incoming,
    settle_event,
)
from .events import Malformed, feishu_envelope, load_json
from .media import PlatformMedia, download, unavailable
from .render import feishu_markdown

logger = logging.getLogger(__name__)

CHANNEL = "feishu"
# A card's markdown; Feishu caps a card at about 30 KB of JSON (CJK text is 3 bytes a char).
MESSAGE_LIMIT = 8000
_RATE_LIMITED = {99991400}
_NOT_FOUND = {230002, 230011, 231003}
# How old a signed callback may be (seconds) unless FEISHU_MAX_REQUEST_AGE_SECONDS says.
MAX_REQUEST_AGE = 300
# tenant_access_token per (API base, app id): (token, monotonic expiry).
_tokens: dict[tuple[str, str], tuple[str, float]] = {}


class CallbackRefused(Exception):
    """A callback that fails its signature, token or decryption check (HTTP 403/400)."""

    def __init__(self, message: str, status: int = 403) -> None:
        super().__init__(message)
        self.status = status


def config() -> dict[str, Any]:
    return dict(settings.CHATAPPS[CHANNEL])


def enabled() -> bool:
    cfg = config()
    return bool(cfg["APP_ID"] and cfg["APP_SECRET"])


def _card(markdown: str) -> str:
    return json.dumps(
        {
            "config": {"wide_screen_mode": True, "update_multi": True},
            "elements": [{"tag": "markdown", "content": markdown}],
        },
        ensure_ascii=False,
    )


def _media(kind: str, content: dict[str, Any], message_id: str) -> tuple[PlatformMedia, ...]:
    """H3: the image (`image_key`) or file (`file_key`, `file_name`) of a message."""
    if kind == "image" and content.get("image_key"):
        return (PlatformMedia(str(content["image_key"]), f"image-{message_id}.png", kind="image"),)
    if kind == "file" and content.get("file_key"):
        name = str(content.get("file_name") or "file")
        return (PlatformMedia(str(content["file_key"]), name, kind="file"),)
    return ()


class FeishuClient(PlatformClient):
    channel = CHANNEL
    limit = MESSAGE_LIMIT

    def __init__(self, *, timeout: float = 15.0) -> None:
        cfg = config()
        self.base = cfg["API_BASE"]
        self.app_id = cfg["APP_ID"]
        self.app_secret = cfg["APP_SECRET"]
        self.http = httpx.AsyncClient(timeout=timeout)

    async def token(self) -> str:
        key = (self.base, self.app_id)
        cached = _tokens.get(key)
        if cached and cached[1] > time.monotonic():
            return cached[0]
        response = await self.http.post(
            f"{self.base}/open-apis/auth/v3/tenant_access_token/internal",
            json={"app_id": self.app_id, "app_secret": self.app_secret},
        )
        body = response.json()
        if body.get("code") != 0:
            raise DeliveryError(f"tenant token: {body.get('code')} {body.get('msg')}")
        # Refresh a few minutes before Feishu's expiry.
        _tokens[key] = (
            body["tenant_access_token"],
            time.monotonic() + max(60, int(body.get("expire", 7200)) - 300),
        )
        return str(body["tenant_access_token"])

    async def call(
        self, method: str, path: str, payload: dict[str, Any] | None, **params: str
    ) -> Any:
        try:
            token = await self.token()
            response = await self.http.request(
                method,
                f"{self.base}/open-apis/{path}",
                json=payload,
                params=params or None,
                headers={"Authorization": f"Bearer {token}"},
            )
        except httpx.HTTPError as exc:
            raise DeliveryError(f"{path}: {type(exc).__name__}") from exc
        try:
            body = response.json()
        except ValueError as exc:
            raise DeliveryError(f"{path}: HTTP {response.status_code}") from exc
        code = body.get("code")
        if response.status_code == 429 or code in _RATE_LIMITED:
            reset = response.headers.get("x-ogw-ratelimit-reset") or "1"
            try:
                raise RetryAfter(float(reset))
            except ValueError:
                raise RetryAfter(1.0) from None
        if code == 0:
            # Most methods answer in `data`; bot/v3/info answers at the top level.
            return body["data"] if "data" in body else body
        if response.status_code == 404 or code in _NOT_FOUND:
            raise TargetNotFound(f"{path}: {code} {body.get('msg')}")
        raise DeliveryError(f"{path}: {code} {body.get('msg')}")

    def render(self, markdown: str) -> str:
        return feishu_markdown(markdown)

    async def _post(self, chat_id: str, msg_type: str, content: str, reply_to: str | None) -> str:
        if reply_to:
            data = await self.call(
                "POST",
                f"im/v1/messages/{reply_to}/reply",
                {"msg_type": msg_type, "content": content},
            )
        else:
            data = await self.call(
                "POST",
                "im/v1/messages",
                {"receive_id": chat_id, "msg_type": msg_type, "content": content},
                receive_id_type="chat_id",
            )
        return str(data["message_id"])

    async def send(self, chat_id: str, rendered: str, *, reply_to: str | None) -> str:
        return await self._post(chat_id, "interactive", _card(rendered), reply_to)

    async def download(
        self, message: IncomingMessage, media: PlatformMedia
    ) -> tuple[IO[bytes], int]:
        """H3: a message's image or file (`im/v1/messages/{id}/resources/{key}`)."""
        try:
            token = await self.token()
        except (DeliveryError, httpx.HTTPError, ValueError):
            raise unavailable() from None
        return await download(
            self.http,
            f"{self.base}/open-apis/im/v1/messages/{message.message_id}/resources/{media.key}",
            params={"type": media.kind},
            headers={"Authorization": f"Bearer {token}"},
        )

    async def edit(self, chat_id: str, message_id: str, rendered: str) -> None:
        await self.call("PATCH", f"im/v1/messages/{message_id}", {"content": _card(rendered)})

    async def send_text(self, chat_id: str, text: str, *, reply_to: str | None) -> str:
        content = json.dumps({"text": text}, ensure_ascii=False)
        return await self._post(chat_id, "text", content, reply_to)

    async def aclose(self) -> None:
        await self.http.aclose()


class FeishuSink(StreamingSink):
    channel = CHANNEL

    def make_client(self) -> PlatformClient:
        return FeishuClient()


def open_callback(body: bytes, headers: dict[str, str]) -> dict[str, Any]:
    """Check and decrypt a callback body. Raises `CallbackRefused`; changes nothing. The
    signature and token are compared as bytes (whatever characters a forger sends), a
    signed request older than FEISHU `MAX_REQUEST_AGE_SECONDS` is refused (a replay), and
    the fields the checks read are checked first (`events`)."""
    cfg = config()
    key = cfg["ENCRYPT_KEY"]
    try:
        outer = load_json(body)
    except Malformed as exc:
        raise CallbackRefused(str(exc), status=400) from exc
    if not isinstance(outer, dict):
        raise CallbackRefused("the body is not a JSON object", status=400)
    signature = headers.get("x-lark-signature")
    if key and signature is not None:
        timestamp = headers.get("x-lark-request-timestamp", "")
        nonce = headers.get("x-lark-request-nonce", "")
        expected = hashlib.sha256((timestamp + nonce + key).encode() + body).hexdigest()
        if not hmac.compare_digest(signature.encode(), expected.encode()):
            raise CallbackRefused("signature check failed")
        if not _fresh(timestamp, cfg.get("MAX_REQUEST_AGE_SECONDS", MAX_REQUEST_AGE)):
            raise CallbackRefused("the request is too old (X-Lark-Request-Timestamp)")
    if "encrypt" in outer:
        if not key:
            raise CallbackRefused("encrypted callback but FEISHU_ENCRYPT_KEY is not set")
        from lark_oapi.core.utils import AESCipher

        try:
            data = load_json(AESCipher(key).decrypt_str(str(outer["encrypt"])).encode())
        except Exception as exc:
            raise CallbackRefused("the body could not be decrypted", status=400) from exc
    else:
        data = outer
    try:
        envelope = feishu_envelope(data)
    except Malformed as exc:
        raise CallbackRefused(str(exc), status=400) from exc
    if key and signature is None and envelope.get("type") != "url_verification":
        # Feishu signs every event when an encrypt key is set; only the URL verification
        # of the app's configuration page comes without the headers.
        raise CallbackRefused("signature missing")
    token = envelope.get("token") if "token" in data else envelope.get("header", {}).get("token")
    expected_token = cfg["VERIFICATION_TOKEN"]
    if expected_token:
        if token is None or not hmac.compare_digest(token.encode(), expected_token.encode()):
            raise CallbackRefused("verification token mismatch")
    elif not key:
        raise CallbackRefused("set FEISHU_VERIFICATION_TOKEN or FEISHU_ENCRYPT_KEY")
    if not _recent_event(envelope.get("header", {}).get("create_time")):
        # Signed or not: an event older than its id is remembered would be handled again.
        raise CallbackRefused("the event is older than its id is remembered (a replay)")
    return data


def _recent_event(create_time: str | None) -> bool:
    """Whether an event's `create_time` (milliseconds) is within the days its id is kept
    for de-duplication (less an hour), and not more than an hour ahead."""
    if create_time is None:
        return True  # a url_verification carries none
    if not create_time.isascii() or not create_time.isdigit() or len(create_time) > 15:
        return False
    age = time.time() - int(create_time) / 1000
    return -3600 <= age <= EVENT_KEEP.total_seconds() - 3600


def _fresh(timestamp: str, max_age: int) -> bool:
    """Whether a request's `X-Lark-Request-Timestamp` (seconds) is within `max_age` of now."""
    if not timestamp.isascii() or not timestamp.isdigit() or len(timestamp) > 12:
        return False
    return abs(time.time() - int(timestamp)) <= max_age


class FeishuAdapter(Adapter):
    channel = CHANNEL

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.bot_open_id = ""

    def client(self) -> FeishuClient:
        return FeishuClient()

    async def on_start(self) -> None:
        """Learn the bot's open_id, to recognise its @mentions in groups."""
        client = self.client()
        try:
            data = await client.call("GET", "bot/v3/info", None)
            bot = data.get("bot") if "bot" in data else data
            self.bot_open_id = str((bot or {}).get("open_id", ""))
        finally:
            await client.aclose()

    async def parse(self, event: dict[str, Any]) -> IncomingMessage | None:
        body = event.get("event") or {}
        message = body.get("message") or {}
        sender = body.get("sender") or {}
        kind = message.get("message_type")
        if sender.get("sender_type") not in (None, "user") or kind not in ("text", "image", "file"):
            return None
        try:
            # Checked to be a JSON object (`events.feishu_event`); orjson bounds its nesting.
            content = load_json((message.get("content") or "{}").encode())
        except Malformed:
            return None
        if not isinstance(content, dict):
            return None
        text = str(content.get("text", "")) if kind == "text" else ""
        media = _media(str(kind), content, str(message.get("message_id", "")))
        if kind != "text" and not media:
            return None
        chat_id = message.get("chat_id")
        sender_id = (sender.get("sender_id") or {}).get("open_id")
        if not chat_id or not sender_id or not message.get("message_id"):
            return None
        is_group = message.get("chat_type") != "p2p"
        mentioned = False
        for mention in message.get("mentions") or []:
            key = str(mention.get("key", ""))
            is_bot = (mention.get("id") or {}).get("open_id") == self.bot_open_id != ""
            mentioned = mentioned or is_bot
            text = text.replace(key, "" if is_bot else f"@{mention.get('name', '')}")
        text = " ".join(text.split()) if not text.lstrip().startswith("/") else text.strip()
        parent = message.get("parent_id") or None
        replied = bool(parent) and await on_db(store.is_bot_message)(
            channel=CHANNEL, chat_id=str(chat_id), message_id=str(parent)
        )
        return IncomingMessage(
            channel=CHANNEL,
            chat_id=str(chat_id),
            is_group=is_group,
            sender_id=str(sender_id),
            sender_name="",
            message_id=str(message["message_id"]),
            text=text,
            addressed=not is_group or mentioned or replied,
            reply_to_message_id=str(parent) if parent else None,
            media=media,
        )

    async def handle_event(self, event: dict[str, Any]) -> str:
        """One checked event (`events.feishu_event`), exactly once by its event_id."""
        header = event.get("header") or {}
        event_id = header.get("event_id")
        if not isinstance(event_id, str) or not event_id:
            return "invalid"
        if header.get("event_type") != "im.message.receive_v1":
            return "ignored"
        claim = await on_db(store.event_take)(channel=CHANNEL, event_id=event_id)
        if claim is None:
            return "duplicate"
        message = await self.parse(event)
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


async def feishu_adapter(engine: Engine) -> FeishuAdapter:
    adapter = await adapter_for(engine, CHANNEL, FeishuAdapter)
    assert isinstance(adapter, FeishuAdapter)
    return adapter
