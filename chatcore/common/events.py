"""Every server frame shape (PROTOCOL "Server frames"), built from plain data or model rows.

The one place frames are shaped (STYLE 4): the engine, services, clientstate and the channels
build them here and hand them to `publish` (or send them to their own client). Pure functions:
nothing here touches the database or the channel layer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import orjson


def message_frame(message: Any) -> dict[str, Any]:
    """A stored message as clients see it (PROTOCOL "Message"); sender ids stay private."""
    data: dict[str, Any] = {
        "id": str(message.id),
        "seq": message.seq,
        "role": message.role,
        "content": message.content,
        "created_at": message.created_at.isoformat(),
        # H1: the message it follows on its branch; `siblings` where that one has several.
        "parent_seq": getattr(message, "parent_seq", None),
    }
    siblings = getattr(message, "siblings", None)
    if siblings:
        data["siblings"] = siblings
    if message.tool_calls:
        data["tool_calls"] = message.tool_calls
    if message.tool_call_id:
        data["tool_call_id"] = message.tool_call_id
    if message.tool_name:
        data["tool_name"] = message.tool_name
    if message.status:
        data["status"] = message.status
    source = {k: v for k, v in (message.source or {}).items() if k != "from_user_id"}
    if source:
        data["source"] = source
    if message.turn_id:
        data["turn_id"] = str(message.turn_id)
    if getattr(message, "media_refs", None):
        # H3: the files a user message carries.
        data["attachments"] = message.media_refs
    return data


def history_delta_frame(
    *, session_id: str, turn_id: str | None, base_revision: int, messages: Iterable[Any]
) -> dict[str, Any]:
    items = [message_frame(m) for m in messages]
    assert items, "a history delta is never empty (D2)"
    return {
        "type": "history_delta",
        "session_id": session_id,
        "turn_id": turn_id,
        "base_revision": base_revision,
        "history_revision": max(item["seq"] for item in items),
        "messages": items,
    }


def turn_updated_frame(
    *,
    session_id: str,
    turn_id: str,
    status: str,
    reason: str = "",
    error: dict[str, str] | None = None,
    client_msg_id: str = "",
    notice: dict[str, str] | None = None,
) -> dict[str, Any]:
    frame: dict[str, Any] = {
        "type": "turn_updated",
        "session_id": session_id,
        "turn_id": turn_id,
        "status": status,
    }
    if reason:
        frame["reason"] = reason
    if error:
        frame["error"] = error
    if notice:
        # E5: a completed answer that is not whole: {kind truncated/filtered/empty, message}.
        frame["notice"] = notice
    if client_msg_id:
        frame["client_msg_id"] = client_msg_id
    return frame


def session_updated_frame(*, session: Any, **changes: Any) -> dict[str, Any]:
    return {
        "type": "session_updated",
        "session_id": session.session_id,
        "dialog_id": session.dialog_id,
        "title": session.title,
        **changes,
    }


def notification_frame(*, session_id: str | None, level: str, content: str) -> dict[str, Any]:
    frame: dict[str, Any] = {"type": "system_notification", "level": level, "content": content}
    if session_id:
        frame["session_id"] = session_id
    return frame


def sessions_changed_frame(*, session_id: str | None = None, change: str) -> dict[str, Any]:
    """Internal: a dialog of the chat was `created`, `deleted` or `restored` (`change`);
    connections answer it by sending their own `sessions` frame."""
    return {"type": "sessions_changed", "session_id": session_id, "change": change}


def turn_snapshot_frame(
    *,
    session_id: str,
    turn_id: str,
    text: str,
    tools: list[dict[str, Any]],
    frame: int,
    text_offset: int = 0,
) -> dict[str, Any]:
    """A running turn's text (D1): the whole text (`text_offset` 0) or the tail after
    `text_offset`; `frame` counts the snapshots of the turn."""
    return {
        "type": "turn_snapshot",
        "session_id": session_id,
        "turn_id": turn_id,
        "status": "running",
        "text_offset": text_offset,
        "text": text,
        "tools": tools,
        "frame": frame,
    }


def queued_frame(
    *, session_id: str, turn_id: str | None, position: int, mode: str, client_msg_id: str = ""
) -> dict[str, Any]:
    """The answer to an accepted send/steer/inject/retry/continue (PROTOCOL `queued`)."""
    return {
        "type": "queued",
        "session_id": session_id,
        "turn_id": turn_id,
        "position": position,
        "client_msg_id": client_msg_id or None,
        "mode": mode,
    }


def session_item(session: Any, *, read_only: bool = False) -> dict[str, Any]:
    """One dialog of a `sessions` frame."""
    return {
        "session_id": session.session_id,
        "dialog_id": session.dialog_id,
        "title": session.title,
        "last_active_at": session.last_active_at.isoformat(),
        "message_count": session.message_count,
        "channel": session.channel,
        "chat_id": session.chat_id,
        "read_only": read_only,
        # H4: the model its turns ask.
        "model": session.effective_model,
    }


def sessions_frame(*, current: Any | None, items: list[dict[str, Any]]) -> dict[str, Any]:
    """PROTOCOL `sessions`: the chat's dialogs (`session_item`s) and the current one."""
    return {
        "type": "sessions",
        "current": current.dialog_id if current is not None else None,
        "current_session_id": current.session_id if current is not None else None,
        "items": items,
    }


