"""The model input of a forked dialog (SPEC H1): the active path only.

A dialog that never forked is one straight branch, and the builder's window over its messages
in seq order is its path (`builder.TurnInputBuilder._load_context`). Once it forked, the input
is its active path: the newest compaction whose summarised messages lie on that path (a fork
before it makes the summary another branch's, so the path is rebuilt from its messages), then
the path's messages after it, from this process's history cache (which holds every branch in
seq order) and the messages the admission is writing.
"""

from __future__ import annotations

from sessions_app import branches, services
from sessions_app.models import Compaction, Message, Session

from ..sessions import SessionStates


def forked_context(
    states: SessionStates, session: Session, appended: services.Appended | None
) -> tuple[list[Message], Compaction | None]:
    """The active path's messages after the compaction that lies on it, and that compaction.
    `appended`: the messages of the admission still open on this row (not yet readable from
    another connection), which end the path."""
    parents = branches.parents_of(session.pk)
    if appended is not None:
        for m in appended.messages:
            parents[m.seq] = m.parent_seq
    path = branches.path_to(parents, session.head_seq)
    compaction = branches.compaction_on_path(session.pk, path)
    after = compaction.through_seq if compaction is not None else 0
    if appended is None:
        held = states.history(session, after_seq=after)
    else:
        held = states.history_through(
            session, after_seq=after, through_seq=appended.base_revision
        ) + [m for m in appended.messages if m.seq > after]
    on_path = set(path)
    return [m for m in held if m.seq in on_path], compaction
