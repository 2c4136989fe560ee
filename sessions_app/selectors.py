"""Reads. Every query that answers a client goes through here and is scoped to its owner
(F2): another user's dialog is simply not found."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import QuerySet
from django.utils import timezone
from django.utils.translation import gettext as _

from chatcore.common.errors import NotFound, ReadOnlyDialog
from chatcore.common.ids import FIRST_PARTY_CHANNELS, SessionKey

from . import branches
from .channel_models import ChannelChat
from .models import (
    Compaction,
    MemoryNote,
    Message,
    Session,
    StagedInput,
    Turn,
    TurnStatus,
)
from .rows import columns as row_columns
from .rows import cursor as sql_cursor
from .rows import from_row


@contextmanager
def read_transaction() -> Iterator[None]:
    """One read transaction: the reads inside see one state of the database (G6: a turn's
    context in one round trip). On SQLite it begins DEFERRED: a reader never takes the write
    lock that write transactions take at BEGIN (IMMEDIATE), so it runs beside them (WAL)."""
    if connection.vendor != "sqlite" or connection.in_atomic_block:
        with transaction.atomic():
            yield
        return
    connection.ensure_connection()
    mode = getattr(connection, "transaction_mode", None)
    setattr(connection, "transaction_mode", "DEFERRED")  # noqa: B010
    try:
        with transaction.atomic():
            setattr(connection, "transaction_mode", mode)  # noqa: B010
            yield
    finally:
        setattr(connection, "transaction_mode", mode)  # noqa: B010


HISTORY_PAGE_DEFAULT = 100
HISTORY_PAGE_MAX = 500


def live_sessions_for_owner(*, owner_id: int) -> QuerySet[Session]:
    return Session.objects.filter(owner_id=owner_id, deleted_at__isnull=True)


def session_get_for_owner(*, owner_id: int, session_id: str) -> Session:
    """Resolve a public `channel:chat_id:dialog_id` to the caller's live dialog."""
    try:
        key = SessionKey.parse(session_id)
    except Exception as exc:
        raise NotFound(_("Dialog not found.")) from exc
    session = (
        live_sessions_for_owner(owner_id=owner_id)
        .filter(channel=key.channel, chat_id=key.chat_id, dialog_id=key.dialog_id)
        .first()
    )
    if session is None:
        raise NotFound(_("Dialog not found."))
    return session


def dialog_get(*, owner_id: int, channel: str, chat_id: str, dialog_id: str) -> Session:
    session = (
        live_sessions_for_owner(owner_id=owner_id)
        .filter(channel=channel, chat_id=chat_id, dialog_id=dialog_id)
        .first()
    )
    if session is None:
        raise NotFound(_("Dialog %(id)s does not exist.") % {"id": dialog_id})
    return session


def dialog_list_for_chat(
    *, owner_id: int, channel: str, chat_id: str, limit: int = 10, offset: int = 0
) -> list[Session]:
    """The chat's live dialogs, most recently active first (B3 `/sessions`)."""
    qs = live_sessions_for_owner(owner_id=owner_id).filter(channel=channel, chat_id=chat_id)
    return list(qs.order_by("-last_active_at", "-created_at")[offset : offset + limit])


def session_list_for_owner(
    *,
    owner_id: int,
    channel: str | None = None,
    chat_id: str | None = None,
    limit: int = 10,
    offset: int = 0,
) -> tuple[list[Session], int]:
    qs = live_sessions_for_owner(owner_id=owner_id)
    if channel:
        qs = qs.filter(channel=channel)
    if chat_id:
        qs = qs.filter(chat_id=chat_id)
    qs = qs.order_by("-last_active_at", "-created_at")
    return list(qs[offset : offset + limit]), qs.count()


def dialog_most_recent_live(*, owner_id: int, channel: str, chat_id: str) -> Session | None:
    """B1: the most recently active live dialog of a chat if it is within the TTL."""
    ttl = timedelta(seconds=settings.CHAT["SESSION_TTL_SECONDS"])
    return (
        live_sessions_for_owner(owner_id=owner_id)
        .filter(channel=channel, chat_id=chat_id, last_active_at__gte=timezone.now() - ttl)
        .order_by("-last_active_at", "-created_at")
        .first()
    )


def message_size(message: Message) -> int:
    """Bytes a message adds to a page, roughly as serialised (UTF-8 text and tool calls)."""
    size = len(message.content.encode("utf-8", "replace")) + 200
    if message.tool_calls:
        size += len(str(message.tool_calls))
    return size


def _within_bytes(
    rows: list[Message], limit: int, max_bytes: int | None
) -> tuple[list[Message], bool]:
    """The first rows (at most `limit`) that fit in `max_bytes` (F7: a page is bounded in
    bytes as well as in messages), never fewer than one; and whether rows were left out."""
    budget = int(settings.CHAT["HISTORY_PAGE_MAX_BYTES"]) if max_bytes is None else max_bytes
    out: list[Message] = []
    used = 0
    for row in rows[:limit]:
        used += message_size(row)
        if out and used > budget:
            return out, True
        out.append(row)
    return out, len(rows) > limit


