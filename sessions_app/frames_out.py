"""Server frames the channels build themselves (PROTOCOL "WebSocket: /ws/chat/"): a command's
`command_result` and a domain error's `error` frame. Every other frame comes from the
engine's publisher (STYLE 4, 9)."""

from __future__ import annotations

from typing import Any

from django.utils.translation import gettext as _

from chatcore.engine.errors import ChatError


def error_frame(exc: ChatError, client_msg_id: str | None) -> dict[str, Any]:
    """The one place a domain error becomes a WebSocket `error` frame (STYLE 9)."""
    frame: dict[str, Any] = {"type": "error", "client_msg_id": client_msg_id, **exc.as_dict()}
    if exc.retry_after is not None:
        frame["retry_after"] = round(exc.retry_after, 1)
    return frame


def command_result_frame(
    *, client_msg_id: str | None, command: str, ok: bool, content: str
) -> dict[str, Any]:
    """B3: the one reply of a slash command."""
    return {
        "type": "command_result",
        "client_msg_id": client_msg_id,
        "command": command,
        "ok": ok,
        "content": content,
    }


def login_ended_frame() -> dict[str, Any]:
    """F8: the last frame of a Server-Sent Events stream whose login ended."""
    return {
        "type": "error",
        "code": "unauthorized",
        "message": _("Your login ended: sign in again."),
    }
