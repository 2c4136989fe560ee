"""The admission's locked read (C1, C2, F7, G6): a dialog's row locked with its queue counts,
F7's slot counts and the turn's context, in one round trip (`lock_for_admission`), and the
same for a batch of sends on PostgreSQL (`lock_many`). It runs for every send, so it is
written in SQL: our own tables, values as parameters."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

from django.contrib.auth.models import User
from django.db import connection
from django.utils.translation import gettext as _

from chatcore.common.errors import NotFound
from sessions_app import rows, selectors
from sessions_app.models import Session, StagedInput, Turn, TurnStatus

from . import limits
from .ingress import Inbound
from .queue import QueueState

_TURNS = Turn._meta.db_table
_STAGED = StagedInput._meta.db_table
_SESSIONS = Session._meta.db_table
_USERS = User._meta.db_table
_USER_PK = User._meta.pk.column
# A live dialog's row by id, aliased `s`.
_LIVE = f'"{_SESSIONS}" s WHERE s."id" = %s AND s."deleted_at" IS NULL'
# A dialog's queue counts, on its row aliased `s` (`_count_columns`).
_COUNTS = (
    f'(SELECT COUNT(*) FROM "{_TURNS}" t WHERE t."session_id" = s."id"'  # noqa: S608
    ' AND t."status" = %s) AS "q_queued",'
    f' (SELECT COUNT(*) FROM "{_TURNS}" t WHERE t."session_id" = s."id"'
    ' AND t."status" = %s) AS "q_running",'
    f' (SELECT COUNT(*) FROM "{_STAGED}" i WHERE i."session_id" = s."id"'
    ' AND i."status" = %s) AS "q_staged",'
    f' (SELECT COUNT(*) FROM "{_TURNS}" t WHERE t."status" = %s) AS "q_all"'
)


def lock_for_admission(
    session_pk: str,
    owner_id: int,
    *,
    slot: tuple[str, str, Any] | None = None,
    context: selectors.TurnContextStatement | None = None,
) -> tuple[Session, QueueState]:
    """`queue.lock_live`, with the dialog's queue counts (G6: admission costs one read, whatever it
    finds, on SQLite). It runs for every send, so it is written in SQL: our own tables,
    values as parameters.

    SQLite's write transaction already serialises, so the row and its counts are one
    statement. On PostgreSQL the row lock comes first, in a statement of its own that also
    locks the sender's row (`limits.lock_owner`, for F7's slot): a statement's subqueries see
    the tables as of its start, so counts read in the statement that waited for the lock
    would miss what the transaction holding it committed (a turn another send just started,
    C1). The counts are the next statement, sent with the lock's in one round trip
    (`rows.pipelined`): the server runs it once the lock is held, on a snapshot of its own,
    so it sees that.

    `slot`: the dialog's channel and chat id and the send's received time, for a send that
    may start its turn: F7's counts for that turn are read in the same statement as the
    queue's (`QueueState.slot`), so the start needs no statement of its own for them.

    `context`: the turn context of a send that may start its turn, read in the same round
    trip (`QueueState.context`), so its build needs no read of its own (G6). It goes first,
    before the lock, so a long dialog's read holds no lock another send waits for (its
    sender's row: the sender's other dialogs, F7); what commits between it and the lock
    shows in the row's revision, and the build then reads anew
    (`builder.admitted_context`)."""
    counts, count_params = _count_columns(session_pk, owner_id, slot)
    read = None
    with rows.cursor() as cursor:
        if connection.features.has_select_for_update:
            # Both rows, the dialog's first (the order every claim takes them in).
            with rows.cursor() as counting, rows.cursor() as reading:
                with rows.pipelined():
                    if context is not None:
                        # First: a long dialog's read holds no lock of the others.
                        reading.execute(context.sql, context.params)
                    cursor.execute(
                        f'SELECT {rows.columns(Session, "s")} FROM "{_USERS}" u,'  # noqa: S608
                        f' {_LIVE} AND u."{_USER_PK}" = %s FOR UPDATE OF s, u',
                        [session_pk, owner_id],
                    )
                    # In the same round trip, run once the lock is held (each statement its
                    # own snapshot): no row when the dialog is gone.
                    sql = f"SELECT {counts} FROM {_LIVE}"  # noqa: S608 (our own tables)
                    counting.execute(sql, [*count_params, session_pk])
                found = cursor.fetchone()
                if found is not None:
                    row = (*found, *counting.fetchone())
                    if context is not None:
                        read = context.result(reading.fetchall())
        else:
            cursor.execute(
                f"SELECT {rows.columns(Session, 's')}, {counts} FROM {_LIVE}",  # noqa: S608
                [*count_params, session_pk],
            )
            found = row = cursor.fetchone()
            if found is not None and context is not None:
                cursor.execute(context.sql, context.params)
                read = context.result(cursor.fetchall())
    if found is None:
        raise NotFound(_("Dialog not found."))
    width = len(Session._meta.concrete_fields)
    state = _queue_state(row[width:])
    if context is not None:
        state.context = read
    return rows.from_row(Session, row), state


def _count_columns(
    session_pk: str, owner_id: int, slot: tuple[str, str, Any] | None
) -> tuple[str, list[Any]]:
    """The columns of a dialog's queue counts (and F7's, `slot`), on its row aliased `s`
    (`lock_for_admission`)."""
    counts = _COUNTS
    params: list[Any] = [
        TurnStatus.QUEUED,
        TurnStatus.RUNNING,
        StagedInput.Status.STAGED,
        TurnStatus.QUEUED,
    ]
    if slot is not None:
        channel, chat_id, received_at = slot
        columns, slot_params = limits.slot_columns(
            owner_id=owner_id,
            channel=channel,
            chat_id=chat_id,
            session_id=session_pk,
            received_at=received_at,
        )
        counts = f"{counts}, {columns}"
        params += slot_params
    return counts, params


def _queue_state(counts: Sequence[Any]) -> QueueState:
    """A `QueueState` from `_count_columns`' values."""
    queued, running, staged, queued_everywhere, *slot_counts = counts
    return QueueState(
        queued=int(queued),
        running=int(running),
        staged=bool(staged),
        queued_everywhere=int(queued_everywhere),
        slot=(int(slot_counts[0] or 0), int(slot_counts[1] or 0)) if slot_counts else None,
    )


