"""Helpers of the search, export, import and share tests (SPEC H2): dialogs with a given
history, written through the real services."""

from __future__ import annotations

from typing import Any

from chatcore.common.ids import owner_chat_id
from sessions_app import services
from sessions_app.models import MessageKind, Session

KINDS = {
    "user": MessageKind.USER_INPUT,
    "assistant": MessageKind.ASSISTANT,
    "tool": MessageKind.TOOL_RESULT,
    "system": MessageKind.WELCOME,
}


def dialog_with(user: Any, *texts: str | tuple[str, str], title: str | None = None) -> Session:
    """A web dialog of `user` (after its welcome message): each text alternates user and
    assistant unless given as (role, text)."""
    session = services.session_create(
        owner=user, channel="web", chat_id=owner_chat_id(user.pk), title=title
    )
    news = []
    for i, item in enumerate(texts):
        role, text = (
            item if isinstance(item, tuple) else ("user" if i % 2 == 0 else "assistant", item)
        )
        news.append(services.NewMessage(role=role, content=text, kind=KINDS[role]))
    if news:
        services.messages_append(session_pk=session.pk, messages=news, publish_delta=False)
    session.refresh_from_db()
    return session
