"""What a turn leaves for the next one (C4, F7, G2, G6): the one statement run as it ends,
under its lease (`after_turn_read`: whether inputs are staged, turns queued, or another
dialog of its party waits for a slot), the staged inputs it leaves (`after_turn_staged`) and
the held-back dialogs of its party (`waiting_dialogs`). Synchronous, ORM-only functions, run
on the database threads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from sessions_app import rows, services, turn_services
from sessions_app.models import MessageKind, Role, Session, StagedInput, Turn, TurnStatus

from . import lease, limits
from .lease import Lease
from .queue import enqueue_locked
from .sessions import SessionStates
from .turns.committer import CommitResult


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
    transaction that commits the answer (`committer.commit_outcome`'s `after`; on its own
    after an end with nothing to commit): whether anything is staged (`after_turn_staged`
    then has work), whether turns are queued and whether the party has another dialog waiting
    for a slot (`limits.waiting_elsewhere`). With nothing queued or staged the worker has
    nothing to claim (`queue.claim_next`'s read) unless a kick came since, and with no dialog
    waiting there is none to start (`waiting_dialogs`'s query): G6, one statement after a
    turn, not three."""
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


def waiting_dialogs(turn: Turn, *, scope: Any, cfg: dict[str, Any]) -> list[str]:
    """F7: dialogs of the ended turn's party held back by the cap, oldest first."""
    pks = limits.waiting_dialogs(turn, cfg)
    if scope is not None and pks:
        allowed = set(scope(Session.objects.filter(pk__in=pks)).values_list("pk", flat=True))
        pks = [pk for pk in pks if pk in allowed]
    return pks