def messages_page(
    *,
    session_pk: str,
    before_seq: int | None = None,
    limit: int = HISTORY_PAGE_DEFAULT,
    max_bytes: int | None = None,
    session: Session | None = None,
) -> tuple[list[Message], bool]:
    """The most recent page of history (older than `before_seq` when given), oldest first,
    within `limit` messages and `max_bytes` (default CHAT["HISTORY_PAGE_MAX_BYTES"]). With
    the dialog's row (`session`): its active path only (H1, `branches`)."""
    limit = max(1, min(limit, HISTORY_PAGE_MAX))
    if session is not None and session.forked:
        newest_first = branches.page_before(session, before_seq, limit + 1)
        rows, has_more = _within_bytes(newest_first, limit, max_bytes)
        return list(reversed(rows)), has_more
    qs = Message.objects.filter(session_id=session_pk)
    if before_seq is not None:
        qs = qs.filter(seq__lt=before_seq)
    rows, has_more = _within_bytes(list(qs.order_by("-seq")[: limit + 1]), limit, max_bytes)
    return list(reversed(rows)), has_more


def messages_from(
    *,
    session_pk: str,
    from_seq: int = 0,
    limit: int = HISTORY_PAGE_DEFAULT,
    max_bytes: int | None = None,
    session: Session | None = None,
) -> tuple[list[Message], bool]:
    """Messages with seq >= from_seq, ascending (API pagination, stable under appends),
    within `limit` messages and `max_bytes`. With the dialog's row (`session`): its active
    path only (H1)."""
    limit = max(1, min(limit, HISTORY_PAGE_MAX))
    if session is not None and session.forked:
        return _within_bytes(branches.page_from(session, from_seq, limit + 1), limit, max_bytes)
    rows = list(
        Message.objects.filter(session_id=session_pk, seq__gte=from_seq).order_by("seq")[
            : limit + 1
        ]
    )
    return _within_bytes(rows, limit, max_bytes)


@dataclass(frozen=True)
class TurnContext:
    """What a turn's model input is read from, besides the messages (`turn_context`)."""

    compaction: Compaction | None  # the newest (B5)
    window_start: int  # the seq the history window starts after (F7)
    notes: list[str]  # the newest memory notes, oldest first (C8)
    # With `ahead`: the dialog's (last_seq, state_version) as the statement saw them.
    revision: tuple[int, int] | None = None
    # The messages past the compaction's end that the window leaves out (F7: older than what
    # fits the model's context), counted by the same statement.
    skipped: int = 0


def turn_context(
    *,
    session_pk: str,
    owner_id: int,
    max_chars: int,
    notes_limit: int = 20,
    ahead: int | None = None,
) -> TurnContext:
    """What a turn's model input is read from besides its messages, in one statement (G6: one
    round trip before every first token; a single statement sees one state of the database
    without a transaction):

    - the dialog's newest compaction (B5);
    - the window: the seq after which the newest messages past that compaction's end hold at
      most about `max_chars` characters (the message that crosses the limit is included,
      older ones are not), a running sum in the database, so a model input is read from a
      window bounded by the model's context rather than by the dialog's length (F7);
    - the owner's `notes_limit` newest memory notes, oldest first (C8).

    `ahead`: read before a message of that many characters is appended (a send's turn
    context, read by its admission with the dialog's row locked,
    `admission_lock.lock_for_admission`): the window is the one that message's append will
    give, and the dialog's `last_seq` and `state_version` come along (`revision`), for the
    reader to check that nothing else changed meanwhile."""
    statement = TurnContextStatement(
        session_pk=session_pk,
        owner_id=owner_id,
        max_chars=max_chars,
        notes_limit=notes_limit,
        ahead=ahead,
    )
    with sql_cursor() as cursor:
        cursor.execute(statement.sql, statement.params)
        return statement.result(cursor.fetchall())


# A count of messages no dialog reaches (`_turn_context_sql`).
_MORE_MESSAGES_THAN_ANY_DIALOG = 10**12


