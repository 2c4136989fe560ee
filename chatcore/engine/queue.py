"""The durable per-dialog FIFO (C1, C2, C4-C6, C11): every Turn, StagedInput and lease write.

Synchronous, ORM-only functions, run by the engine on the database threads (`on_db`). Queue changes
serialise on the dialog's row lock (`lock_live`); writes made while running a dialog's queue
carry its lease and check its epoch in the same transaction (G2, `lease.Lease.check`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.contrib.auth.models import User
from django.db import DatabaseError, connection, transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext as _

from chatcore.common import events, publish
from chatcore.common.errors import (
    NotFound,
    NothingToContinue,
    NothingToRetry,
    Overloaded,
    QueueFull,
)
from sessions_app import rows, selectors, services, storage, turn_services
from sessions_app.models import (
    Message,
    MessageKind,
    MessageStatus,
    Role,
    Session,
    StagedInput,
    Turn,
    TurnMode,
    TurnStatus,
)

from . import lease, limits
from .gather import ALONE
from .ingress import Ack, Inbound
from .lease import Lease, LeaseLost
from .sessions import SessionStates
from .turns.builder import CONTINUE_INSTRUCTION, PreparedInput
from .turns.committer import CommitResult, commit_outcome, start_messages
from .turns.outcome import Failed, FailureKind, Notice, PendingMessage

if TYPE_CHECKING:
    from .turns.runner import FirstRequest, OpenedRequest

logger = logging.getLogger(__name__)

# `claim_next`: the dialog has queued turns but its owner has no free slot (F7).
HELD_BACK = object()


def lock_live(session_pk: str) -> Session:
    """Lock a live dialog's row for this transaction (queue changes serialise on it)."""
    live = services.lock_session(session_pk)
    if live is None or live.deleted_at is not None:
        raise NotFound(_("Dialog not found."))
    return live


_TURNS = Turn._meta.db_table
_STAGED = StagedInput._meta.db_table
_SESSIONS = Session._meta.db_table
_USERS = User._meta.db_table
_USER_PK = User._meta.pk.column
# A live dialog's row by id, aliased `s`.
_LIVE = f'"{_SESSIONS}" s WHERE s."id" = %s AND s."deleted_at" IS NULL'


@dataclass
class QueueState:
    """What admission needs to know of a dialog's queue, read with its locked row."""

    queued: int  # the dialog's queued turns
    running: int  # its running turns (0 or 1)
    staged: bool  # inputs staged for a turn (C4/C5)
    queued_everywhere: int  # queued turns of every dialog (C2's global bound)
    # F7's counts for a turn the send would start (`limits.slot_columns`), when asked for.
    slot: tuple[int, int] | None = None
    # The turn's context (`selectors.turn_context`), read in the lock's round trip, ahead
    # of it, when asked for.
    context: selectors.TurnContext | None = None

    @property
    def busy(self) -> bool:
        return bool(self.queued or self.running)


def lock_for_admission(
    session_pk: str,
    owner_id: int,
    *,
    slot: tuple[str, str, Any] | None = None,
    context: selectors.TurnContextStatement | None = None,
    alongside: Callable[[], None] | None = None,
) -> tuple[Session, QueueState]:
    """`lock_live`, with the dialog's queue counts (G6: admission costs one read, whatever it
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
    (`builder.admitted_context`). `alongside`: run once these statements are on their way,
    while the server works on them (the send-rate charge's write, `limits.PendingCharge`)."""
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
                    if alongside is not None:
                        alongside()  # the statements are sent: they run meanwhile
                found = cursor.fetchone()
                if found is not None:
                    row = (*found, *counting.fetchone())
                    if context is not None:
                        read = context.result(reading.fetchall())
        else:
            if alongside is not None:
                alongside()
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
    counts = (
        f'(SELECT COUNT(*) FROM "{_TURNS}" t WHERE t."session_id" = s."id"'  # noqa: S608
        ' AND t."status" = %s) AS "q_queued",'
        f' (SELECT COUNT(*) FROM "{_TURNS}" t WHERE t."session_id" = s."id"'
        ' AND t."status" = %s) AS "q_running",'
        f' (SELECT COUNT(*) FROM "{_STAGED}" i WHERE i."session_id" = s."id"'
        ' AND i."status" = %s) AS "q_staged",'
        f' (SELECT COUNT(*) FROM "{_TURNS}" t WHERE t."status" = %s) AS "q_all"'
    )
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


