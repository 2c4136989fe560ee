"""The only place that sends events to clients (STYLE 3, 4).

It owns the group names and the shapes of every server frame. Two groups matter:
- the chat group: every connection of a chat hears history deltas, terminals,
  `session_updated`, `sessions_changed` and notifications of every dialog (D2, D3);
- the session group: connections whose current dialog it is hear its snapshots (D1).
Events travel on the channel layer as `{"type": "chat.event", "frame": {...}}`; consumers and
SSE streams relay `frame` as it is.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import Iterable
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

logger = logging.getLogger(__name__)

EVENT_TYPE = "chat.event"

_loop_lock = threading.Lock()
_engine_loop: asyncio.AbstractEventLoop | None = None


def chat_group(channel: str, chat_id: str) -> str:
    digest = hashlib.sha1(f"{channel}:{chat_id}".encode(), usedforsecurity=False).hexdigest()
    return f"chat.{digest[:32]}"


def session_group(session_pk: str) -> str:
    return f"sess.{session_pk}"


def engine_control_group() -> str:
    return "engine.control"


def bind_loop(loop: asyncio.AbstractEventLoop | None) -> None:
    """Tell sync callers which loop owns the channel layer in this process."""
    global _engine_loop
    with _loop_lock:
        _engine_loop = loop


# --- Frame shapes -------------------------------------------------------------------------


def message_frame(message: Any) -> dict[str, Any]:
    """A stored message as clients see it (PROTOCOL "Message"); sender ids stay private."""
    data: dict[str, Any] = {
        "id": str(message.id),
        "seq": message.seq,
        "role": message.role,
        "content": message.content,
        "created_at": message.created_at.isoformat(),
    }
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


def sessions_changed_frame(*, session_id: str | None = None) -> dict[str, Any]:
    """Internal: a dialog of the chat was created, deleted or restored; connections answer it
    by sending their own `sessions` frame."""
    return {"type": "sessions_changed", "session_id": session_id}


# --- Sending ------------------------------------------------------------------------------


async def apublish(group: str, frame: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        await layer.group_send(group, {"type": EVENT_TYPE, "frame": frame})
    except Exception:
        # C3: a failing listener never fails the turn.
        logger.exception("publish to %s failed", group)


def publish(group: str, frame: dict[str, Any]) -> None:
    """Send from sync code: hand over to the engine loop when there is one, else run here."""
    loop = _engine_loop
    if loop is not None and loop.is_running():
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.create_task(apublish(group, frame))
            return
        future = asyncio.run_coroutine_threadsafe(apublish(group, frame), loop)
        try:
            future.result(timeout=5)
        except Exception:
            logger.warning("publish to %s timed out", group)
        return
    async_to_sync(apublish)(group, frame)


def publish_to_chat(session: Any, frame: dict[str, Any]) -> None:
    publish(chat_group(session.channel, session.chat_id), frame)


def publish_to_session(session_pk: str, frame: dict[str, Any]) -> None:
    publish(session_group(session_pk), frame)
