"""Session resolution (B1, B2) and the in-memory session state of this process (A5, A6).

The database is the source of truth. The state kept here is a read-through cache of each
dialog's history, validated against the dialog's revision (`last_seq`) and generation on every
use, so several processes can share one database. It changes only after a write succeeded
(A4), serves as the fallback when a read fails, and is evicted after the TTL unless the dialog
has a running or queued turn (A6). It holds only what follows a dialog's last compaction and
stays within a byte budget, least recently used dialogs first out (F7).
"""

from __future__ import annotations

import bisect
import logging
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from django.conf import settings
from django.contrib.auth.models import User
from django.db import DatabaseError

from chatcore.common.errors import NotFound
from chatcore.common.ids import validate_part
from sessions_app import selectors, services
from sessions_app.models import Message, Session

logger = logging.getLogger(__name__)


def resolve_dialog(
    *,
    owner: User,
    channel: str,
    chat_id: str,
    dialog_id: str | None = None,
    create: bool = False,
    states: SessionStates | None = None,
) -> Session:
    """B1: the named dialog; without a name, the most recently active live dialog of the chat
    within the TTL, else a new dialog (which gets its welcome message, B2). `states`: this
    process's histories, which a dialog created here joins (`dialog_create`)."""
    if dialog_id is not None:
        validate_part(dialog_id, field="dialog_id")
        try:
            return selectors.dialog_get(
                owner_id=owner.pk, channel=channel, chat_id=chat_id, dialog_id=dialog_id
            )
        except NotFound:
            if not create:
                raise
            return dialog_create(
                owner=owner, channel=channel, chat_id=chat_id, dialog_id=dialog_id, states=states
            )
    recent = selectors.dialog_most_recent_live(owner_id=owner.pk, channel=channel, chat_id=chat_id)
    if recent is not None:
        return recent
    return dialog_create(owner=owner, channel=channel, chat_id=chat_id, states=states)


def dialog_create(
    *,
    owner: User,
    channel: str,
    chat_id: str,
    dialog_id: str | None = None,
    title: str | None = None,
    states: SessionStates | None = None,
    model: str = "",
) -> Session:
    """A new dialog (B2, `services.session_create`), held in `states` from its start: its
    first turn reads none of its history (G6; in a burst of new dialogs' first sends, that
    read was a round trip each on the database threads before their first tokens).
    `model`: the dialog's model (H4; "" = the default)."""
    session, messages = services.session_create_with_history(
        owner=owner, channel=channel, chat_id=chat_id, dialog_id=dialog_id, title=title, model=model
    )
    if states is not None:
        states.adopt_created(session, messages)
    return session


def dialog_after_delete(
    *, owner: User, channel: str, chat_id: str, states: SessionStates | None = None
) -> Session:
    """The dialog that becomes current after `/delete`: the most recent live one, else new."""
    remaining = selectors.dialog_list_for_chat(
        owner_id=owner.pk, channel=channel, chat_id=chat_id, limit=1
    )
    if remaining:
        return remaining[0]
    return dialog_create(owner=owner, channel=channel, chat_id=chat_id, states=states)


def message_bytes(message: Message) -> int:
    """What a cached message costs in memory, roughly: its text, once more for the JSON of
    its model form (kept once built, `turns.builder`), plus the model instance."""
    size = 2 * sys.getsizeof(message.content) + MESSAGE_OVERHEAD_BYTES
    if message.tool_calls:
        size += len(str(message.tool_calls))
    for ref in message.media_refs or ():
        # H3: an attachment's part of the model form: base64 in it and again in its JSON.
        size += int(ref.get("size", 0)) * 8 // 3
    return size


# A loaded Message instance (its __dict__, source, ids) beside its text.
MESSAGE_OVERHEAD_BYTES = 1024


def _seq(message: Message) -> int:
    return message.seq


def _through(rows: list[Message], seq: int) -> list[Message]:
    """The rows up to `seq`: a state holds exactly what its `last_seq` says, never a message
    committed during its read (which the append's own `apply_appended` brings, or the next
    read)."""
    return rows if not rows or rows[-1].seq <= seq else [m for m in rows if m.seq <= seq]