def enqueue_locked(
    session: Session,
    *,
    cfg: dict[str, Any],
    owner_id: int,
    content: str,
    client_msg_id: str,
    source: dict[str, Any],
    received_at: Any,
    mode: str = TurnMode.SEND,
    retry_of: Turn | None = None,
    state: QueueState | None = None,
) -> Turn:
    """Append a queue item; the caller holds the session row lock in a transaction (and
    passes the queue counts when it read them with the lock, `lock_for_admission`)."""
    check_capacity(session, cfg, state)
    Session.objects.filter(pk=session.pk).update(turn_counter=session.turn_counter + 1)
    session.turn_counter += 1
    return Turn.objects.create(
        session_id=session.pk,
        owner_id=owner_id,
        number=session.turn_counter,
        mode=mode,
        content=content,
        client_msg_id=client_msg_id,
        source=source,
        received_at=received_at,
        retry_of=retry_of,
    )


def check_capacity(session: Session, cfg: dict[str, Any], state: QueueState | None) -> None:
    """C2: the dialog's queue and the queues of all dialogs have room for one more turn."""
    if state is not None:
        queued, everywhere = state.queued, state.queued_everywhere
    else:
        queued = Turn.objects.filter(session_id=session.pk, status=TurnStatus.QUEUED).count()
        everywhere = Turn.objects.filter(status=TurnStatus.QUEUED).count()
    if queued >= cfg["QUEUE_CAPACITY"]:
        raise QueueFull()
    if everywhere >= cfg["GLOBAL_ADMISSION_BOUND"]:
        raise Overloaded()


def position(turn: Turn) -> int:
    """How many turns of the dialog are ahead of this one (0 = runs now)."""
    return (
        Turn.objects.filter(session_id=turn.session_id)
        .filter(Q(status=TurnStatus.RUNNING) | Q(status=TurnStatus.QUEUED, number__lt=turn.number))
        .count()
    )


# --- admission (C1, C2, C4, C5) ------------------------------------------------------------