def queue_item(turn: Any) -> dict[str, Any]:
    """A queued turn as clients see it (`queue` of `session_history` and the dialog state)."""
    return {
        "turn_id": str(turn.pk),
        "mode": turn.mode,
        "client_msg_id": turn.client_msg_id or None,
        "preview": turn.content[:80],
    }


def session_history_frame(
    *,
    session: Any,
    messages: Iterable[Any],
    has_more: bool,
    active_turn: dict[str, Any] | None,
    queue: list[dict[str, Any]],
) -> dict[str, Any]:
    """PROTOCOL `session_history`: a page of messages, oldest first, with the revision, the
    running turn's snapshot and the queue."""
    return history_page_frame(
        session=session,
        messages=[message_frame(m) for m in messages],
        has_more=has_more,
        active_turn=active_turn,
        queue=queue,
    )


def history_page_frame(
    *,
    session: Any,
    messages: list[dict[str, Any]] | Embedded,
    has_more: bool,
    active_turn: dict[str, Any] | None,
    queue: list[dict[str, Any]],
) -> dict[str, Any]:
    """`session_history` of message frames, or of their JSON made already (`Embedded`: a page
    the process keeps, sent as it is to every socket that opens its dialog)."""
    return {
        "type": "session_history",
        "session_id": session.session_id,
        "dialog_id": session.dialog_id,
        "title": session.title,
        "history_revision": session.last_seq,
        # H1: the last message of the active path these messages end.
        "head_seq": getattr(session, "head_seq", None) or None,
        "messages": messages,
        "has_more": has_more,
        "active_turn": active_turn,
        "queue": queue,
        # H4: the dialog's settings.
        "model": session.effective_model,
        "system_prompt": session.system_prompt,
    }


def resume_delta_frame(
    *,
    session: Any,
    base_revision: int,
    messages: list[dict[str, Any]],
    active_turn: dict[str, Any] | None,
    queue: list[dict[str, Any]],
) -> dict[str, Any]:
    """PROTOCOL "On connect": instead of `session_history`, what a reconnecting client lacks
    after the revision it holds (`base_revision`; no message when nothing came), with the
    running turn (`active_turn`, as in `session_history`), the queue and the dialog's
    settings. Unlike a turn's delta it may be empty, and its `history_revision` is the
    dialog's."""
    return {
        "type": "history_delta",
        "session_id": session.session_id,
        "dialog_id": session.dialog_id,
        "turn_id": None,
        "base_revision": base_revision,
        "history_revision": session.last_seq,
        "messages": messages,
        "active_turn": active_turn,
        "queue": queue,
        "title": session.title,
        "head_seq": getattr(session, "head_seq", None) or None,
        "model": session.effective_model,
        "system_prompt": session.system_prompt,
    }


