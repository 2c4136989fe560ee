"""Crash recovery (C11, G2): the process's running turns checkpointed in one transaction
(`checkpoint_all`), so a crash keeps their partial text; dialogs with work and no live lease
found for the sweep (`orphaned_sessions`); a turn a dead process left running closed as
interrupted under the new lease (`recover_interrupted`). Synchronous, ORM-only functions, run
on the database threads."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from chatcore.common import publish
from sessions_app import rows, services
from sessions_app.models import Session, Turn, TurnStatus

from . import lease, limits
from .lease import Lease
from .sessions import SessionStates
from .turns.committer import CommitResult, commit_outcome
from .turns.outcome import Failed, FailureKind

logger = logging.getLogger(__name__)


_TURNS = Turn._meta.db_table
_SESSIONS = Session._meta.db_table


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
