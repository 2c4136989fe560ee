"""The durable per-dialog FIFO (C1, C2, C4-C6, C11): its Turn, StagedInput and lease writes
once a send is admitted (the admission itself: `admission`).

Synchronous, ORM-only functions, run by the engine on the database threads (`on_db`): a
queue item's capacity (C2), stop, retry and continue (C6, E5), a dialog's next turn claimed
under its lease (C3, F7), crash recovery (C11), what a turn leaves for the next one, and the
process's checkpoints. Queue changes serialise on the dialog's row lock (`lock_live`);
writes made while running a dialog's queue carry its lease and check its epoch in the same
transaction (G2, `lease.Lease.check`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext as _

from chatcore.common import publish
from chatcore.common.errors import (
    NotFound,
    NothingToContinue,
    NothingToRetry,
    Overloaded,
    QueueFull,
)
from sessions_app import branch_services, rows, selectors, services, storage, turn_services
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
from .ingress import Ack
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
_SESSIONS = Session._meta.db_table


@dataclass
class QueueState:
    """What admission needs to know of a dialog's queue, read with its locked row
    (`admission.lock_for_admission`)."""

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
    passes the queue counts when it read them with the lock,
    `admission.lock_for_admission`)."""
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
            elif last.mode in (TurnMode.EDIT, TurnMode.REGENERATE):
                mode = TurnMode(last.mode)  # H1: a dropped edit or regenerate is retried as one
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
            if cut is None or (live.forked and cut.seq != live.head_seq):  # H1: on the path
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


@dataclass
class Started:
    """A turn admitted, claimed under a freshly acquired lease and with its user message
    recorded, all in the admitting transaction (`admission.admit_and_start`, G6), or claimed
    from the queue with its user message recorded (`claim_next`)."""

    turn: Turn
    lease: Lease
    session: Session
    appended: services.Appended | None
    generation: int
    # The turn's context, read in the admission's first round trip
    # (`admission.lock_for_admission`), for its build; None: the build reads it.
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


def _begin_locked(live: Session, turn: Turn, held: Lease, *, now: Any) -> Started:
    """On the dialog's locked row, under `held`: mark the turn running and record what enters
    history as it starts (C3: its user message; C4: steers an earlier failed turn left)."""
    turn.session = live
    Turn.objects.filter(pk=turn.pk).update(status=TurnStatus.RUNNING, started_at=now)
    turn.status, turn.started_at = TurnStatus.RUNNING, now
    new, leftovers = start_messages(turn)
    # H1: an edit's user message becomes a sibling; a regenerate moves the head back first.
    parent = branch_services.turn_branch_start(live, turn)
    appended = None
    if new:

        def mark(_locked: Session) -> None:
            turn_services.staged_inputs_record(pks=[i.pk for i in leftovers], turn=turn)

        appended = services.append_locked(live, new, turn=turn, extra=mark, parent_seq=parent)
    return Started(turn, held, live, appended, live.generation)


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
        publish.publish_to_chat(session, result.updated_frame(session, turn))
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
        # the same lease: `admission.admit_and_start`, which starts no turn while inputs are
        # staged): what is staged now was staged for it, and it takes it at its first
        # boundary.
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
    """Dialogs with work and no live lease (recovery after a crash, C11).

    Every process's sweep asks this every few seconds, and nearly always finds none: one
    statement in SQL first asks whether any dialog at all has a queued or running turn and
    no live lease, and only then is the query below, with its scope and F7's held-back
    dialogs, compiled and run. Compiling it cost about 2 ms of a database thread's CPU each
    time, beside whatever turns were under way: in a run of 400 sends one after another, one
    of the three slowest first tokens had met the sweep."""
    now = timezone.now()
    if not _unleased_work(now):
        return []
    qs = Session.objects.filter(turns__status__in=(TurnStatus.QUEUED, TurnStatus.RUNNING)).filter(
        Q(lease_owner="") | Q(lease_expires_at__lt=now)
    )
    if scope is not None:
        qs = scope(qs)
    # F7: dialogs of owners at their running-turn cap wait for one of those turns to end.
    qs = limits.not_held_back(qs, cfg)
    return list(qs.values_list("pk", flat=True).distinct()[:100])


def _unleased_work(now: Any) -> bool:
    """Whether any dialog has a queued or running turn and no live lease (`orphaned_sessions`
    finds those of them it may pick up): from the turns' status index, in SQL."""
    with rows.cursor() as cursor:
        cursor.execute(
            f'SELECT 1 FROM "{_TURNS}" t INNER JOIN "{_SESSIONS}" s ON s."id" = t."session_id"'  # noqa: S608
            ' WHERE t."status" IN (%s, %s)'
            ' AND (s."lease_owner" = %s OR s."lease_expires_at" IS NULL'
            ' OR s."lease_expires_at" < %s) LIMIT 1',
            [
                TurnStatus.QUEUED,
                TurnStatus.RUNNING,
                "",
                connection.ops.adapt_datetimefield_value(now),
            ],
        )
        return cursor.fetchone() is not None


def waiting_dialogs(turn: Turn, *, scope: Any, cfg: dict[str, Any]) -> list[str]:
    """F7: dialogs of the ended turn's party held back by the cap, oldest first."""
    pks = limits.waiting_dialogs(turn, cfg)
    if scope is not None and pks:
        allowed = set(scope(Session.objects.filter(pk__in=pks)).values_list("pk", flat=True))
        pks = [pk for pk in pks if pk in allowed]
    return pks