@dataclass
class SessionState:
    pk: str
    generation: int
    last_seq: int
    # F7: only history after the last compaction is cached (messages with seq > base_seq).
    base_seq: int = 0
    messages: list[Message] = field(default_factory=list)
    size: int = 0
    last_used: float = field(default_factory=time.monotonic)

    def set_messages(self, messages: list[Message]) -> None:
        self.messages = messages
        self.size = sum(message_bytes(m) for m in messages)

    def extend(self, messages: list[Message]) -> None:
        self.messages = self.messages + messages
        self.size += sum(message_bytes(m) for m in messages)

    def drop_through(self, seq: int) -> None:
        """Forget what a newer compaction covers (messages are ordered by seq)."""
        cut = bisect.bisect_right(self.messages, seq, key=_seq)
        if cut:
            self.size -= sum(message_bytes(m) for m in self.messages[:cut])
            self.messages = self.messages[cut:]
        self.base_seq = seq


class SessionStates:
    """The per-process cache of dialog histories (A5, A6), least recently used first out
    when it holds more than `max_bytes` (F7)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self._states: OrderedDict[str, SessionState] = OrderedDict()
        self._lock = threading.Lock()
        # Appends committed while `history_through` reads a dialog this process holds nothing
        # of, one list per read: kept so the state the read leaves does not start behind.
        self._reads: dict[str, list[list[services.Appended]]] = {}
        self._max_bytes = max_bytes

    @property
    def max_bytes(self) -> int:
        if self._max_bytes is not None:
            return self._max_bytes
        return int(settings.CHAT["HISTORY_CACHE_MAX_BYTES"])

    def __contains__(self, session_pk: str) -> bool:
        return session_pk in self._states

    def __len__(self) -> int:
        return len(self._states)

    @property
    def size(self) -> int:
        """Bytes held, roughly (the sum of `message_bytes`)."""
        with self._lock:
            return sum(state.size for state in self._states.values())

    def history(self, session: Session, *, after_seq: int = 0) -> list[Message]:
        """The dialog's stored history after `after_seq` (the last compaction's end), loading
        only what this process has not seen (A5)."""
        with self._lock:
            state = self._states.get(session.pk)
        try:
            if (
                state is None
                or state.generation != session.generation
                or state.base_seq > after_seq
            ):
                rows = _through(
                    selectors.messages_for_context(session_pk=session.pk, after_seq=after_seq),
                    session.last_seq,
                )
                state = SessionState(
                    pk=session.pk,
                    generation=session.generation,
                    last_seq=session.last_seq,
                    base_seq=after_seq,
                )
                state.set_messages(rows)
            else:
                if state.base_seq < after_seq:
                    state.drop_through(after_seq)
                if session.last_seq > state.last_seq:
                    # Only ever move forward: a session row older than the cache loads nothing.
                    rows = selectors.messages_for_context(
                        session_pk=session.pk, after_seq=max(state.last_seq, after_seq)
                    )
                    state.extend(_through(rows, session.last_seq))
                    state.last_seq = session.last_seq
        except DatabaseError:
            if state is None:
                raise
            # A4: a failed read falls back to what this process already holds.
            logger.warning(
                "history read failed; using in-memory state", extra={"session_id": session.pk}
            )
        state.last_used = time.monotonic()
        # Messages are in seq order: the window is a slice, not a walk of the dialog.
        messages = state.messages[bisect.bisect_right(state.messages, after_seq, key=_seq) :]
        with self._lock:
            self._states[session.pk] = state
            self._states.move_to_end(session.pk)
            self._enforce_budget()
        return messages

    def held(self, session: Session) -> SessionState | None:
        """The dialog's state when this process holds it as `session` shows it (the same
        generation and revision), without any read; else None."""
        with self._lock:
            state = self._states.get(session.pk)
        if (
            state is None
            or state.generation != session.generation
            or state.last_seq != session.last_seq
        ):
            return None
        return state

    def history_through(
        self, session: Session, *, after_seq: int, through_seq: int
    ) -> list[Message]:
        """The stored history after `after_seq` through `through_seq`, for a build made while
        the transaction that appends after `through_seq` is still open (G6): as this process
        holds it, changing nothing; else read, and kept as the dialog's state through
        `through_seq` only when the process holds none (the append, once committed, extends
        it, `apply_appended`, or, when it commits during the read, the state is extended by
        it as it is stored)."""
        missed: list[services.Appended] = []
        with self._lock:
            state = self._states.get(session.pk)
            if state is None:
                self._reads.setdefault(session.pk, []).append(missed)
        if (
            state is not None
            and state.generation == session.generation
            and state.base_seq <= after_seq
            and state.last_seq >= through_seq
        ):
            messages = state.messages  # replaced by every change, never changed in place
            return messages[
                bisect.bisect_right(messages, after_seq, key=_seq) : bisect.bisect_right(
                    messages, through_seq, key=_seq
                )
            ]
        try:
            rows = _through(
                selectors.messages_for_context(session_pk=session.pk, after_seq=after_seq),
                through_seq,
            )
        except BaseException:
            if state is None:
                with self._lock:
                    self._unwatch(session.pk, missed)
            raise
        if state is None:
            read = SessionState(
                pk=session.pk,
                generation=session.generation,
                last_seq=through_seq,
                base_seq=after_seq,
            )
            read.set_messages(rows)
            with self._lock:
                # In one hold of the lock: no append lands between the last one kept beside
                # the read and the state it leaves.
                self._unwatch(session.pk, missed)
                if session.pk not in self._states:
                    self._catch_up(read, missed)
                    self._states[session.pk] = read
                    self._enforce_budget()
        return rows

    @staticmethod
    def _catch_up(read: SessionState, missed: list[services.Appended]) -> None:
        """Extend `read` by the appends committed during it, in order, up to one that does
        not follow on (another process wrote between: the next `history` reads from there)."""
        for appended in missed:
            if appended.revision <= read.last_seq:
                continue  # already read
            if (
                appended.session.generation != read.generation
                or appended.base_revision != read.last_seq
            ):
                return
            read.extend(appended.messages)
            read.last_seq = appended.revision

    def _unwatch(self, session_pk: str, missed: list[services.Appended]) -> None:
        reads = self._reads.get(session_pk, [])
        reads[:] = [r for r in reads if r is not missed]
        if not reads:
            self._reads.pop(session_pk, None)

    def _enforce_budget(self) -> None:
        """Evict least recently used states until the cache fits its byte budget (the lock
        is held). A dialog larger than the whole budget is served but not kept."""
        total = sum(state.size for state in self._states.values())
        limit = self.max_bytes
        while self._states and total > limit:
            _pk, state = self._states.popitem(last=False)
            total -= state.size

    def adopt_created(self, session: Session, messages: list[Message]) -> None:
        """A dialog this process has just created, with its whole history (`messages`, as
        stored): held from its start (A5), unless a state of it is held already."""
        state = SessionState(
            pk=session.pk, generation=session.generation, last_seq=session.last_seq
        )
        state.set_messages(list(messages))
        with self._lock:
            if session.pk not in self._states:
                self._states[session.pk] = state
                self._enforce_budget()

    def apply_appended(self, appended: services.Appended) -> None:
        """Record messages after their write succeeded (A4): never before."""
        with self._lock:
            state = self._states.get(appended.session.pk)
            if state is None:
                for missed in self._reads.get(appended.session.pk, ()):
                    missed.append(appended)
                return
            if (
                state.generation == appended.session.generation
                and state.last_seq >= appended.revision
            ):
                # Held already: read after the write committed, or recorded by the build
                # that began at its commit (`TurnInputBuilder.prepare_committed`).
                state.last_used = time.monotonic()
            elif (
                state.generation == appended.session.generation
                and state.last_seq == appended.base_revision
            ):
                state.extend(appended.messages)
                state.last_seq = appended.revision
                state.last_used = time.monotonic()
                self._states.move_to_end(appended.session.pk)
                self._enforce_budget()
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
