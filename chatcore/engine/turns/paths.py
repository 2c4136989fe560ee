"""The model input of a forked dialog (SPEC H1): the active path only.

A dialog that never forked is one straight branch, and the builder's window over its messages
in seq order is its path (`builder.TurnInputBuilder._load_context`). Once it forked, the input
is its active path: the newest compaction whose summarised messages lie on that path (a fork
before it makes the summary another branch's, so the path is rebuilt from its messages), then
the path's messages after it. The path is walked from the head through the messages this
process's history cache holds (every branch, in seq order; `parent_seq` on each), not read
from the database: a compaction lies on the path when the walk leaves the cached messages at
exactly its last summarised message.
"""

from __future__ import annotations

from sessions_app import services
from sessions_app.models import Compaction, Message, Session

from ..sessions import SessionStates


def forked_context(
    states: SessionStates,
    session: Session,
    appended: services.Appended | None,
    max_chars: int,
) -> tuple[list[Message], Compaction | None, int]:
    """The active path's messages after the compaction that lies on it, that compaction, and
    how many of those messages the read window leaves out (F7: as `selectors.turn_context`'s
    window, the newest that hold at most `max_chars` characters, and the one that crosses
    it). `appended`: the messages of the admission still open on this row (not yet readable
    from another connection), which end the path."""
    summaries: list[Compaction | None] = list(
        Compaction.objects.filter(session_id=session.pk).order_by("-through_seq")
    )
    for compaction in [*summaries, None]:
        after = compaction.through_seq if compaction is not None else 0
        path, left_at = _walk(_held(states, session, appended, after), session.head_seq)
        if compaction is None or left_at == after:
            kept = _window(path, max_chars)
            return path[len(path) - kept :], compaction, len(path) - kept
    raise AssertionError("unreachable: the walk without a compaction always answers")


def _held(
    states: SessionStates, session: Session, appended: services.Appended | None, after: int
) -> list[Message]:
    if appended is None:
        return states.history(session, after_seq=after)
    return states.history_through(session, after_seq=after, through_seq=appended.base_revision) + [
        m for m in appended.messages if m.seq > after
    ]


def _window(path: list[Message], max_chars: int) -> int:
    """How many of the path's newest messages the window keeps (at least one)."""
    total = 0
    for kept, m in enumerate(reversed(path), start=1):
        total += len(m.content)
        if total > max_chars:
            return kept
    return len(path)


def _walk(held: list[Message], head: int) -> tuple[list[Message], int | None]:
    """The messages of `held` on the path to `head`, oldest first, and the seq the walk left
    them at (the parent of the oldest of them, or the head itself when it is not held)."""
    by_seq = {m.seq: m for m in held}
    path: list[Message] = []
    at: int | None = head
    while at is not None and at in by_seq:
        m = by_seq[at]
        path.append(m)
        at = m.parent_seq
    path.reverse()
    return path, at
