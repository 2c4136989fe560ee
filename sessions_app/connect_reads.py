"""The reads a socket's connect makes (PROTOCOL "On connect", issue 57), scoped to the owner
like every selector (F2).

A reconnect storm makes them for thousands of sockets at once, so each is one statement for
a user's list or for a batch of sockets (`engine.opening`), and those that read rows the
list and the first page are made of are written in SQL on our own tables, their rows made
into model instances as the ORM makes them (`rows.from_row`): compiling the ORM's query and
building each instance field by field cost more than running the statement.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterable
from typing import Any

from django.db.models import Q

from chatcore.common.ids import FIRST_PARTY_CHANNELS

from .models import ChannelChat, Message, Session, Turn, TurnStatus
from .rows import columns, from_row
from .rows import cursor as sql_cursor


@functools.cache
def _dialogs_sql() -> str:
    """The chat's live dialogs (part 0) and the owner's others (part 1), each most recently
    active first and at most a number of them."""
    table, cols = Session._meta.db_table, columns(Session, "s")
    order = 'ORDER BY s."last_active_at" DESC, s."created_at" DESC LIMIT %s'
    live = 's."owner_id" = %s AND s."deleted_at" IS NULL'
    return (
        f'SELECT * FROM (SELECT {cols}, 0 FROM "{table}" s WHERE {live}'  # noqa: S608
        f' AND s."channel" = %s AND s."chat_id" = %s {order}) a'
        f' UNION ALL SELECT * FROM (SELECT {cols}, 1 FROM "{table}" s WHERE {live}'
        f' AND NOT (s."channel" = %s AND s."chat_id" = %s) {order}) b'
    )


def dialogs_listed(
    *, owner_id: int, channel: str, chat_id: str, limit: int = 50
) -> tuple[list[Session], list[tuple[Session, bool]]]:
    """What the web chat's `sessions` list shows, in one statement: the chat's live dialogs
    (`selectors.dialog_list_for_chat`) and the owner's other ones, each with whether it is
    read-only for them (`selectors.linked_dialogs_for_user` with `besides`)."""
    params: list[Any] = [owner_id, channel, chat_id, limit, owner_id, channel, chat_id, limit]
    chat: list[Session] = []
    others: list[Session] = []
    with sql_cursor() as cursor:
        cursor.execute(_dialogs_sql(), params)
        for row in cursor.fetchall():
            (others if row[-1] else chat).append(from_row(Session, row))
    external = {(s.channel, s.chat_id) for s in others if s.channel not in FIRST_PARTY_CHANNELS}
    writable: dict[tuple[str, str], bool] = {}
    if external:
        writable = {
            (channel_, chat_): can_write
            for channel_, chat_, can_write in ChannelChat.objects.filter(
                account__user_id=owner_id
            ).values_list("channel", "chat_id", "account__writable")
        }
    return chat, [(s, not writable.get((s.channel, s.chat_id), True)) for s in others]


@functools.cache
def _newest_sql() -> str:
    return (
        f'SELECT {columns(Message, "m")} FROM "{Message._meta.db_table}" m'  # noqa: S608
        ' WHERE m."session_id" = %s ORDER BY m."seq" DESC LIMIT %s'
    )


def newest_messages(*, session_pk: str, count: int) -> list[Message]:
    """The dialog's newest `count` messages, newest first: the page of a dialog that never
    forked (`selectors.newest_page`)."""
    with sql_cursor() as cursor:
        cursor.execute(_newest_sql(), [session_pk, count])
        return [from_row(Message, row) for row in cursor.fetchall()]


def head_ids(*, heads: Iterable[tuple[str, int]]) -> dict[str, str]:
    """The id of each dialog's message of seq `head` (its head, H1), for the dialogs given as
    (primary key, head seq): what a reconnecting client's newest message must be when nothing
    came since (`engine.opening`). One statement for a batch."""
    pairs = [(pk, seq) for pk, seq in heads if seq]
    if not pairs:
        return {}
    match = " OR ".join(['(m."session_id" = %s AND m."seq" = %s)'] * len(pairs))
    sql = f'SELECT m."session_id", m."id" FROM "{Message._meta.db_table}" m WHERE {match}'  # noqa: S608
    with sql_cursor() as cursor:
        cursor.execute(sql, [value for pair in pairs for value in pair])
        # SQLite keeps a UUID as its hex digits, PostgreSQL as a UUID: the frames' form.
        return {pk: str(uuid.UUID(str(id_))) for pk, id_ in cursor.fetchall()}


def dialogs_open(*, session_pks: list[str]) -> tuple[dict[str, Session], dict[str, list[Turn]]]:
    """The rows of these dialogs, and their running and queued turns, each dialog's in queue
    order: two statements for a batch of sockets opening (`engine.opening`)."""
    marks = ", ".join(["%s"] * len(session_pks))
    sessions = (
        f'SELECT {columns(Session, "s")} FROM "{Session._meta.db_table}" s'  # noqa: S608
        f' WHERE s."id" IN ({marks})'
    )
    turns = (
        f'SELECT {columns(Turn, "t")} FROM "{Turn._meta.db_table}" t'  # noqa: S608
        f' WHERE t."session_id" IN ({marks}) AND t."status" IN (%s, %s) ORDER BY t."number"'
    )
    open_turns: dict[str, list[Turn]] = {}
    with sql_cursor() as cursor:
        cursor.execute(sessions, session_pks)
        rows = {s.pk: s for s in (from_row(Session, row) for row in cursor.fetchall())}
        cursor.execute(turns, [*session_pks, TurnStatus.RUNNING, TurnStatus.QUEUED])
        for row in cursor.fetchall():
            turn = from_row(Turn, row)
            open_turns.setdefault(turn.session_id, []).append(turn)
    return rows, open_turns


def messages_after(
    *, session_pk: str, since: int, also_id: str | None, limit: int
) -> list[Message]:
    """The first `limit` messages after seq `since`, with the message `also_id` (else the one
    of seq `since`) before them: what a reconnecting client lacks, and the newest message it
    holds (`engine.opening`)."""
    mine = Q(id=also_id) if also_id else Q(seq=since)
    rows = Message.objects.filter(session_id=session_pk).filter(Q(seq__gt=since) | mine)
    return list(rows.order_by("seq")[: limit + 1])