def path_changed_frame(*, session_id: str, history_revision: int) -> dict[str, Any]:
    """H1, between processes only: the dialog's active path changed (an edit or regenerate
    started, a branch was chosen). Each connection showing the dialog answers its client with
    a fresh `session_history`; clients never receive this frame itself."""
    return {
        "type": "path_changed",
        "session_id": session_id,
        "history_revision": history_revision,
    }


def command_result_frame(
    *, command: str, ok: bool, content: str, client_msg_id: str | None = None
) -> dict[str, Any]:
    """The answer to a slash command (PROTOCOL `command_result`)."""
    return {
        "type": "command_result",
        "client_msg_id": client_msg_id,
        "command": command,
        "ok": ok,
        "content": content,
    }


def search_results_frame(
    *, q: str, items: list[dict[str, Any]], count: int, client_msg_id: str | None = None
) -> dict[str, Any]:
    """The answer to a `search` frame (PROTOCOL "Search, export, import")."""
    return {
        "type": "search_results",
        "client_msg_id": client_msg_id,
        "q": q,
        "items": items,
        "count": count,
    }


def error_frame(
    *,
    code: str,
    message: str,
    client_msg_id: str | None = None,
    retry_after: float | None = None,
) -> dict[str, Any]:
    """A refusal or failure (PROTOCOL `error`); `ChatError.as_dict()` gives code and message."""
    frame: dict[str, Any] = {
        "type": "error",
        "client_msg_id": client_msg_id,
        "code": code,
        "message": message,
    }
    if retry_after is not None:
        frame["retry_after"] = round(retry_after, 1)
    return frame


def error_frame_of(exc: Any, client_msg_id: str | None = None) -> dict[str, Any]:
    """The `error` frame of a domain error (`ChatError`): its code, message and Retry-After."""
    return error_frame(
        **exc.as_dict(), client_msg_id=client_msg_id, retry_after=getattr(exc, "retry_after", None)
    )


def login_ended_frame(message: str) -> dict[str, Any]:
    """F8: the last frame of a Server-Sent Events stream whose login ended."""
    return {"type": "error", "code": "unauthorized", "message": message}


class Embedded:
    """A part of a frame as its JSON text, made once and written into every frame that holds
    it as it is (`frame_text`): a history page the process sends to many sockets. What
    orjson refuses is kept as it is and written with the rest of its frame."""

    __slots__ = ("json", "raw")

    def __init__(self, value: Any) -> None:
        self.raw: Any = None
        self.json: bytes | None = None
        try:
            self.json = orjson.dumps(value, default=str, option=_FRAME_OPTIONS)
        except TypeError:
            self.raw = value

    def __len__(self) -> int:
        return len(self.json) if self.json is not None else 0


# Datetimes and dataclasses go to `default` (`str`), as the json module's `default=str` has them;
# orjson would write its own forms of them.
_FRAME_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS


def _to_orjson(value: Any) -> Any:
    if isinstance(value, Embedded):
        return orjson.Fragment(value.json) if value.json is not None else value.raw
    return str(value)


def _to_json(value: Any) -> Any:
    if isinstance(value, Embedded):
        return json.loads(value.json) if value.json is not None else value.raw
    return str(value)


def frame_text(frame: dict[str, Any]) -> str:
    """The JSON text of a frame as a socket sends it: compact, non-ASCII as it is, anything
    else through `str`. Encoded in C (every snapshot of every stream passes here); what orjson
    refuses and the json module writes (keys that are not strings, integers past 64 bits,
    strings holding lone surrogates) is written by the json module, as before. Two forms
    differ: a float's exponent has no padding zero (`1.5e-7`, the same number), and a plain
    `Enum` would be written as its value, not as its name (frames hold none: their enums are
    `StrEnum`s and choices, which both modules write as their value)."""
    try:
        return orjson.dumps(frame, default=_to_orjson, option=_FRAME_OPTIONS).decode()
    except TypeError:
        return json.dumps(frame, ensure_ascii=False, separators=(",", ":"), default=_to_json)
