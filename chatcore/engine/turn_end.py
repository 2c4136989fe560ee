"""A turn's end, once its runner is done (C3, C9, C10, D1, D2, D4, B4, G2).

`TurnEnds.commit` writes the outcome under the lease the turn ran under (fenced, G2): alone,
or on PostgreSQL with other turns' ends that come at the same time (`Gathered`, G6: a burst's
answers end together), while the turn's snapshots wind down. A commit that fails after every
retry ends the turn failed, never completed (C9, C10). `TurnEnds.announce` then publishes the
answer's `history_delta` and the `turn_updated` terminal as one publish from the loop, after
the turn's last snapshot (D1, D2; no database thread waits on the channel layer), hands the
terminal to an external sink off the turn's path (D4) and schedules the dialog's title when
one is due (B4).

What the dialog's worker does next (what is left after the turn, the next claim, the
lingering lease) is the worker's (`worker.Workers._finish`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from django.db import DatabaseError

from chatcore.common import publish
from chatcore.common.dbthreads import Lane, on_db
from chatcore.common.errors import StorageError
from sessions_app import services, storage
from sessions_app.models import Role, Session, Turn, TurnStatus

from . import after_turn, jobs
from .delivery import DeliveryCoordinator, Terminal
from .gather import Gathered
from .lease import Lease, LeaseLost
from .sessions import SessionStates
from .snapshots import LocalTurn
from .supervisor import TaskSupervisor
from .turns.committer import (
    CommitResult,
    Ending,
    commit_outcome,
    commit_outcomes,
    commit_persistence_failure,
)
from .turns.outcome import Completed, Failed, FailureKind, TurnOutcome, present_failure

logger = logging.getLogger(__name__)


class TurnEnds:
    """The turn ends of one process: their commits (gathered on PostgreSQL) and what goes
    out once each is committed."""

    def __init__(
        self,
        *,
        states: SessionStates,
        supervisor: TaskSupervisor,
        delivery: DeliveryCoordinator,
        schedule_beside: Callable[..., None],
        alone_limit: int,
        writes: Lane | None = None,
    ) -> None:
        """`schedule_beside(job, **kwargs)`: a background job scheduled off the turn's path
        (the title, B4). `writes`: the write lane the commits share with the admissions
        (SQLite), where each commits alone; None (PostgreSQL): the ends of a burst commit
        together, `alone_limit` of them at most going alone while a batch gathers."""
        self.states = states
        self.supervisor = supervisor
        self.delivery = delivery
        self.schedule_beside = schedule_beside
        self.writes = writes
        self.endings: Gathered[Ending, CommitResult] | None = (
            Gathered(
                "turn commits",
                functools.partial(
                    commit_outcomes,
                    states=states,
                    after=lambda e: after_turn.after_turn_statement(e.turn, e.fence),
                    read_after=lambda e, row: after_turn.after_turn_of(row, e.fence),
                ),
                spawn=supervisor.spawn,
                alone_limit=alone_limit,
            )
            if writes is None
            else None
        )

    async def commit(
        self, turn: Turn, session: Session, outcome: TurnOutcome, generation: int, fence: Lease
    ) -> CommitResult | None:
        """Commit `outcome` under `fence`, with what is left after the turn read in the same
        transaction (`CommitResult.after`, G6). None when the lease was lost (G2): the
        dialog's new holder ends the turn, and this process commits, publishes and delivers
        nothing of it."""
        try:
            # A4, G6: the backoff between attempts waits on the loop, not on a database thread.
            alone = functools.partial(
                storage.astorage_retry,
                functools.partial(
                    commit_outcome,
                    turn=turn,
                    outcome=outcome,
                    base_generation=generation,
                    states=self.states,
                    fence=fence,
                    after=lambda: after_turn.after_turn_read(turn, fence),
                ),
                what="turn_commit",
                session=session,
                lane=self.writes,
            )
            # With other turns' ends, in a burst (PostgreSQL).
            return await (
                alone()
                if self.endings is None
                else self.endings(Ending(turn, outcome, generation, fence), alone)
            )
        except StorageError:
            # C9/C10: not saved after every retry: the turn ends failed, not completed.
            try:
                return await on_db(commit_persistence_failure)(turn_pk=turn.pk, fence=fence)
            except LeaseLost:
                logger.error("lost the lease after a turn", extra={"turn_id": str(turn.pk)})
                return None
        except LeaseLost:
            logger.error(
                "lost the lease; the turn's outcome was dropped",
                extra={"turn_id": str(turn.pk), "session_id": session.session_id},
            )
            return None
        except Exception:
            logger.exception("commit failed", extra={"turn_id": str(turn.pk)})
            return CommitResult(
                TurnStatus.FAILED,
                error={
                    "kind": str(FailureKind.TURN_PERSISTENCE),
                    "message": present_failure(FailureKind.TURN_PERSISTENCE),
                },
            )

    async def announce(
        self,
        turn: Turn,
        session: Session,
        outcome: TurnOutcome,
        result: CommitResult,
        local: LocalTurn,
    ) -> None:
        """What goes out once the turn's end is committed: its last snapshot first (D1),
        then its answer's delta and its terminal (D2), the sink's terminal (D4) and, for a
        completed turn, the title when one is due (B4)."""
        if local.drained is not None:
            # D1: the turn's last snapshot reaches its clients before its terminal.
            await local.drained
        if isinstance(outcome, Failed):
            logger.warning(
                "turn failed: %s (%s)",
                outcome.kind,
                outcome.provider_kind or outcome.detail,
                extra={"turn_id": str(turn.pk), "session_id": session.session_id},
            )
        # D2: the answer's delta, then the terminal, as one publish from the loop (the commit
        # publishes nothing: no database thread waits on the channel layer).
        end = [] if result.appended is None else [services.appended_frame(result.appended, turn)]
        end.append(result.updated_frame(session, turn))
        await publish.apublish_all(publish.chat_group(session.channel, session.chat_id), end)
        if local.delivery is not None:
            # D4: the sink's terminal goes out under the engine's supervisor, off the turn's
            # path: the next turn of the dialog does not wait for a slow or broken sink.
            terminal = terminal_for_sink(outcome, result)
            if not self.delivery.finish_later(
                local.delivery, terminal, spawn=self.supervisor.spawn
            ):
                # Shutdown began: the terminal still goes out, once, before the worker ends.
                await local.delivery.finish(terminal)
        if result.status == TurnStatus.COMPLETED:
            await self._title_if_due(turn, session, result)

    async def _title_if_due(self, turn: Turn, session: Session, result: CommitResult) -> None:
        try:
            # B4: on the row the commit locked when it appended messages, else a read.
            stage = (
                jobs.title_due_of(result.appended.session)
                if result.appended is not None
                else await on_db(jobs.title_due)(session_pk=session.pk)
            )
            if stage:
                # The stage travels with the job: a worker may run with other settings.
                self.schedule_beside("generate_title", session_pk=session.pk, stage=stage)
        except DatabaseError:
            # A title is scheduled again after the next turn; the queue must go on.
            logger.warning("could not schedule after-turn jobs", extra={"turn_id": str(turn.pk)})
            await storage.areset_broken_connection()


def terminal_for_sink(outcome: TurnOutcome, result: CommitResult) -> Terminal:
    """What a sink shows at the end (D4). The answer body goes out only for a committed,
    completed turn; a persistence failure never passes on the text from before it."""
    if result.status == TurnStatus.COMPLETED and isinstance(outcome, Completed):
        answers = [
            m.content for m in outcome.messages if m.role == Role.ASSISTANT and not m.tool_calls
        ]
        text = "\n\n".join(a for a in answers if a)
        if result.notice:
            # E5: a cut or withheld answer says so where it is shown.
            text = f"{text}\n\n[{result.notice['message']}]" if text else result.notice["message"]
        return Terminal(status="completed", text=text)
    error = (result.error or {}).get("message", "")
    persisted = result.error is None or result.error.get("kind") != str(
        FailureKind.TURN_PERSISTENCE
    )
    partial = getattr(outcome, "partial", "") if persisted else ""
    status = "cancelled" if result.status == TurnStatus.CANCELLED else "failed"
    return Terminal(status=status, text=partial, error_message=error)