def context_statement(
    inbound: Inbound, session: Session, max_chars: int
) -> selectors.TurnContextStatement:
    """The turn context a send's admission reads in its lock's round trip: the window its
    user message will give (`selectors.turn_context`'s `ahead`)."""
    return selectors.TurnContextStatement(
        session_pk=session.pk,
        owner_id=inbound.owner.pk,
        max_chars=max_chars,
        ahead=len(inbound.content),
    )


class Locking(Protocol):
    """What `lock_many` reads of a send of its batch (`admission_batch.Admission`)."""

    inbound: Inbound
    session: Session
    context_chars: int | None


def lock_many(batch: Sequence[Locking]) -> dict[str, tuple[Session, QueueState]]:
    """`lock_for_admission` for a batch (`admission_batch.admit_and_start_many`): the live
    dialogs' rows and counts (and the contexts of the sends that ask for one, read before the
    locks), by id, of the sends whose dialog and sender rows it locked; a dialog gone, or one
    whose row or sender's row another transaction holds, has none (SKIP LOCKED; in id order,
    as `lease.check_all` locks). Every statement has the same text whatever the
    batch's size (the counts are one statement per dialog, those of `lock_for_admission`),
    so the server plans each once per connection, not per batch (`rows.cursor`)."""
    ids = sorted({str(a.session.pk) for a in batch})
    owners = sorted({a.inbound.owner.pk for a in batch})
    with contextlib.ExitStack() as cursors:
        locking = cursors.enter_context(rows.cursor())
        owning = cursors.enter_context(rows.cursor())
        counting = [cursors.enter_context(rows.cursor()) for _a in batch]
        contexts = [
            context_statement(a.inbound, a.session, a.context_chars)
            if a.context_chars is not None
            else None
            for a in batch
        ]
        reading = [cursors.enter_context(rows.cursor()) for _a in batch]
        with rows.pipelined():
            # The contexts first: a long dialog's read holds none of the batch's locks.
            for cursor, context in zip(reading, contexts, strict=True):
                if context is not None:
                    cursor.execute(context.sql, context.params)
            locking.execute(
                f'SELECT {rows.columns(Session, "s")} FROM "{_SESSIONS}" s'  # noqa: S608
                ' WHERE s."id" = ANY(%s) AND s."deleted_at" IS NULL ORDER BY s."id"'
                " FOR UPDATE SKIP LOCKED",
                [ids],
            )
            owning.execute(
                f'SELECT u."{_USER_PK}" FROM "{_USERS}" u'  # noqa: S608
                f' WHERE u."{_USER_PK}" = ANY(%s) ORDER BY u."{_USER_PK}"'
                " FOR UPDATE SKIP LOCKED",
                [owners],
            )
            # Run once both locks are held, each on a snapshot of its own.
            for cursor, admission in zip(counting, batch, strict=True):
                session, inbound = admission.session, admission.inbound
                slot = (session.channel, session.chat_id, inbound.received_at)
                counts, params = _count_columns(session.pk, inbound.owner.pk, slot)
                sql = f"SELECT {counts} FROM {_LIVE}"  # noqa: S608 (our own tables)
                cursor.execute(sql, [*params, session.pk])
        locked = {s.pk: s for s in (rows.from_row(Session, row) for row in locking.fetchall())}
        owners_locked = {row[0] for row in owning.fetchall()}
        found = {}
        for cursor, admission, reader, context in zip(
            counting, batch, reading, contexts, strict=True
        ):
            counted = cursor.fetchone()
            read = context.result(reader.fetchall()) if context is not None else None
            live = locked.get(admission.session.pk)
            if (
                counted is not None
                and live is not None
                and admission.inbound.owner.pk in owners_locked
            ):
                state = _queue_state(counted)
                state.context = read
                found[live.pk] = (live, state)
    return found
