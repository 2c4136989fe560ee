"""A send's admission (C1, C2, C4, C5, F7, G6): stored before it is acknowledged, and for a
send to an idle dialog, its turn started in the same transaction.

`admit_and_start` locks the dialog's row (and the sender's, for F7) with the queue's counts
in one round trip (`admission_lock.lock_for_admission`), then stages a steer or inject for the
running turn, appends an idle inject to history, queues the turn, or, for a send to an idle
dialog whose lease is free, takes the lease, claims the turn and records its user message,
all in that one transaction (`start_locked`). `admission_batch.admit_and_start_many` does the
same for a burst of sends on PostgreSQL, one transaction per batch. Synchronous, run on the
database threads; the rest of the dialog's queue (claims, stop, retries, checkpoints) is in
`queue`, `turn_controls` and `recovery`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from sessions_app import rows, services, storage, turn_services
from sessions_app.models import MessageKind, Role, Session, StagedInput, Turn, TurnMode, TurnStatus

from . import admission_lock, limits
from .ingress import Ack, Inbound
from .lease import Lease
from .queue import QueueState, Started, check_capacity, enqueue_locked
from .sessions import SessionStates
from .turns.committer import start_messages


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
    dialog's row (turn counter, lease, revision); on PostgreSQL three round trips and the
    COMMIT: psycopg's BEGIN; the dialog's and the owner's rows locked, then the counts (and
    the turn's context, `context_chars`), sent together; the last three writes as one
    statement (`rows.merged`).

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
            admission_lock.context_statement(inbound, session, context_chars)
            if may_start and context_chars is not None
            else None
        )
        live, state = admission_lock.lock_for_admission(
            session.pk, inbound.owner.pk, slot=slot, context=context
        )
        if inbound.accept is not None:
            inbound.accept()
        idle_send = inbound.mode in ("send", "steer") and not state.busy
        if held is not None and state.staged:
            # The worker that holds the lease has not yet dealt with what its last turn
            # left staged (`after_turn.after_turn_staged`): the turn queues behind it, in order.
            idle_send = False
        owner = held.owner if held is not None else start_as
        if owner is not None and idle_send:
            started = start_locked(
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


# The dialog row's fields a started turn changes besides the append's own (`start_locked`).
_STARTED_FIELDS = ("turn_counter", "lease_owner", "lease_expires_at", "lease_epoch")


def start_locked(
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
    # that lock (`admission_lock.lock_for_admission`).
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