@functools.cache
def _turn_context_sql(with_revision: bool) -> str:
    """`TurnContextStatement`'s text, made once (it is the same for every dialog): with the
    dialog's revision (`ahead`) or without."""
    compactions, messages = Compaction._meta.db_table, Message._meta.db_table
    notes = MemoryNote._meta.db_table
    names = [str(f.column) for f in Compaction._meta.concrete_fields]

    def filled(**values: str) -> str:
        return ", ".join(values.get(name, "NULL") for name in names)

    # The seq the window's messages come after: the newest compaction's end.
    through = (
        f'COALESCE((SELECT MAX(k."through_seq") FROM "{compactions}" k'  # noqa: S608
        ' WHERE k."session_id" = %s), 0)'
    )
    sql = (
        f"SELECT 0, {row_columns(Compaction, 'x')} FROM"  # noqa: S608 (our own tables)
        f' (SELECT {row_columns(Compaction, "c")} FROM "{compactions}" c'
        ' WHERE c."session_id" = %s ORDER BY c."through_seq" DESC LIMIT 1) x'
        # The window's boundary: the newest message whose running sum, newest first, passes
        # the limit. The sum is read in seq order from the dialog's newest message and stops
        # at that one; how many it leaves out follows from seqs, which run on without a gap
        # from the oldest message past the compaction (appends take the next seqs in turn,
        # and messages are only ever removed all together, A3). The inner LIMIT (more than
        # any dialog holds) has PostgreSQL read the index from the newest message on, as
        # far as the boundary; without it, it fetched and sorted every message past the
        # compaction of a long dialog first (11 ms for 16,000 of them, against 0.7 ms).
        f" UNION ALL SELECT 1, {filled(through_seq='v.seq', id='v.past')} FROM"
        f' (SELECT w."seq", w."seq" - (SELECT MIN(f."seq") FROM "{messages}" f'
        f' WHERE f."session_id" = %s AND f."seq" > {through}) + 1 AS "past" FROM'
        ' (SELECT m."seq" AS "seq", SUM(m."content_chars") OVER (ORDER BY m."seq" DESC)'
        f' AS "running" FROM "{messages}" m WHERE m."session_id" = %s AND m."seq" > {through}'
        f' ORDER BY m."seq" DESC LIMIT {_MORE_MESSAGES_THAN_ANY_DIALOG}) w'
        ' WHERE w."running" > %s ORDER BY w."seq" DESC LIMIT 1) v'
        f" UNION ALL SELECT 2, {filled(summary='n.content', created_at='n.created_at')} FROM"
        f' (SELECT n."content", n."created_at" FROM "{notes}" n WHERE n."owner_id" = %s'
        ' ORDER BY n."created_at" DESC LIMIT %s) n'
    )
    if with_revision:
        sql += (
            f" UNION ALL SELECT 3, {filled(through_seq='r.last_seq', id='r.state_version')}"  # noqa: S608
            f' FROM "{Session._meta.db_table}" r WHERE r."id" = %s'
        )
    return sql


# Where `TurnContextStatement.result` finds a part's values (after the part's number).
_TURN_CONTEXT_AT = tuple(
    1 + [str(f.column) for f in Compaction._meta.concrete_fields].index(name)
    for name in ("through_seq", "summary", "created_at", "id")
)


class TurnContextStatement:
    """`turn_context`'s statement, for a caller that sends it with others in one round trip
    (`admission_lock.lock_for_admission`): `sql` and `params` to execute, `result` of its rows.

    The parts are told apart by the first column; all of them use the compaction's columns
    (the window's boundary in `through_seq`, a note in `summary` and `created_at`), so every
    column has the compaction's type. Written in SQL: it runs before every turn's first
    token (compiling the ORM's window expression cost more than the query). The window sums
    each message's stored length (`Message.content_chars`, from one covering index), never
    its text: measuring the texts cost time in proportion to the whole history's size (on
    PostgreSQL 0.93 ms for 400 messages of 1,000 characters and 4.0 ms for 2,000, against
    0.33 and 1.0 ms then, `bench/context_statement.py`). On PostgreSQL it reads the sum only
    as far as the window's boundary: a dialog of 16,000 such messages with no compaction,
    0.75 ms against 15.7 ms when the sum and a count ran over all of them."""

    def __init__(
        self,
        *,
        session_pk: str,
        owner_id: int,
        max_chars: int,
        notes_limit: int = 20,
        ahead: int | None = None,
    ) -> None:
        # The message to come counts first in the running sum (it is the newest).
        self.limit = max_chars if ahead is None else max_chars - ahead
        params: list[Any] = [session_pk, *[session_pk] * 4, self.limit, owner_id]
        params.append(notes_limit)
        if ahead is not None:
            params.append(session_pk)
        self.sql, self.params = _turn_context_sql(ahead is not None), params
        self._at = _TURN_CONTEXT_AT

    def result(self, rows: Iterable[Sequence[Any]]) -> TurnContext:
        seq_at, summary_at, created_at, id_at = self._at
        compaction, boundary, past, revision, newest_first = None, None, 0, None, []
        for row in rows:
            part = int(row[0])
            if part == 0:
                compaction = from_row(Compaction, row[1:])
            elif part == 1:
                # The newest message the running sum crosses the limit at, and how many are
                # that old or older (the sum only grows towards the older ones).
                boundary, past = int(row[seq_at]), int(row[id_at])
            elif part == 3:
                revision = (int(row[seq_at]), int(row[id_at]))
            else:
                # Their stored times order them (one database's values, compared as read).
                newest_first.append((row[created_at], row[summary_at]))
        after_seq = compaction.through_seq if compaction is not None else 0
        window = after_seq if boundary is None else max(after_seq, boundary - 1)
        if self.limit < 0 and revision is not None:
            # The message to come crosses the limit by itself: the window holds only it.
            window = max(after_seq, revision[0])
        # Left out: those `past` ones but the boundary message itself, which the window
        # keeps, unless the window starts after it too.
        skipped = 0 if boundary is None else past if window >= boundary else past - 1
        newest_first.sort(key=lambda note: note[0], reverse=True)
        notes_oldest_first = [content for _at, content in reversed(newest_first)]
        return TurnContext(compaction, window, notes_oldest_first, revision, skipped)


