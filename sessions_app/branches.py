"""A dialog's messages as a tree (SPEC H1): reads and the path walk.

Every message names the message it follows on its branch (`Message.parent_seq`); the dialog's
`head_seq` is the last message of its active path, which runs from the first message to the
head. A dialog that never forked (`Session.forked` false) is one straight branch: its active
path is every message in seq order, and nothing here is read for it. Seqs only grow, so a
message's parent always has a smaller seq than the message: walks go one way and end.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .models import Compaction, Message, Role, Session

Parents = Mapping[int, int | None]


def parents_of(session_pk: str) -> dict[int, int | None]:
    """Every message of the dialog: seq -> parent seq, in seq order (two numbers a row, read
    from the (session, seq) index's table rows)."""
    rows = (
        Message.objects.filter(session_id=session_pk)
        .order_by("seq")
        .values_list("seq", "parent_seq")
    )
    return dict(rows)


def path_to(parents: Parents, head: int) -> list[int]:
    """The seqs from the first message to `head`, oldest first ([] for an unknown head). A
    parent that is gone (cleared history) ends the walk there."""
    path: list[int] = []
    seq: int | None = head
    while seq is not None and seq in parents:
        path.append(seq)
        parent = parents[seq]
        seq = parent if parent is not None and parent < seq else None
    path.reverse()
    return path


def children_of(parents: Parents) -> dict[int | None, list[int]]:
    """parent seq -> its children's seqs, oldest first."""
    children: dict[int | None, list[int]] = {}
    for seq in sorted(parents):
        children.setdefault(parents[seq], []).append(seq)
    return children


def newest_leaf(parents: Parents, seq: int) -> int:
    """The newest message of `seq`'s subtree ( `seq` itself when it has none): it has no
    child, as a child is always newer than its parent. A `branch` to `seq` goes down to it."""
    inside = {seq}
    for other in sorted(s for s in parents if s > seq):
        if parents[other] in inside:
            inside.add(other)
    return max(inside)


@dataclass(frozen=True)
class ActivePath:
    """The dialog's active path (`seqs`, oldest first) and its forks (`siblings`: for a
    message whose parent has more than one child, all those children, oldest first)."""

    seqs: list[int]
    siblings: dict[int, list[int]]

    def mark(self, messages: Iterable[Message]) -> None:
        """Give each message its siblings for its frame (`events.message_frame`)."""
        for m in messages:
            found = self.siblings.get(m.seq)
            if found is not None:
                m.siblings = found  # type: ignore[attr-defined]


def active_path(session: Session, parents: Parents | None = None) -> ActivePath | None:
    """The active path of a forked dialog; None for one that never forked (all its messages
    in seq order are the path, with no siblings)."""
    if not session.forked:
        return None
    if parents is None:
        parents = parents_of(session.pk)
    seqs = path_to(parents, session.head_seq)
    children = children_of(parents)
    siblings: dict[int, list[int]] = {}
    for seq in seqs:
        kin = children.get(parents[seq], [])
        if len(kin) > 1:
            siblings[seq] = kin
    return ActivePath(seqs, siblings)


def siblings_for(session: Session, messages: Sequence[Message]) -> None:
    """Mark `messages` (any of the dialog's, e.g. a turn's) with their siblings."""
    if not session.forked or not messages:
        return
    children = children_of(parents_of(session.pk))
    for m in messages:
        kin = children.get(m.parent_seq, [])
        if len(kin) > 1:
            m.siblings = kin  # type: ignore[attr-defined]


def path_messages(seqs: Sequence[int], session_pk: str) -> list[Message]:
    """The messages with these seqs (a slice of a path), oldest first: read by seq range and
    filtered here, so the statement's size does not grow with the slice."""
    if not seqs:
        return []
    wanted = set(seqs)
    rows = Message.objects.filter(session_id=session_pk, seq__gte=seqs[0], seq__lte=seqs[-1])
    return [m for m in rows.order_by("seq") if m.seq in wanted]


def compaction_on_path(session_pk: str, path: Sequence[int]) -> Compaction | None:
    """The newest compaction whose last summarised message lies on `path`: its summary then
    covers exactly the path up to there (a message's ancestors are the same on every path
    through it). None when a fork before every summary left them all off the path."""
    on_path = set(path)
    for compaction in Compaction.objects.filter(session_id=session_pk).order_by("-through_seq"):
        if compaction.through_seq in on_path:
            return compaction
    return None


def answered_user_message(parents: Parents, roles: Mapping[int, str], seq: int) -> int | None:
    """The user message an answer answers: its nearest user ancestor (a tool call and its
    results lie between them in a turn with tools)."""
    at = parents.get(seq)
    while at is not None:
        if roles.get(at) == Role.USER:
            return at
        at = parents.get(at)
    return None


def mark_appended(session: Session, messages: Sequence[Message]) -> None:
    """After an append to a forked dialog (in its transaction): the first new message's
    siblings, for the `history_delta` that announces it (the rest follow it alone)."""
    if not session.forked or not messages:
        return
    first = messages[0]
    same_parent = Message.objects.filter(session_id=session.pk)
    if first.parent_seq is None:
        same_parent = same_parent.filter(parent_seq__isnull=True)
    else:
        same_parent = same_parent.filter(parent_seq=first.parent_seq)
    kin = list(same_parent.order_by("seq").values_list("seq", flat=True))
    if len(kin) > 1:
        first.siblings = kin  # type: ignore[attr-defined]


def path_since_summary(session: Session) -> tuple[Compaction | None, list[Message]]:
    """A forked dialog's compaction input (B5 on H1's path): the newest compaction on its
    active path and the path's messages after it, oldest first."""
    path = path_to(parents_of(session.pk), session.head_seq)
    compaction = compaction_on_path(session.pk, path)
    after = compaction.through_seq if compaction is not None else 0
    return compaction, path_messages([s for s in path if s > after], session.pk)