@dataclass
class Started:
    """A turn admitted, claimed under a freshly acquired lease and with its user message
    recorded, all in the admitting transaction (`admit_and_start`, G6)."""

    turn: Turn
    lease: Lease
    session: Session
    appended: services.Appended | None
    generation: int
    # The turn's context, read in the admission's first round trip (`lock_for_admission`),
    # for its build; None: the build reads it.
    context: selectors.TurnContext | None = None
    # The turn's input, being built from that read while the admission commits
    # (`Engine.submit`); None (or a None result): the worker builds it.
    prepared: concurrent.futures.Future[PreparedInput | None] | None = None
    # Its first model request, sent once the admission committed and the input was built,
    # for the worker's runner to take (`Workers.open_first_request`); `may_open` is False
    # from the moment the worker went past the point of taking it. Both on the event loop.
    opened: OpenedRequest | None = None
    may_open: bool = True
    # That request made with the input, on the build's thread (`Engine._prepare_early`):
    # what it asks for, and the provider's request made ahead (`prepare_request`); None:
    # made on the loop when it is sent.
    first_request: tuple[FirstRequest, Any] | None = None


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
    charge: limits.PendingCharge | None = None,
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

    `charge`: the send-rate charge (`limits.PendingCharge`), written to Redis once the lock's
    statements are on their way and read last inside the transaction, its refusal rolling
    everything back. `on_started`: called with the started turn as soon as it is decided,
    before that read and the COMMIT (the turn's input built meanwhile, `Engine.submit`); a
    `Started` of an attempt that did not commit is never returned, so what was made for it
    goes unused. `context_chars`: for a send that may start its turn, the turn's context is
    read in the lock's round trip, its window `context_chars` characters at most
    (`Started.context`, for its build)."""

    def write() -> tuple[Ack, services.Appended | None, Started | None]:
        with transaction.atomic():
            admitted = decide()
            if on_started is not None and admitted[2] is not None:
                on_started(admitted[2])
            if charge is not None:
                charge.wait()
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
        # The charge is written once the first statements are on their way: its round trip
        # beside theirs.
        live, state = lock_for_admission(
            session.pk,
            inbound.owner.pk,
            slot=slot,
            context=context,
            alongside=charge.send if charge is not None else None,
        )
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

    try:
        ack, appended, started = storage.storage_retry(write, what="admit", session=session)
    finally:
        if charge is not None:
            charge.settle()  # read, when the transaction ended before it was
    if appended is not None:
        states.apply_appended(appended)
    return ack, started


@dataclass
class Admission:
    """One send of a batch admitted together (`admit_and_start_many`): a send or steer that
    may start its turn under a new lease for `start_as` (no lingering worker's lease, no
    chat app's `accept`). `charge`, `on_started` and `context_chars` as for
    `admit_and_start`."""

    inbound: Inbound
    session: Session
    start_as: str
    charge: limits.PendingCharge | None = None
    on_started: Callable[[Started], None] | None = None
    context_chars: int | None = None


# `admit_and_start_many`'s outcome of one send: its ack and started turn, its own error, or
# `ALONE` (it is admitted on its own, `admit_and_start`, after the batch).
AdmissionOutcome = tuple[Ack, Started] | BaseException | object


def admit_and_start_many(
    batch: list[Admission], *, cfg: dict[str, Any], states: SessionStates
) -> list[AdmissionOutcome]:
    """`admit_and_start` for many sends to idle dialogs at once, on PostgreSQL, in one
    transaction (G6: a burst's admissions cost a few transactions, not one each). The
    batch's dialogs and its senders are distinct (one send of each per batch, the caller's
    rule).

    One round trip reads the sends' turn contexts, locks the dialogs' rows, then the
    senders' rows, skipping any row another transaction holds, and reads every dialog's queue
    and F7 counts after those locks; the batch's send-rate charges go to Redis meanwhile. A
    batch never waits for a lock, so it is never part of a circle of transactions waiting
    on each other (a lease renewal locks many dialogs in the order it finds them, another
    process's batch locks its own), and one contended row holds up no other send of the
    batch: the send whose dialog or sender was skipped goes alone, and waits there. Then
    each started turn's writes are its one statement (`rows.merged`), all held to go with
    the COMMIT.

    A send that does not start there and then (its row held elsewhere, a dialog busy or
    gone, a lease live elsewhere, inputs staged, no free slot, a full queue) is left alone
    (`ALONE`): the
    caller admits it on its own after this transaction, which refuses or queues it exactly
    as for any send. A refused send-rate charge is that send's error, and the others go on;
    an error of the transaction itself leaves every send to go alone (with its retries)."""
    outcomes: list[AdmissionOutcome] = [ALONE] * len(batch)

    def write() -> list[tuple[int, Ack, Started]]:
        done: list[tuple[int, Ack, Started]] = []
        with transaction.atomic():
            confirmed = time.monotonic()
            # The batch's charges in one write, their round trip beside the locks'.
            found = _lock_many(batch, alongside=lambda: limits.send_together(charges))
            for i, admission in enumerate(batch):
                # Its writes one statement (`rows.merged`), held to go with the COMMIT.
                started = _start_one(admission, found, cfg=cfg, confirmed=confirmed)
                if isinstance(started, Exception):
                    outcomes[i] = started
                elif started is not None:
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

    charges = [a.charge for a in batch if a.charge is not None]
    try:
        done = write()
    except DatabaseError as exc:
        # Rolled back: nothing of it stays, and each send is admitted on its own.
        logger.warning("a batch of %d admissions failed; each goes alone: %s", len(batch), exc)
        return outcomes
    finally:
        for charge in charges:
            charge.settle()  # read, for those the batch did not get to
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
) -> Started | Exception | None:
    """`admit_and_start_many`'s start of one send on its locked row: the started turn, the
    send's refused charge, or None (it goes alone)."""
    got = found.get(str(admission.session.pk))
    if got is None:
        return None  # gone: refused on its own (NotFound)
    live, state = got
    if state.busy or state.staged:
        return None
    if admission.charge is not None:
        try:
            # Before its writes (a refusal leaves nothing of it behind); written with the
            # batch's first statements, so it is back by now.
            admission.charge.wait()
        except Exception as exc:  # noqa: BLE001 (the send's own refusal or error)
            return exc
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


def _lock_many(
    batch: list[Admission], *, alongside: Callable[[], None] | None = None
) -> dict[str, tuple[Session, QueueState]]:
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
            if alongside is not None:
                alongside()  # the statements are sent: they run meanwhile
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


def _begin_locked(live: Session, turn: Turn, held: Lease, *, now: Any) -> Started:
    """On the dialog's locked row, under `held`: mark the turn running and record what enters
    history as it starts (C3: its user message; C4: steers an earlier failed turn left)."""
    turn.session = live
    Turn.objects.filter(pk=turn.pk).update(status=TurnStatus.RUNNING, started_at=now)
    turn.status, turn.started_at = TurnStatus.RUNNING, now
    new, leftovers = start_messages(turn)
    appended = None
    if new:

        def mark(_locked: Session) -> None:
            turn_services.staged_inputs_record(pks=[i.pk for i in leftovers], turn=turn)

        appended = services.append_locked(live, new, turn=turn, extra=mark)
    return Started(turn, held, live, appended, live.generation)


# --- stop / retry / continue (C6, E5) ------------------------------------------------------


def stop(session: Session) -> tuple[Turn | None, list[Turn]]:
    """Flag the running turn for cancel, drop unstarted sends and staged steers."""

    def write() -> tuple[Turn | None, list[Turn]]:
        with transaction.atomic():
            Session.objects.select_for_update().filter(pk=session.pk).first()
            now = timezone.now()
            running = Turn.objects.filter(session_id=session.pk, status=TurnStatus.RUNNING).first()
            if running is not None:
                Turn.objects.filter(pk=running.pk).update(cancel_requested=True)
            dropped = list(Turn.objects.filter(session_id=session.pk, status=TurnStatus.QUEUED))
            Turn.objects.filter(pk__in=[t.pk for t in dropped]).update(
                status=TurnStatus.CANCELLED, reason="dropped", finished_at=now
            )
            StagedInput.objects.filter(
                session_id=session.pk,
                status=StagedInput.Status.STAGED,
                mode=StagedInput.Mode.STEER,
            ).update(status=StagedInput.Status.DROPPED)
            return running, dropped

    return storage.storage_retry(write, what="stop", session=session)


def request_cancel(turn_pk: Any) -> None:
    """C6 fallback: the turn's process sees the flag at its next checkpoint."""
    Turn.objects.filter(pk=turn_pk).update(cancel_requested=True)


def enqueue_retry(
    session: Session, *, owner_id: int, client_msg_id: str, cfg: dict[str, Any]
) -> Ack:
    """C6: re-run the last failed or cancelled turn as a new turn, without adding its user
    message again (a send dropped before it started never had one, so it gets it)."""

    def write() -> Ack:
        with transaction.atomic():
            live = lock_live(session.pk)
            last = Turn.objects.filter(session_id=session.pk).order_by("-number").first()
            if last is None or last.status not in (TurnStatus.FAILED, TurnStatus.CANCELLED):
                raise NothingToRetry()
            if last.reason == "stale":
                raise NothingToRetry()
            started = last.started_at is not None
            if started:
                mode = TurnMode.RETRY
            else:
                # A dropped continuation is retried as one (it has no user message).
                mode = TurnMode.CONTINUE if last.source.get("continues") else TurnMode.SEND
            turn = enqueue_locked(
                live,
                cfg=cfg,
                owner_id=owner_id,
                content=last.content,
                client_msg_id=client_msg_id,
                source=dict(last.source, retry_of=str(last.pk)),
                received_at=timezone.now() if started else last.received_at,
                mode=mode,
                retry_of=last,
            )
            return Ack(live, str(turn.pk), position(turn), "retry", client_msg_id)

    return storage.storage_retry(write, what="retry", session=session)


def enqueue_continue(
    session: Session, *, owner_id: int, client_msg_id: str, cfg: dict[str, Any]
) -> Ack:
    """E5: a `continue` turn that goes on with the last answer cut at its length limit."""

    def write() -> Ack:
        with transaction.atomic():
            live = lock_live(session.pk)
            cut = continuable_answer(session.pk)
            if cut is None:
                raise NothingToContinue()
            turn = enqueue_locked(
                live,
                cfg=cfg,
                owner_id=owner_id,
                content="",
                client_msg_id=client_msg_id,
                source={"continues": str(cut.pk)},
                received_at=timezone.now(),
                mode=TurnMode.CONTINUE,
            )
            return Ack(live, str(turn.pk), position(turn), "continue", client_msg_id)

    return storage.storage_retry(write, what="continue", session=session)


def continuable_answer(session_pk: str) -> Message | None:
    """E5: the cut answer a `continue` goes on with: the last turn of the dialog completed
    with a `truncated` answer and nothing was queued after it."""
    last = Turn.objects.filter(session_id=session_pk).order_by("-number").first()
    if last is None or last.status != TurnStatus.COMPLETED or last.reason != Notice.TRUNCATED:
        return None
    return (
        Message.objects.filter(
            session_id=session_pk,
            turn=last,
            role=Role.ASSISTANT,
            status=MessageStatus.TRUNCATED,
        )
        .order_by("-seq")
        .first()
    )


def continuation(turn: Turn) -> tuple[str | None, list[PendingMessage]]:
    """The cut message a continue turn (or the retry of one) goes on with, and its model-only
    instruction; (None, []) for other turns."""
    continues = turn.source.get("continues") if turn.mode != TurnMode.SEND else None
    if not continues:
        return None, []
    instruction = PendingMessage(role=Role.USER, content=CONTINUE_INSTRUCTION, kind="continue")
    return str(continues), [instruction]


# --- running the queue (C1, C3, C11, F7) ---------------------------------------------------


def acquire_lease(session_pk: str, *, owner: str, cfg: dict[str, Any]) -> Lease | None:
    """Take a free or expired lease with a new epoch. Not re-entrant: two workers of one
    process never run the same dialog, and a live lease of another process is never stolen
    (C11)."""
    return lease.acquire(session_pk, owner=owner, seconds=cfg["LEASE_SECONDS"])


def renew_leases(held: list[Lease]) -> list[Lease]:
    """Extend all the given leases in one statement; the ones another process took over
    come back, marked lost (G2)."""
    return lease.renew_all(held)


def release_lease(held: Lease) -> None:
    """Give the lease up (only our own epoch: a successor's lease is never cleared)."""
    lease.release(held)


def release_if_idle(held: Lease) -> bool:
    """Give the lease up unless a turn is queued (one statement, `lease.release_if_idle`)."""
    return lease.release_if_idle(held)


def claim_next(
    session_pk: str, held: Lease, *, cfg: dict[str, Any], states: SessionStates
) -> Started | object | None:
    """Start the dialog's next queued turn under `held`, in one transaction (G6): lock the
    dialog's row and check the lease on it (G2), take the oldest queued turn when its owner
    has a free slot (F7), mark it running and record its user message (C3). None when the
    queue is empty (or the dialog was deleted), `HELD_BACK` when the owner already runs the
    most turns allowed."""

    def claim() -> Started | object | None:
        # Most claims after a turn find the queue empty: learnt in a read, with the lease
        # (G2), beside other dialogs' writes (on SQLite, without the write lock).
        if not held.confirm(lease.QUEUED_TURNS):
            return None
        with transaction.atomic():
            live = services.lock_session(session_pk)
            if live is None:
                held.lost = True
                raise LeaseLost(session_pk)
            held.guard(live)
            if live.deleted_at is not None:
                return None
            turn = (
                Turn.objects.filter(session_id=session_pk, status=TurnStatus.QUEUED)
                .select_related("owner")
                .order_by("number")
                .first()
            )
            if turn is None:
                return None
            turn.session = live
            limits.lock_owner(turn.owner_id)
            if not limits.turn_may_start(turn, cfg):
                return HELD_BACK
            return _begin_locked(live, turn, held, now=timezone.now())

    claimed = storage.storage_retry(claim, what="claim")
    if isinstance(claimed, Started) and claimed.appended is not None:
        states.apply_appended(claimed.appended)
    return claimed


def recover_interrupted(
    session_pk: str, held: Lease, *, states: SessionStates, running_here: set[str]
) -> list[tuple[Turn, CommitResult]]:
    """C11: a turn still marked running while we hold a fresh lease belonged to a process
    that died. Close it as failed (`interrupted`), keeping its checkpointed partial."""
    results = []
    for turn in Turn.objects.filter(
        session_id=session_pk, status=TurnStatus.RUNNING
    ).select_related("session"):
        if str(turn.pk) in running_here:
            continue
        outcome = Failed(FailureKind.INTERRUPTED, detail="process died", partial=turn.partial_text)
        session = turn.session
        result = commit_outcome(
            turn=turn,
            outcome=outcome,
            base_generation=session.generation,
            states=states,
            fence=held,
        )
        logger.warning(
            "closed an interrupted turn",
            extra={"turn_id": str(turn.pk), "session_id": session.session_id},
        )
        if result.appended is not None:
            services.announce_appended(result.appended, turn)
        publish.publish_to_chat(
            session,
            events.turn_updated_frame(
                session_id=session.session_id,
                turn_id=str(turn.pk),
                status=result.status,
                reason=result.reason,
                error=result.error,
                client_msg_id=turn.client_msg_id,
            ),
        )
        results.append((turn, result))
    return results


@dataclass(frozen=True)
class AfterTurn:
    """What the after-turn read found (`after_turn_read`): whether inputs are staged,
    whether the dialog may have turns to claim, and whether another dialog of the turn's
    party waits for a slot (F7)."""

    staged: bool
    queued: bool
    party_waiting: bool


def after_turn_read(turn: Turn, fence: Lease) -> AfterTurn:
    """At a turn's end, in the statement that checks the lease (G2), run last in the
    transaction that commits the answer (`commit_outcome`'s `after`; on its own after an end
    with nothing to commit): whether anything
    is staged (`after_turn_staged` then has work), whether turns are queued and whether the
    party has another dialog waiting for a slot (`limits.waiting_elsewhere`). With nothing
    queued or staged the worker has nothing to claim (`claim_next`'s read) unless a kick
    came since, and with no dialog waiting there is none to start (`waiting_dialogs`'s
    query): G6, one statement after a turn, not three."""
    sql, params = after_turn_statement(turn, fence)
    with rows.cursor() as cursor:
        cursor.execute(sql, params)
        return after_turn_of(cursor.fetchone(), fence)


def after_turn_statement(turn: Turn, fence: Lease) -> tuple[str, list[Any]]:
    """`after_turn_read`'s statement, for a batch of turn ends that sends it with its writes
    (`committer.commit_outcomes`); `after_turn_of` reads its row."""
    return fence.waiting_statement(
        lease.STAGED_INPUTS, lease.QUEUED_TURNS, also=[limits.waiting_elsewhere(turn)]
    )


def after_turn_of(row: Sequence[Any] | None, fence: Lease) -> AfterTurn:
    """`after_turn_read`'s answer from its statement's row (None: `LeaseLost`)."""
    staged, queued, party_waiting = fence.waiting_row(row)
    return AfterTurn(staged=staged, queued=queued or staged, party_waiting=party_waiting)


def after_turn_staged(
    turn: Turn, result: CommitResult, fence: Lease, *, states: SessionStates, cfg: dict[str, Any]
) -> None:
    """Inputs staged after the last boundary are never lost: injects enter history now;
    steers after a completed turn become sends (C4: when idle, steer is a send); after a
    failure steers stay staged for the next send or retry; a stop dropped them. Run when
    `after_turn_read` found some."""
    if lease.RUNNING_TURNS.of(turn.session_id):
        # The next turn already runs (a send that came as this one ended, started under
        # the same lease: `admit_and_start`, which starts no turn while inputs are staged):
        # what is staged now was staged for it, and it takes it at its first boundary.
        return
    staged = list(
        StagedInput.objects.filter(
            session_id=turn.session_id, status=StagedInput.Status.STAGED
        ).order_by("received_at")
    )
    if not staged:
        return
    injects = [s for s in staged if s.mode == StagedInput.Mode.INJECT]
    if injects and result.reason != "stale":
        appended = services.messages_append(
            session_pk=turn.session_id,
            session=turn.session,
            messages=[
                services.NewMessage(
                    role=Role.USER,
                    content=i.content,
                    kind=MessageKind.INJECT,
                    created_at=i.received_at,
                    source=dict(i.source),
                )
                for i in injects
            ],
            extra=lambda _s: turn_services.staged_inputs_record(pks=[i.pk for i in injects]),
            guard=fence.guard,
        )
        states.apply_appended(appended)
    if result.status == TurnStatus.COMPLETED:
        with transaction.atomic():
            fence.check()
            session = Session.objects.get(pk=turn.session_id)
            for s in staged:
                if s.mode != StagedInput.Mode.STEER:
                    continue
                enqueue_locked(
                    session,
                    cfg=cfg,
                    owner_id=turn.owner_id,
                    content=s.content,
                    client_msg_id=s.client_msg_id,
                    source=dict(s.source),
                    received_at=s.received_at,
                )
                StagedInput.objects.filter(pk=s.pk).update(status=StagedInput.Status.RECORDED)


@dataclass
class Checkpoint:
    """One running turn in a checkpoint pass: its partial text when it changed since its
    last checkpoint (None: unchanged), and the lease it runs under."""

    turn_id: str
    text: str | None
    held: Lease | None


@dataclass
class CheckpointPass:
    """What a pass found: turns whose lease was taken over (nothing was written for them)
    and turns with a stop requested from elsewhere."""

    lost: set[str]
    cancel: set[str]


# Turns per UPDATE/SELECT of a pass (two or three parameters each, under SQLite's 999).
CHECKPOINT_CHUNK = 300


def checkpoint_all(items: list[Checkpoint]) -> CheckpointPass:
    """C11, G2: checkpoint every running turn of the process in one transaction with a
    constant number of statements (one of each per CHECKPOINT_CHUNK turns): lock the leased
    sessions still held at their epochs (`lease.check_all`), write the changed partial texts
    in one UPDATE (a CASE on the turn id) of running turns that passed the fence, and read
    which of them have a stop requested from elsewhere."""
    with transaction.atomic():
        lease.check_all(i.held for i in items if i.held is not None)
        lost = {i.turn_id for i in items if i.held is not None and i.held.lost}
        live = [i for i in items if i.turn_id not in lost]
        changed = [i for i in live if i.text is not None]
        # Every second for every running turn of the process: written in SQL (compiling a
        # CASE of hundreds of branches cost more than running it).
        turn_id = Turn._meta.pk
        assert turn_id is not None
        for start in range(0, len(changed), CHECKPOINT_CHUNK):
            part = changed[start : start + CHECKPOINT_CHUNK]
            ids = [turn_id.get_db_prep_value(i.turn_id, connection) for i in part]
            marks = ", ".join(["%s"] * len(part))
            sql = (
                f'UPDATE "{_TURNS}" SET "partial_text" = CASE "id"'  # noqa: S608
                f' {" ".join(["WHEN %s THEN %s"] * len(part))} ELSE "partial_text" END'
                f' WHERE "id" IN ({marks}) AND "status" = %s'
            )
            params = [v for pk, i in zip(ids, part, strict=True) for v in (pk, i.text)]
            with rows.cursor() as cursor:
                cursor.execute(sql, [*params, *ids, TurnStatus.RUNNING])
        cancel: set[str] = set()
        for start in range(0, len(live), CHECKPOINT_CHUNK):
            ids = [
                turn_id.get_db_prep_value(i.turn_id, connection)
                for i in live[start : start + CHECKPOINT_CHUNK]
            ]
            sql = (
                f'SELECT "id" FROM "{_TURNS}"'  # noqa: S608
                f' WHERE "id" IN ({", ".join(["%s"] * len(ids))}) AND "cancel_requested" = %s'
            )
            with rows.cursor() as cursor:
                cursor.execute(sql, [*ids, True])
                cancel.update(str(turn_id.to_python(pk)) for (pk,) in cursor.fetchall())
    return CheckpointPass(lost=lost, cancel=cancel)


def orphaned_sessions(*, scope: Any, cfg: dict[str, Any]) -> list[str]:
    """Dialogs with work and no live lease (recovery after a crash, C11)."""
    now = timezone.now()
    qs = Session.objects.filter(turns__status__in=(TurnStatus.QUEUED, TurnStatus.RUNNING)).filter(
        Q(lease_owner="") | Q(lease_expires_at__lt=now)
    )
    if scope is not None:
        qs = scope(qs)
    # F7: dialogs of owners at their running-turn cap wait for one of those turns to end.
    qs = limits.not_held_back(qs, cfg)
    return list(qs.values_list("pk", flat=True).distinct()[:100])


def waiting_dialogs(turn: Turn, *, scope: Any, cfg: dict[str, Any]) -> list[str]:
    """F7: dialogs of the ended turn's party held back by the cap, oldest first."""
    pks = limits.waiting_dialogs(turn, cfg)
    if scope is not None and pks:
        allowed = set(scope(Session.objects.filter(pk__in=pks)).values_list("pk", flat=True))
        pks = [pk for pk in pks if pk in allowed]
    return pks
