"""What a client reads about its chat: the `sessions` and `session_history` frames, the dialog
state the API returns, and the per-connection snapshot relay (D1, D2, D3).

Every channel (WebSocket consumer, SSE stream, terminal) uses these, so all clients of a chat
see the same state in the same shapes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from channels.layers import get_channel_layer

from chatcore.common import events, publish
from sessions_app import branches, connect_reads, selectors, usage
from sessions_app.models import Session, Turn, TurnStatus

from .lists import SessionList
from .turns.outcome import present_notice

if TYPE_CHECKING:
    from .snapshots import LocalTurn


class RunsTurns(Protocol):
    """What these readers ask of the engine (`engine.Engine`): the turns this process runs,
    whose text is newer than any checkpoint."""

    @property
    def local(self) -> Mapping[str, LocalTurn]: ...


logger = logging.getLogger(__name__)

# Snapshot tails this process's connections found missing (a layer at capacity drops frames
# silently); reported by /healthz. Each one is answered with a full snapshot, never silence.
_snapshot_gaps = 0


def snapshot_gaps() -> int:
    return _snapshot_gaps


def sessions_frame(
    *,
    owner_id: int,
    channel: str,
    chat_id: str,
    current: Session | None,
    limit: int = 50,
    linked: bool = False,
) -> dict[str, Any]:
    """PROTOCOL `sessions`: the chat's live dialogs, most recently active first; with
    `linked`, then the user's other dialogs (their API and terminal dialogs, and the chat-app
    dialogs linked to them, A1), each with its `channel`, `chat_id` and whether it is
    `read_only` for them."""
    items = [
        events.session_item(s)
        for s in selectors.dialog_list_for_chat(
            owner_id=owner_id, channel=channel, chat_id=chat_id, limit=limit
        )
    ]
    if linked:
        items += [
            events.session_item(s, read_only=read_only)
            for s, read_only in selectors.linked_dialogs_for_user(
                user_id=owner_id, limit=limit, besides=(channel, chat_id)
            )
        ]
    return events.sessions_frame(current=current, items=items)


def sessions_listing(
    *, owner_id: int, channel: str, chat_id: str, others: Iterable[str], limit: int = 50
) -> SessionList:
    """`sessions_frame`'s list with what a socket needs besides (`lists.SessionList`): the
    chat's dialogs, then the user's other ones (`linked`), and the groups of those other
    chats and of the user's own chats of the channels `others` (API, terminal)."""
    web, linked = connect_reads.dialogs_listed(
        owner_id=owner_id, channel=channel, chat_id=chat_id, limit=limit
    )
    items = [events.session_item(s) for s in web]
    items += [events.session_item(s, read_only=read_only) for s, read_only in linked]
    groups = {publish.chat_group(s.channel, s.chat_id) for s, _read_only in linked}
    groups |= {publish.chat_group(other, chat_id) for other in others}
    return SessionList(items, web, frozenset(groups))


def active_turn(session: Session, engine: RunsTurns | None) -> dict[str, Any] | None:
    """The running turn's snapshot with the full text so far (`text_offset` 0): from this
    process's engine when it runs the turn, else from the turn's last checkpoint (C11)."""
    running = selectors.turn_running(session_pk=session.pk)
    return snapshot_of(session, running, engine.local if engine is not None else None)


def snapshot_of(
    session: Session, running: Turn | None, local_turns: Mapping[str, LocalTurn] | None
) -> dict[str, Any] | None:
    """`active_turn` of a running turn read already (`local_turns`: the turns this process
    runs, whose text is newer than any checkpoint)."""
    if running is None:
        return None
    if local_turns is not None:
        local = local_turns.get(str(running.pk))
        if local is not None:
            snap = local.snapshot
            return events.turn_snapshot_frame(
                session_id=session.session_id,
                turn_id=str(running.pk),
                text=snap.text,
                tools=snap.tools_dicts(),
                frame=local.frame,
            )
    return events.turn_snapshot_frame(
        session_id=session.session_id,
        turn_id=str(running.pk),
        text=running.partial_text,
        tools=[],
        frame=0,
    )


def queue_items(session: Session) -> list[dict[str, Any]]:
    return [events.queue_item(t) for t in selectors.turn_queue(session_pk=session.pk)]


def session_history_frame(
    *,
    session: Session,
    engine: RunsTurns | None,
    before_seq: int | None = None,
    limit: int = selectors.HISTORY_PAGE_DEFAULT,
) -> dict[str, Any]:
    """PROTOCOL `session_history`: the most recent page (older than `before_seq` when
    given), oldest first, with the revision, the running turn and the queue."""
    fresh = Session.objects.get(pk=session.pk)
    messages, has_more = selectors.messages_page(
        session_pk=session.pk, before_seq=before_seq, limit=limit, session=fresh
    )
    return events.session_history_frame(
        session=fresh,
        messages=messages,
        has_more=has_more,
        active_turn=active_turn(fresh, engine),
        queue=queue_items(fresh),
    )


