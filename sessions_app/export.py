"""Export of one dialog (SPEC H2, PROTOCOL "Search, export, import"): `chatcore.dialog.v1`
JSON (every message with its parent) and Markdown (the active path), streamed.

The body is an async iterator that reads the messages a page at a time (by seq, on a
database thread), so memory holds one page, not the dialog, whatever its length: Django
consumes a synchronous iterator whole before an ASGI response starts, an async one chunk by
chunk. The format is documented in README ("Export and import").
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import datetime
from typing import Any

from django.utils import timezone
from django.utils.translation import gettext as _

from chatcore.common.dbthreads import on_db_idempotent

from . import branches
from .models import Message, MessageKind, Session

FORMAT = "chatcore.dialog.v1"
PAGE = 500
TOOL_PREVIEW_CHARS = 200


# --- The tree ------------------------------------------------------------------------------


class Lineage:
    """Which message each one follows, and the head of the active path: the one place that
    knows how a dialog's branches are stored (H1: each message's own `parent_seq`, the
    dialog's `head_seq`; `branches` walks them)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def parent_of(self, message: Message) -> int | None:
        return message.parent_seq

    def head_seq(self) -> int | None:
        return self.session.head_seq or None


def _pages(session_pk: str) -> Callable[[int], list[Message]]:
    def page(after_seq: int) -> list[Message]:
        return list(
            Message.objects.filter(session_id=session_pk, seq__gt=after_seq).order_by("seq")[:PAGE]
        )

    return page


async def _messages(session_pk: str) -> AsyncIterator[Message]:
    read = on_db_idempotent(_pages(session_pk))
    after = 0
    while True:
        batch = await read(after)
        for message in batch:
            yield message
        if len(batch) < PAGE:
            return
        after = batch[-1].seq


async def _active_path(session: Session) -> AsyncIterator[Message]:
    """The messages of the active path, oldest first (H1): a dialog that never forked is all
    its messages; a forked one's path is walked once, then read a page at a time."""
    if not session.forked:
        async for message in _messages(str(session.pk)):
            yield message
        return
    seqs = await on_db_idempotent(branches.active_path)(session) or []
    for start in range(0, len(seqs), PAGE):
        chunk = seqs[start : start + PAGE]
        for message in await on_db_idempotent(branches.path_messages)(chunk, str(session.pk)):
            yield message


# --- JSON ----------------------------------------------------------------------------------


def message_document(message: Message, parent_seq: int | None) -> dict[str, Any]:
    item: dict[str, Any] = {
        "seq": message.seq,
        "parent_seq": parent_seq,
        "role": message.role,
        "content": message.content,
        "created_at": message.created_at.isoformat(),
    }
    if message.kind:
        item["kind"] = message.kind
    if message.status:
        item["status"] = message.status
    if message.tool_calls:
        item["tool_calls"] = message.tool_calls
    if message.tool_call_id:
        item["tool_call_id"] = message.tool_call_id
    if message.tool_name:
        item["tool_name"] = message.tool_name
    if message.media_refs:
        item["attachments"] = message.media_refs
    return item


async def json_chunks(session: Session) -> AsyncIterator[bytes]:
    """The document, a page of messages per chunk."""
    head = {
        "format": FORMAT,
        "title": session.title,
        "created_at": session.created_at.isoformat(),
        "session_id": session.session_id,
    }
    yield (json.dumps(head, ensure_ascii=False)[:-1] + ', "messages": [').encode()
    lineage = Lineage(session)
    first = True
    buffer: list[str] = []
    async for message in _messages(str(session.pk)):
        text = json.dumps(message_document(message, lineage.parent_of(message)), ensure_ascii=False)
        buffer.append(text if first else "," + text)
        first = False
        if len(buffer) >= 100:
            yield "".join(buffer).encode()
            buffer = []
    buffer.append(f'], "head_seq": {json.dumps(lineage.head_seq())}}}')
    yield "".join(buffer).encode()


# --- Markdown ------------------------------------------------------------------------------


def _when(value: datetime) -> str:
    return value.strftime("%Y-%m-%d %H:%M UTC")


def _brief(text: str, limit: int = TOOL_PREVIEW_CHARS) -> str:
    one_line = " ".join(text.split())
    return one_line if len(one_line) <= limit else one_line[: limit - 1] + "…"


def _quote(text: str) -> str:
    return "\n".join("> " + line if line else ">" for line in text.splitlines() or [""])


def tool_calls_markdown(calls: Iterable[dict[str, Any]]) -> list[str]:
    lines = []
    for call in calls:
        function = call.get("function") or {}
        name = str(function.get("name") or call.get("name") or "tool")
        arguments = str(function.get("arguments") or "")
        lines.append(f"> 🔧 `{name}` {_brief(arguments)}".rstrip())
    return lines


def message_markdown(message: Message) -> str:
    """One message as Markdown; welcome notes are left out (an empty string)."""
    if message.kind == MessageKind.WELCOME:
        return ""
    who = {
        "user": _("You"),
        "assistant": _("Assistant"),
        "tool": _("Tool"),
        "system": _("System"),
    }.get(message.role, message.role)
    if message.role == "tool":
        name = message.tool_name or "tool"
        result = _("Result of %(name)s") % {"name": name}
        return f"> ↩ {result}: {_brief(message.content)}\n\n"
    parts = [f"### {who} · {_when(message.created_at)}", ""]
    if message.content:
        parts += [message.content, ""]
    if message.tool_calls:
        parts += [*tool_calls_markdown(message.tool_calls), ""]
    if message.status:
        parts += [f"*({message.status})*", ""]
    return "\n".join(parts) + "\n"


async def markdown_chunks(session: Session) -> AsyncIterator[bytes]:
    """The active path, readable: a heading per message, tool calls in one line each."""
    yield (
        f"# {session.title}\n\n"
        + _("Exported from %(session)s on %(when)s.")
        % {"session": session.session_id, "when": _when(timezone.now())}
        + "\n\n"
    ).encode()
    buffer: list[str] = []
    async for message in _active_path(session):
        buffer.append(message_markdown(message))
        if len(buffer) >= 100:
            yield "".join(buffer).encode()
            buffer = []
    if buffer:
        yield "".join(buffer).encode()


def filename(session: Session, extension: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_ " else "_" for c in session.title).strip()
    return f"{(safe or session.dialog_id)[:80]}.{extension}"
