"""The shapes of what the chat platforms send (F3, I3): every field the adapters read is
checked here, with pydantic, before anything is claimed or stored. A body that does not fit
is refused whole (`Malformed`, HTTP 400), never half handled; fields no adapter reads are
ignored, so a platform adding some breaks nothing.

Telegram: an `Update` (https://core.telegram.org/bots/api#update): only `message` is read.
Feishu: an event callback v2.0 (`im.message.receive_v1`) or a `url_verification`.
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class Malformed(Exception):
    """A platform body that is not what its platform sends (HTTP 400, nothing stored)."""


class _Shape(BaseModel):
    # Strict: a string is never read as a number, nor a number as a string.
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


def load_json(body: bytes) -> Any:
    """`body` as JSON, nesting bounded (orjson refuses past 1024 levels), or `Malformed`."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise Malformed("the body is not JSON") from exc


def _validated(shape: type[BaseModel], data: Any, what: str) -> dict[str, Any]:
    try:
        return shape.model_validate(data).model_dump(by_alias=True, exclude_none=True)
    except ValidationError as exc:
        fields = sorted({".".join(str(p) for p in e["loc"]) or what for e in exc.errors()})
        raise Malformed(f"malformed {what}: {', '.join(fields[:5])}") from None


# --- Telegram ---------------------------------------------------------------------------------


class TelegramUser(_Shape):
    id: int
    is_bot: bool | None = None
    first_name: str | None = None
    last_name: str | None = None
    username: str | None = None
    language_code: str | None = None


class TelegramChat(_Shape):
    id: int
    type: str
    title: str | None = None


class TelegramReplied(_Shape):
    message_id: int
    from_: TelegramUser | None = Field(default=None, alias="from")


class TelegramFile(_Shape):
    """A photo size or a document (H3): what the adapter downloads by `file_id`."""

    file_id: str = Field(min_length=1, max_length=512)
    file_size: int | None = None
    file_name: str | None = None
    mime_type: str | None = None


class TelegramMessage(_Shape):
    message_id: int
    chat: TelegramChat
    from_: TelegramUser | None = Field(default=None, alias="from")
    text: str | None = None
    # H3: a photo (its sizes, smallest first) or a document, with its text as a caption.
    caption: str | None = None
    photo: list[TelegramFile] | None = None
    document: TelegramFile | None = None
    reply_to_message: TelegramReplied | None = None


class TelegramUpdate(_Shape):
    update_id: int
    message: TelegramMessage | None = None


def telegram_update(data: Any) -> dict[str, Any]:
    """A Telegram update with every field the adapter reads checked, or `Malformed`."""
    return _validated(TelegramUpdate, data, "update")


# --- Feishu -----------------------------------------------------------------------------------


class FeishuHeader(_Shape):
    event_id: str = Field(min_length=1, max_length=256)
    event_type: str
    token: str | None = None
    create_time: str | None = None


class FeishuEnvelope(_Shape):
    """What the token check reads: a v2.0 header's token, or a v1 / url_verification
    top-level token."""

    type: str | None = None
    token: str | None = None
    challenge: str | None = None
    header: FeishuHeader | None = None


class FeishuUserId(_Shape):
    open_id: str | None = None


class FeishuSender(_Shape):
    sender_id: FeishuUserId | None = None
    sender_type: str | None = None


class FeishuMention(_Shape):
    key: str = ""
    id: FeishuUserId | None = None
    name: str = ""


class FeishuMessage(_Shape):
    message_id: str = Field(min_length=1)
    chat_id: str = Field(min_length=1)
    chat_type: str
    message_type: str
    content: str
    parent_id: str | None = None
    mentions: list[FeishuMention] | None = None

    @field_validator("content")
    @classmethod
    def _content_is_an_object(cls, content: str) -> str:
        # Every message type's content is a JSON object (a text message's has `text`).
        try:
            parsed = orjson.loads(content)
        except orjson.JSONDecodeError:
            raise ValueError("content is not JSON") from None
        if not isinstance(parsed, dict):
            raise ValueError("content is not a JSON object")
        if "text" in parsed and not isinstance(parsed["text"], str):
            raise ValueError("content text is not a string")
        return content


class FeishuMessageEvent(_Shape):
    sender: FeishuSender
    message: FeishuMessage


class FeishuMessageCallback(_Shape):
    header: FeishuHeader
    event: FeishuMessageEvent


def feishu_envelope(data: Any) -> dict[str, Any]:
    """The parts of a Feishu callback its checks read (type, tokens, header), or
    `Malformed`."""
    if not isinstance(data, dict):
        raise Malformed("the event is not a JSON object")
    return _validated(FeishuEnvelope, data, "callback")


def feishu_event(data: dict[str, Any]) -> dict[str, Any]:
    """A checked callback: a message event (`im.message.receive_v1`) with every field the
    adapter reads checked; another event type with its header checked; or `Malformed`."""
    header = _validated(FeishuEnvelope, data, "callback").get("header")
    if header is None:
        raise Malformed("malformed callback: header")
    if header["event_type"] != "im.message.receive_v1":
        return {"header": header}
    return _validated(FeishuMessageCallback, data, "event")