def messages_for_context(*, session_pk: str, after_seq: int = 0) -> list[Message]:
    """The dialog's messages after `after_seq`, ascending: what a model input is built from.
    It runs before a turn's first token whenever the history cache is behind, so it is
    written in SQL (`rows.from_row`)."""
    table = Message._meta.db_table
    sql = (
        f'SELECT {row_columns(Message, "m")} FROM "{table}" m'  # noqa: S608
        ' WHERE m."session_id" = %s AND m."seq" > %s ORDER BY m."seq"'
    )
    with sql_cursor() as cursor:
        cursor.execute(sql, [session_pk, after_seq])
        return [from_row(Message, row) for row in cursor.fetchall()]


def turn_queue(*, session_pk: str) -> list[Turn]:
    return list(
        Turn.objects.filter(session_id=session_pk, status=TurnStatus.QUEUED).order_by("number")
    )


def turn_running(*, session_pk: str) -> Turn | None:
    return Turn.objects.filter(session_id=session_pk, status=TurnStatus.RUNNING).first()


def turn_get_for_owner(*, owner_id: int, turn_id: str) -> Turn:
    try:
        return Turn.objects.select_related("session").get(pk=turn_id, owner_id=owner_id)
    except (Turn.DoesNotExist, ValueError, Exception) as exc:
        raise NotFound(_("Turn not found.")) from exc


def staged_for_session(*, session_pk: str) -> list[StagedInput]:
    return list(StagedInput.objects.filter(session_id=session_pk, status=StagedInput.Status.STAGED))


def external_write_allowed(*, user_id: int, session: Session) -> bool:
    """Whether a write from the web or the API may go into a chat-app dialog: yes unless the
    writer is the web user an operator linked the chat's account to read-only."""
    chat = (
        ChannelChat.objects.filter(channel=session.channel, chat_id=session.chat_id)
        .select_related("account")
        .first()
    )
    if chat is None or chat.account.user_id != user_id:
        return True
    return chat.account.writable


def dialog_check_writable(*, user_id: int, session: Session) -> None:
    """Refuse (`read_only`) any write of a web or API user into a chat-app dialog linked to
    them read-only: sends, steers, stop, retry, continue, rename, delete, compact."""
    if session.channel in FIRST_PARTY_CHANNELS:
        return
    if not external_write_allowed(user_id=user_id, session=session):
        raise ReadOnlyDialog()


def session_get_for_writer(*, owner_id: int, session_id: str) -> Session:
    """`session_get_for_owner` for a write: also refused when the dialog is read-only."""
    session = session_get_for_owner(owner_id=owner_id, session_id=session_id)
    dialog_check_writable(user_id=owner_id, session=session)
    return session


def linked_dialogs_for_user(
    *, user_id: int, limit: int = 50, besides: tuple[str, str] | None = None
) -> list[tuple[Session, bool]]:
    """The user's dialogs outside their web chat, most recently active first, each with
    whether it is read-only for them: the chat-app dialogs of the accounts an operator linked
    to them (A1) and, with `besides` (the web chat's channel and chat id), their own dialogs
    of the API and the terminal too (issue 54: a dialog made by `POST /sessions` shows in the
    web chat's list; never read-only, they are the user's own)."""
    query = live_sessions_for_owner(owner_id=user_id)
    if besides is None:
        query = query.exclude(channel__in=FIRST_PARTY_CHANNELS)
    else:
        query = query.exclude(channel=besides[0], chat_id=besides[1])
    sessions = list(query.order_by("-last_active_at", "-created_at")[:limit])
    if not sessions:
        return []
    writable = dict(
        ((channel, chat_id), can_write)
        for channel, chat_id, can_write in ChannelChat.objects.filter(
            account__user_id=user_id
        ).values_list("channel", "chat_id", "account__writable")
    )
    return [(s, not writable.get((s.channel, s.chat_id), True)) for s in sessions]
