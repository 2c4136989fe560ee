"""The durable per-dialog FIFO (C1-C3, F7): its Turn and lease writes once a send is admitted
(the admission itself: `admission`).

Synchronous, ORM-only functions, run by the engine on the database threads (`on_db`): a
queue item appended within its capacity (C2), a dialog's next turn claimed under its lease
(C3, F7). Queue changes serialise on the dialog's row lock (`lock_live`); writes made while
running a dialog's queue carry its lease and check its epoch in the same transaction (G2,
`lease.Lease.check`). Beside it: stop, retry and continue (`turn_controls`), what a turn
leaves for the next one (`after_turn`), checkpoints and crash recovery (`recovery`).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext as _

from chatcore.common.errors import NotFound, Overloaded, QueueFull
from sessions_app import branch_services, selectors, services, storage, turn_services
from sessions_app.models import Session, Turn, TurnMode, TurnStatus

from . import lease, limits
from .lease import Lease, LeaseLost
from .sessions import SessionStates
from .turns.builder import PreparedInput
from .turns.committer import start_messages

if TYPE_CHECKING:
    from .turns.runner import FirstRequest, OpenedRequest

# `claim_next`: the dialog has queued turns but its owner has no free slot (F7).
HELD_BACK = object()


def lock_live(session_pk: str) -> Session:
    """Lock a live dialog's row for this transaction (queue changes serialise on it)."""
    live = services.lock_session(session_pk)
    if live is None or live.deleted_at is not None:
        raise NotFound(_("Dialog not found."))
    return live


@dataclass
class QueueState:
    """What admission needs to know of a dialog's queue, read with its locked row
    (`admission_lock.lock_for_admission`)."""

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
    `admission_lock.lock_for_admission`)."""
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
    # (`admission_lock.lock_for_admission`), for its build; None: the build reads it.
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
