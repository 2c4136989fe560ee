"""Session resolution (B1, B2) and the in-memory session state of this process (A5, A6).

The database is the source of truth. The state kept here is a read-through cache of each
dialog's history, validated against the dialog's revision (`last_seq`) and generation on every
use, so several processes can share one database. It changes only after a write succeeded
(A4), serves as the fallback when a read fails, and is evicted after the TTL unless the dialog
has a running or queued turn (A6).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from django.conf import settings
from django.contrib.auth.models import User
from django.db import DatabaseError

from sessions_app import selectors, services
from sessions_app.models import Message, Session

from .errors import NotFound
from .ids import validate_part

logger = logging.getLogger(__name__)


def resolve_dialog(
    *,
    owner: User,
    channel: str,
    chat_id: str,
    dialog_id: str | None = None,
    create: bool = False,
) -> Session:
    """B1: the named dialog; without a name, the most recently active live dialog of the chat
    within the TTL, else a new dialog (which gets its welcome message, B2)."""
    if dialog_id is not None:
        validate_part(dialog_id, field="dialog_id")
        try:
            return selectors.dialog_get(
                owner_id=owner.pk, channel=channel, chat_id=chat_id, dialog_id=dialog_id
            )
        except NotFound:
            if not create:
                raise
            return services.session_create(
                owner=owner, channel=channel, chat_id=chat_id, dialog_id=dialog_id
            )
    recent = selectors.dialog_most_recent_live(owner_id=owner.pk, channel=channel, chat_id=chat_id)
    if recent is not None:
        return recent
    return services.session_create(owner=owner, channel=channel, chat_id=chat_id)


def dialog_after_delete(*, owner: User, channel: str, chat_id: str) -> Session:
    """The dialog that becomes current after `/delete`: the most recent live one, else new."""
    remaining = selectors.dialog_list_for_chat(
        owner_id=owner.pk, channel=channel, chat_id=chat_id, limit=1
    )
    if remaining:
        return remaining[0]
    return services.session_create(owner=owner, channel=channel, chat_id=chat_id)


@dataclass
class SessionState:
    pk: str
    generation: int
    last_seq: int
    messages: list[Message] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)


class SessionStates:
    """The per-process cache of dialog histories (A5, A6)."""

    def __init__(self) -> None:
        self._states: dict[str, SessionState] = {}
        self._lock = threading.Lock()

    def __contains__(self, session_pk: str) -> bool:
        return session_pk in self._states

    def __len__(self) -> int:
        return len(self._states)

    def history(self, session: Session) -> list[Message]:
        """The dialog's stored history, loading only what this process has not seen (A5)."""
        with self._lock:
            state = self._states.get(session.pk)
        try:
            if state is None or state.generation != session.generation:
                rows = selectors.messages_for_context(session_pk=session.pk)
                state = SessionState(
                    pk=session.pk,
                    generation=session.generation,
                    last_seq=session.last_seq,
                    messages=rows,
                )
            elif session.last_seq > state.last_seq:
                # Only ever move forward: a session row older than the cache loads nothing.
                rows = selectors.messages_for_context(
                    session_pk=session.pk, after_seq=state.last_seq
                )
                state.messages = state.messages + rows
                state.last_seq = session.last_seq
        except DatabaseError:
            if state is None:
                raise
            # A4: a failed read falls back to what this process already holds.
            logger.warning(
                "history read failed; using in-memory state", extra={"session_id": session.pk}
            )
        state.last_used = time.monotonic()
        with self._lock:
            self._states[session.pk] = state
        return list(state.messages)

    def apply_appended(self, appended: services.Appended) -> None:
        """Record messages after their write succeeded (A4): never before."""
        with self._lock:
            state = self._states.get(appended.session.pk)
            if state is None:
                return
            if (
                state.generation == appended.session.generation
                and state.last_seq == appended.base_revision
            ):
                state.messages = state.messages + appended.messages
                state.last_seq = appended.revision
                state.last_used = time.monotonic()
            else:
                # Another process wrote in between; reload lazily on next use.
                del self._states[appended.session.pk]

    def forget(self, session_pk: str) -> None:
        with self._lock:
            self._states.pop(session_pk, None)

    def evict_expired(self, *, busy: set[str], now: float | None = None) -> int:
        """Drop states unused for the TTL, never one with a running or queued turn (A6)."""
        ttl = settings.CHAT["SESSION_TTL_SECONDS"]
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [
                pk
                for pk, state in self._states.items()
                if now - state.last_used >= ttl and pk not in busy
            ]
            for pk in expired:
                del self._states[pk]
        if expired:
            logger.info("evicted %d idle session states", len(expired))
        return len(expired)
