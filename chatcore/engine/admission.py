"""A send's admission (C1, C2, C4, C5, F7, G6): stored before it is acknowledged, and for a
send to an idle dialog, its turn started in the same transaction.

`admit_and_start` locks the dialog's row (and the sender's, for F7) with the queue's counts
in one round trip (`lock_for_admission`), then stages a steer or inject for the running turn,
appends an idle inject to history, queues the turn, or, for a send to an idle dialog whose
lease is free, takes the lease, claims the turn and records its user message, all in that one
transaction. `admit_and_start_many` does the same for a burst of sends on PostgreSQL, one
transaction per batch (the engine gathers them, `gather.Gathered`). Synchronous, run on the
database threads; the rest of the dialog's queue (claims, stop, retries, checkpoints) is in
`queue`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.contrib.auth.models import User
from django.db import DatabaseError, connection, transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from chatcore.common.errors import NotFound, Overloaded, QueueFull
from sessions_app import rows, selectors, services, storage, turn_services
from sessions_app.models import (
    MessageKind,
    Role,
    Session,
    StagedInput,
    Turn,
    TurnMode,
    TurnStatus,
)

from . import limits
from .gather import ALONE
from .ingress import Ack, Inbound
from .lease import Lease
from .queue import QueueState, Started, check_capacity, enqueue_locked
from .sessions import SessionStates
from .turns.committer import start_messages

logger = logging.getLogger(__name__)

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


def _context_statement(
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


def _admit_locked(
    inbound: Inbound, live: Session, *, cfg: dict[str, Any], state: QueueState
) -> tuple[Ack, services.Appended | None, Turn | None]:
    """The admission of `admit`, on the dialog's row locked by the caller's transaction."""
    if inbound.mode in ("steer", "inject") and state.busy:
        # C4/C5: staged durably, recorded at the running turn's next step boundary.
        StagedInput.objects.create(
            session_id=live.pk,
            mode=inbound.mode,
            content=inbound.content,
            client_msg_id=inbound.client_msg_id,
            source=inbound.source(),
            received_at=inbound.received_at,
        )
        running = Turn.objects.filter(session_id=live.pk, status=TurnStatus.RUNNING).first()
        turn_id = str(running.pk) if running else None
        return Ack(live, turn_id, 0, inbound.mode, inbound.client_msg_id), None, None
    if inbound.mode == "inject":
        # C5: idle inject is appended to history without running the model.
        appended = services.messages_append(
            session_pk=live.pk,
            session=live,
            messages=[
                services.NewMessage(
                    role=Role.USER,
                    content=inbound.content,
                    kind=MessageKind.INJECT,
                    created_at=inbound.received_at,
                    source=inbound.source(),
                )
            ],
        )
        return Ack(appended.session, None, 0, "inject", inbound.client_msg_id), appended, None
    turn = enqueue_locked(
        live,
        cfg=cfg,
        owner_id=inbound.owner.pk,
        content=inbound.content,
        client_msg_id=inbound.client_msg_id,
        source=inbound.source(),
        received_at=inbound.received_at,
        state=state,
    )
    # An idle steer is a send (C4), acknowledged as such.
    mode = "send" if inbound.mode == "steer" else inbound.mode
    # Every turn of the dialog queued or running is ahead of the one just added.
    at = state.queued + state.running
    return Ack(live, str(turn.pk), at, mode, inbound.client_msg_id), None, turn


def admit(inbound: Inbound, session: Session, *, cfg: dict[str, Any], states: SessionStates) -> Ack:
    """Store one accepted send/steer/inject before it is acknowledged (C2): a queued turn, a
    staged input for the running turn, or an idle inject appended to history."""
    ack, _started = admit_and_start(inbound, session, cfg=cfg, states=states, start_as=None)
    return ack


def admit_and_start(
    inbound: Inbound,
    session: Session,
    *,
    cfg: dict[str, Any],
    states: SessionStates,
    start_as: str | None,
    held: Lease | None = None,
    on_started: Callable[[Started], None] | None = None,
    context_chars: int | None = None,
) -> tuple[Ack, Started | None]:
    """`admit`, and for a send to an idle dialog whose lease is free, start its turn in the
    same transaction (G6: one round trip before the context is read): take the lease for
    `start_as` with a new epoch (G2), claim the turn when its owner has a free slot (F7) and
    record its user message (C3). Anything else (a busy dialog, a lease held elsewhere, a
    turn still marked running that recovery must close first (C11), an owner at the cap) is
    only admitted, exactly as `admit` does, and the caller takes the usual path (`kick`).
    `held`: the lease of this process's worker of the dialog, lingering after its last turn
    (a send that follows an answer at once): the turn starts under it, if the row still
    shows it, and the caller hands it to that worker; no new lease, no second transaction.

    The started path is four statements on SQLite: the locked row with the queue counts and
    F7's slot counts, the turn inserted running, the user message, and one update of the
    dialog's row (turn counter, lease, revision); on PostgreSQL three in two round trips:
    the dialog's and the owner's rows locked, then the counts (and the turn's context,
    `context_chars`), sent together; then the last three writes as one statement
    (`rows.merged`), sent with the COMMIT.

    `on_started`: called with the started turn as soon as it is decided, before the COMMIT
    (the turn's input built meanwhile, `Engine.submit`); a
    `Started` of an attempt that did not commit is never returned, so what was made for it
    goes unused. `context_chars`: for a send that may start its turn, the turn's context is
    read in the lock's round trip, its window `context_chars` characters at most
    (`Started.context`, for its build)."""

    def write() -> tuple[Ack, services.Appended | None, Started | None]:
        with transaction.atomic():
            admitted = decide()
            if on_started is not None and admitted[2] is not None:
                on_started(admitted[2])
            return admitted

    def decide() -> tuple[Ack, services.Appended | None, Started | None]:
        confirmed = time.monotonic()
        may_start = inbound.mode in ("send", "steer") and (held is not None or start_as is not None)
        slot = (session.channel, session.chat_id, inbound.received_at) if may_start else None
        context = (
            _context_statement(inbound, session, context_chars)
            if may_start and context_chars is not None
            else None
        )
        live, state = lock_for_admission(session.pk, inbound.owner.pk, slot=slot, context=context)
        if inbound.accept is not None:
            inbound.accept()
        idle_send = inbound.mode in ("send", "steer") and not state.busy
        if held is not None and state.staged:
            # The worker that holds the lease has not yet dealt with what its last turn
            # left staged (`after_turn_staged`): the turn queues behind it, in order.
            idle_send = False
        owner = held.owner if held is not None else start_as
        if owner is not None and idle_send:
            started = _start_locked(
                inbound, live, state, owner=owner, cfg=cfg, confirmed=confirmed, held=held
            )
            if started is not None:
                ack = Ack(live, str(started.turn.pk), 0, "send", inbound.client_msg_id)
                return ack, started.appended, started
        ack, appended, _turn = _admit_locked(inbound, live, cfg=cfg, state=state)
        return ack, appended, None

    ack, appended, started = storage.storage_retry(write, what="admit", session=session)
    if appended is not None:
        states.apply_appended(appended)
    return ack, started


@dataclass
class Admission:
    """One send of a batch admitted together (`admit_and_start_many`): a send or steer that
    may start its turn under a new lease for `start_as` (no lingering worker's lease, no
    chat app's `accept`). `on_started` and `context_chars` as for `admit_and_start`."""

    inbound: Inbound
    session: Session
    start_as: str
    on_started: Callable[[Started], None] | None = None
    context_chars: int | None = None


# `admit_and_start_many`'s outcome of one send: its ack and started turn, or `ALONE` (it is
# admitted on its own, `admit_and_start`, after the batch).
AdmissionOutcome = tuple[Ack, Started] | object


def admit_and_start_many(
    batch: list[Admission], *, cfg: dict[str, Any], states: SessionStates
) -> list[AdmissionOutcome]:
    """`admit_and_start` for many sends to idle dialogs at once, on PostgreSQL, in one
    transaction (G6: a burst's admissions cost a few transactions, not one each). The
    batch's dialogs and its senders are distinct (one send of each per batch, the caller's
    rule).

    One round trip reads the sends' turn contexts, locks the dialogs' rows, then the
    senders' rows, skipping any row another transaction holds, and reads every dialog's queue
    and F7 counts after those locks. A batch never waits for a lock, so it is never part of
    a circle of transactions waiting on each other (a lease renewal locks many dialogs in the
    order it finds them, another process's batch locks its own), and one contended row holds
    up no other send of the batch: the send whose dialog or sender was skipped goes alone,
    and waits there. Then
    each started turn's writes are its one statement (`rows.merged`), all held to go with
    the COMMIT.

    A send that does not start there and then (its row held elsewhere, a dialog busy or
    gone, a lease live elsewhere, inputs staged, no free slot, a full queue) is left alone
    (`ALONE`): the
    caller admits it on its own after this transaction, which refuses or queues it exactly
    as for any send. An error of the transaction itself leaves every send to go alone (with
    its retries)."""
    outcomes: list[AdmissionOutcome] = [ALONE] * len(batch)

    def write() -> list[tuple[int, Ack, Started]]:
        done: list[tuple[int, Ack, Started]] = []
        with transaction.atomic():
            confirmed = time.monotonic()
            found = _lock_many(batch)
            for i, admission in enumerate(batch):
                # Its writes one statement (`rows.merged`), held to go with the COMMIT.
                started = _start_one(admission, found, cfg=cfg, confirmed=confirmed)
                if started is not None:
                    ack = Ack(
                        started.session,
                        str(started.turn.pk),
                        0,
                        "send",
                        admission.inbound.client_msg_id,
                    )
                    done.append((i, ack, started))
            for i, _ack, started in done:
                if batch[i].on_started is not None:
                    batch[i].on_started(started)  # type: ignore[misc]
        return done

    try:
        done = write()
    except DatabaseError as exc:
        # Rolled back: nothing of it stays, and each send is admitted on its own.
        logger.warning("a batch of %d admissions failed; each goes alone: %s", len(batch), exc)
        return outcomes
    for i, ack, started in done:
        if started.appended is not None:
            # Its user message, in the history this process holds (A4: once committed), as
            # a send admitted alone records it: without it, the turn's answer no longer
            # followed what the cache held, the dialog's history was dropped, and its next
            # build read the whole window again.
            states.apply_appended(started.appended)
        outcomes[i] = (ack, started)
    return outcomes


def _start_one(
    admission: Admission,
    found: dict[str, tuple[Session, QueueState]],
    *,
    cfg: dict[str, Any],
    confirmed: float,
) -> Started | None:
    """`admit_and_start_many`'s start of one send on its locked row: the started turn, or
    None (it goes alone)."""
    got = found.get(str(admission.session.pk))
    if got is None:
        return None  # gone: refused on its own (NotFound)
    live, state = got
    if state.busy or state.staged:
        return None
    try:
        return _start_locked(
            admission.inbound,
            live,
            state,
            owner=admission.start_as,
            cfg=cfg,
            confirmed=confirmed,
        )
    except (QueueFull, Overloaded):
        return None  # refused on its own, as any send


def _lock_many(batch: list[Admission]) -> dict[str, tuple[Session, QueueState]]:
    """`lock_for_admission` for a batch (`admit_and_start_many`): the live dialogs' rows and
    counts (and the contexts of the sends that ask for one, read before the locks), by id,
    of the sends whose dialog and sender rows it locked; a dialog gone, or one
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
            _context_statement(a.inbound, a.session, a.context_chars)
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


# The dialog row's fields a started turn changes besides the append's own (`_start_locked`).
_STARTED_FIELDS = ("turn_counter", "lease_owner", "lease_expires_at", "lease_epoch")


def _start_locked(
    inbound: Inbound,
    live: Session,
    state: QueueState,
    *,
    owner: str,
    cfg: dict[str, Any],
    confirmed: float,
    held: Lease | None = None,
) -> Started | None:
    """In the admitting transaction, on the locked row of an idle dialog (no queued or
    running turn, so nothing for C11 recovery): the lease (or `held`, still current), the
    F7 slot, the turn inserted already running and its user message. None (nothing
    written: the caller queues the turn) when the lease is live (or `held` is no longer
    the dialog's) or the owner is at the cap."""
    now = timezone.now()
    if held is not None:
        if not held.current_on(live, now):
            return None
    elif live.lease_owner and live.lease_expires_at is not None and live.lease_expires_at >= now:
        return None
    check_capacity(live, cfg, state)
    turn = Turn(
        session=live,
        owner_id=inbound.owner.pk,
        number=live.turn_counter + 1,
        mode=TurnMode.SEND,
        content=inbound.content,
        client_msg_id=inbound.client_msg_id,
        source=inbound.source(),
        received_at=inbound.received_at,
        status=TurnStatus.RUNNING,
        started_at=now,
    )
    # The sender's row is locked already, with the dialog's, and F7's counts were read after
    # that lock (`lock_for_admission`).
    free = (
        limits.slot_free(*state.slot, cfg)
        if state.slot is not None
        else limits.turn_may_start(turn, cfg)
    )
    if not free:
        return None
    with rows.merged():
        # G6: on PostgreSQL the turn, its user message and the row's update are one
        # statement (`rows.merged`).
        started = _insert_started(
            inbound,
            live,
            state,
            turn,
            owner=owner,
            cfg=cfg,
            confirmed=confirmed,
            held=held,
            now=now,
        )
    started.context = state.context
    return started


def _insert_started(
    inbound: Inbound,
    live: Session,
    state: QueueState,
    turn: Turn,
    *,
    owner: str,
    cfg: dict[str, Any],
    confirmed: float,
    held: Lease | None,
    now: Any,
) -> Started:
    """The writes of a started turn, on the locked row: the turn, the lease (or `held`), its
    user message with the row's update (`services.append_locked`)."""
    rows.insert([turn])
    live.turn_counter = turn.number
    also: tuple[str, ...] = ("turn_counter",)
    if held is None:
        # The row is locked and its lease was read free above: it is ours with a new epoch
        # (G2), written with the append's update of the row.
        live.lease_owner = owner
        live.lease_expires_at = now + timedelta(seconds=cfg["LEASE_SECONDS"])
        live.lease_epoch += 1
        held = Lease(live.pk, owner, live.lease_epoch, cfg["LEASE_SECONDS"], confirmed_at=confirmed)
        also = _STARTED_FIELDS
    new, leftovers = start_messages(turn, staged=state.staged)

    def mark(_locked: Session) -> None:
        if leftovers:
            turn_services.staged_inputs_record(pks=[i.pk for i in leftovers], turn=turn)

    appended = services.append_locked(live, new, turn=turn, extra=mark, also=also)
    return Started(turn, held, live, appended, live.generation)