def session_state(
    session: Session, engine: RunsTurns | None, used: dict[str, int] | None = None
) -> dict[str, Any]:
    """A dialog as the REST API returns it; `used`: its usage totals, when read already (a
    page of dialogs reads them in one query)."""
    snapshot = active_turn(session, engine)
    return {
        "session_id": session.session_id,
        "channel": session.channel,
        "chat_id": session.chat_id,
        "dialog_id": session.dialog_id,
        "title": session.title,
        "created_at": session.created_at.isoformat(),
        "last_active_at": session.last_active_at.isoformat(),
        "message_count": session.message_count,
        "total_message_count": session.total_message_count,
        "history_revision": session.last_seq,
        "head_seq": session.head_seq or None,
        "status": "running" if snapshot is not None else "idle",
        "active_turn": snapshot,
        "queue": queue_items(session),
        # H4: the dialog's settings and what its turns used.
        "model": session.effective_model,
        "system_prompt": session.system_prompt,
        "usage": used if used is not None else usage.session_usage(session_pk=session.pk),
    }


def turn_state(turn: Turn) -> dict[str, Any]:
    """A turn as the REST API returns it: status, reason, error and its committed messages."""
    error = None
    if turn.status == TurnStatus.FAILED:
        error = {"kind": turn.error_kind, "message": turn.error_message}
    notice = None
    if turn.status == TurnStatus.COMPLETED and turn.reason:
        # E5: the words for a cut or withheld answer, as its `turn_updated` carried them.
        notice = {"kind": turn.reason, "message": present_notice(turn.reason)}
    messages = list(turn.messages.order_by("seq"))
    branches.mark_siblings(turn.session, messages)  # H1: a version shows its siblings
    return {
        "turn_id": str(turn.pk),
        "session_id": turn.session.session_id,
        "status": turn.status,
        "mode": turn.mode,
        "reason": turn.reason or None,
        "error": error,
        "notice": notice,
        "client_msg_id": turn.client_msg_id or None,
        "messages": [events.message_frame(m) for m in messages],
        # H4: the model it asked and what that model reported.
        "model": turn.model or None,
        "usage": usage.usage_of(turn.usage),
    }


# --- Snapshot relay (D1) ------------------------------------------------------------------


@dataclass
class SnapshotRelay:
    """Per connection: what text of each running turn the client already has, so each frame
    it receives applies contiguously (`known[:text_offset] + text`). A frame past what the
    client has (it joined mid-turn, or missed one) is held back and the turn's process is
    asked once for a full snapshot (offset 0), which replaces the client's text."""

    known: dict[str, int] = field(default_factory=dict)
    asked: set[str] = field(default_factory=set)

    def seed(self, snapshot: dict[str, Any] | None) -> None:
        if snapshot is not None:
            self.known[snapshot["turn_id"]] = len(snapshot["text"])

    def forget(self, turn_id: str) -> None:
        self.known.pop(turn_id, None)
        self.asked.discard(turn_id)

    def reset(self) -> None:
        self.known.clear()
        self.asked.clear()

    def relay(self, frame: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
        """Returns (frame to send or None, whether to ask for a full snapshot)."""
        turn_id = frame["turn_id"]
        offset = frame["text_offset"]
        text = frame["text"]
        known = self.known.get(turn_id)
        if offset == 0:
            self.known[turn_id] = len(text)
            self.asked.discard(turn_id)
            return frame, False
        if known is None or offset > known:
            if known is not None:
                _count_gap(turn_id, known, offset)
            ask = turn_id not in self.asked
            self.asked.add(turn_id)
            return None, ask
        end = offset + len(text)
        if offset < known:
            frame = {**frame, "text_offset": known, "text": text[known - offset :]}
        self.known[turn_id] = max(known, end)
        return frame, False


def _count_gap(turn_id: str, known: int, offset: int) -> None:
    global _snapshot_gaps
    _snapshot_gaps += 1
    logger.warning(
        "snapshot tail missing (client has %d characters, frame starts at %d); "
        "asking for a full snapshot",
        known,
        offset,
        extra={"turn_id": turn_id},
    )


async def request_full_snapshot(turn_id: str, reply_channel: str) -> None:
    """Ask whichever process runs the turn to send its full snapshot to `reply_channel`."""
    layer = get_channel_layer()
    if layer is None:
        return
    await layer.group_send(
        publish.engine_control_group(),
        {"type": "engine.snapshot_request", "turn_id": turn_id, "reply_channel": reply_channel},
    )


def is_terminal_frame(frame: dict[str, Any]) -> bool:
    return frame.get("type") == "turn_updated" and frame.get("status") in (
        TurnStatus.COMPLETED,
        TurnStatus.CANCELLED,
        TurnStatus.FAILED,
    )
