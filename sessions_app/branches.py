"""A dialog's messages as a tree (SPEC H1): reads and the path walk.

Every message names the message it follows on its branch (`Message.parent_seq`); the dialog's
`head_seq` is the last message of its active path, which runs from the first message to the
head. A dialog that never forked (`Session.forked` false) is one straight branch: its active
path is every message in seq order, and nothing here is read for it. Seqs only grow, so a
message's parent always has a smaller seq than the message: walks go one way and end.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from .models import Compaction, Message, Session
from .rows import cursor as sql_cursor

_MESSAGES = Message._meta.db_table

Parents = Mapping[int, int | None]


def parents_of(session_pk: str) -> dict[int, int | None]:
    """Every message of the dialog: seq -> parent seq (two numbers a row, in SQL: a branch
    switch reads them all)."""
    sql = f'SELECT m."seq", m."parent_seq" FROM "{_MESSAGES}" m WHERE m."session_id" = %s'  # noqa: S608
    with sql_cursor() as cursor:
        cursor.execute(sql, [session_pk])
        return dict(cursor.fetchall())


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


def active_path(session: Session) -> list[int] | None:
    """The whole active path of a forked dialog, oldest first; None for one that never forked
    (all its messages in seq order are the path)."""
    if not session.forked:
        return None
    return path_to(parents_of(session.pk), session.head_seq)


def fork_key(parent_seq: int | None) -> str:
    """A parent's key in `Session.forks` (JSON object keys are text; "" for no parent)."""
    return "" if parent_seq is None else str(parent_seq)


def mark_siblings(session: Session, messages: Iterable[Message]) -> None:
    """Give each message its siblings for its frame (`events.message_frame`), from the forks
    the dialog's row keeps: no read."""
    forks = session.forks or {}
    if not forks:
        return
    for m in messages:
        kin = forks.get(fork_key(m.parent_seq))
        if kin:
            m.siblings = kin  # type: ignore[attr-defined]


# The active path upward from the head, one step an index lookup on (session, seq): rows
# below `before` are counted, and the walk stops once it has `count` of them (or reaches a
# message below `floor`). Written for SQLite and PostgreSQL alike.
_WALK = (
    'WITH RECURSIVE p("seq", "parent_seq", "n") AS ('
    ' SELECT m."seq", m."parent_seq", CASE WHEN m."seq" < %s THEN 1 ELSE 0 END'
    ' FROM "{table}" m WHERE m."session_id" = %s AND m."seq" = %s'
    " UNION ALL"
    ' SELECT m."seq", m."parent_seq", p."n" + CASE WHEN m."seq" < %s THEN 1 ELSE 0 END'
    ' FROM p JOIN "{table}" m ON m."session_id" = %s AND m."seq" = p."parent_seq"'
    ' WHERE p."n" < %s AND p."seq" >= %s'
    ') SELECT p."seq" FROM p WHERE p."seq" < %s AND p."seq" >= %s'
)


def _walk(session: Session, *, before: int, count: int, floor: int) -> list[int]:
    """Seqs of the active path below `before` and from `floor` on, newest first, at most
    `count`."""
    if not session.head_seq:
        return []
    sql = _WALK.format(table=_MESSAGES)
    params: list[int | str] = [before, session.pk, session.head_seq, before, session.pk]
    params += [count, floor]
    with sql_cursor() as cursor:
        cursor.execute(sql, [*params, before, floor])
        found = [row[0] for row in cursor.fetchall()]
    return sorted(found, reverse=True)[:count]


def page_before(session: Session, before_seq: int | None, count: int) -> list[Message]:
    """The newest `count` messages of the active path older than `before_seq`, newest first:
    a walk from the head of about as many steps (not a read of the dialog's tree)."""
    before = before_seq if before_seq is not None else session.head_seq + 1
    return _rows(session, _walk(session, before=before, count=count, floor=0), reverse=True)


def page_from(session: Session, from_seq: int, count: int) -> list[Message]:
    """The first `count` messages of the active path from `from_seq` on, oldest first."""
    seqs = _walk(session, before=session.head_seq + 1, count=2**62, floor=from_seq)
    return _rows(session, sorted(seqs)[:count], reverse=False)


def _rows(session: Session, seqs: list[int], *, reverse: bool) -> list[Message]:
    if not seqs:
        return []
    rows = Message.objects.filter(session_id=session.pk, seq__in=seqs)
    found = list(rows.order_by("-seq" if reverse else "seq"))
    mark_siblings(session, found)
    return found


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


def parent_of_append(session: Session, parent_seq: int | None | Literal[False]) -> int | None:
    """The parent of an append's first message (`services.append_locked`): the dialog's head,
    or `parent_seq` when given (an edit's sibling); a parent other than the head, or a head
    that is not the newest message, forks the dialog."""
    head = session.head_seq or None
    parent = head if parent_seq is False else parent_seq
    if parent != head or (head is not None and head != session.last_seq):
        session.forked = True
    return parent


def appended(session: Session, messages: Sequence[Message]) -> tuple[str, ...]:
    """After an append's insert: the last new message is the head, and a fork it made is kept
    (`mark_appended`). The row's fields this changed, for the append's update."""
    if messages:
        session.head_seq = messages[-1].seq
    return ("head_seq", "forked", "forks") if mark_appended(session, messages) else HEAD_FIELDS


HEAD_FIELDS = ("head_seq", "forked")


def mark_appended(session: Session, messages: Sequence[Message]) -> bool:
    """After an append to a forked dialog (in its transaction): the first new message's
    siblings, for the `history_delta` that announces it (the rest follow it alone), kept in
    the row's `forks` when it has any. Its parent's children are newer than the parent: the
    read is a range of the (session, seq) index from there. True when `forks` changed (the
    caller saves it with the row)."""
    if not session.forked or not messages:
        return False
    first = messages[0]
    after = first.parent_seq or 0
    same_parent = Message.objects.filter(session_id=session.pk, seq__gt=after)
    if first.parent_seq is None:
        same_parent = same_parent.filter(parent_seq__isnull=True)
    else:
        same_parent = same_parent.filter(parent_seq=first.parent_seq)
    # The new message itself may not be written yet (on PostgreSQL a turn's writes are one
    # statement at the end of their block, `rows.merged`): its seq is added here.
    kin = sorted({*same_parent.values_list("seq", flat=True), first.seq})
    if len(kin) < 2:
        return False
    first.siblings = kin  # type: ignore[attr-defined]
    session.forks = {**(session.forks or {}), fork_key(first.parent_seq): kin}
    return True


def path_since_summary(session: Session) -> tuple[Compaction | None, list[Message]]:
    """A forked dialog's compaction input (B5 on H1's path): the newest compaction on its
    active path and the path's messages after it, oldest first."""
    path = path_to(parents_of(session.pk), session.head_seq)
    compaction = compaction_on_path(session.pk, path)
    after = compaction.through_seq if compaction is not None else 0
    return compaction, path_messages([s for s in path if s > after], session.pk)
