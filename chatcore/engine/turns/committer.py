"""The turn committer (C9): a generation check, then all of a turn's messages and its
terminal status in one transaction. Completed is published only after that commit; a stale
turn commits nothing; a persistence failure is never reported as completed.

Every write here takes the turn's `Lease` (G2) and checks it in its own transaction: a
process that lost the dialog's lease gets `LeaseLost` and has written nothing."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, transaction

from chatcore.common import events
from chatcore.common.errors import StorageError
from sessions_app import rows, services, storage, turn_services
from sessions_app.models import (
    MessageKind,
    MessageStatus,
    Role,
    Session,
    StagedInput,
    Turn,
    TurnStatus,
)

from ..gather import ALONE
from ..lease import STAGED_INPUTS, Lease
from ..sessions import SessionStates
from .outcome import (
    Cancelled,
    Completed,
    Failed,
    FailureKind,
    PendingMessage,
    Stale,
    TurnOutcome,
    present_failure,
    present_notice,
)

logger = logging.getLogger(__name__)


@dataclass
class CommitResult:
    status: str
    reason: str = ""
    error: dict[str, str] | None = None
    appended: services.Appended | None = None
    # E5: why a completed answer is not whole (`truncated`, `filtered`, `empty`), in words.
    notice: dict[str, str] | None = None
    # What `commit_outcome`'s `after` returned, read in the commit's transaction; None when
    # it did not run there (the caller reads it on its own).
    after: object = None

    def updated_frame(self, session: Session, turn: Turn) -> dict[str, Any]:
        """The `turn_updated` frame of this end of `turn` (D2)."""
        return events.turn_updated_frame(
            session_id=session.session_id,
            turn_id=str(turn.pk),
            status=self.status,
            reason=self.reason,
            error=self.error,
            client_msg_id=turn.client_msg_id,
            notice=self.notice,
        )


def _new(p: PendingMessage) -> services.NewMessage:
    return services.NewMessage(
        role=p.role,
        content=p.content,
        kind=p.kind,
        created_at=p.created_at,
        tool_calls=p.tool_calls,
        tool_call_id=p.tool_call_id,
        tool_name=p.tool_name,
        source=p.source,
        status=p.status,
    )


def _finish_turn(turn_pk: Any, **fields: Any) -> None:
    turn_services.turn_finish(turn_pk=turn_pk, **fields)


def _finish_planned(turn: Turn, plan: _Plan, _session: Session) -> None:
    _finish_turn(turn.pk, status=plan.status, reason=plan.reason, **plan.fields)


def _finish_turn_fenced(turn_pk: Any, fence: Lease | None, **fields: Any) -> None:
    with transaction.atomic():
        if fence is not None:
            fence.check()
        _finish_turn(turn_pk, **fields)


def _finish_turn_durably(
    turn_pk: Any, session: Session | None, fence: Lease | None, **fields: Any
) -> None:
    try:
        storage.storage_retry(
            lambda: _finish_turn_fenced(turn_pk, fence, **fields),
            what="turn_finish",
            session=session,
        )
    except StorageError:
        logger.error(
            "could not record the end of turn %s", turn_pk, extra={"turn_id": str(turn_pk)}
        )


@dataclass
class _Plan:
    """What a turn's end writes: its status, the messages it commits and the turn's fields."""

    status: str
    reason: str
    error: dict[str, str] | None
    notice: dict[str, str] | None
    messages: list[PendingMessage]
    fields: dict[str, Any]

    @classmethod
    def of(cls, outcome: Completed | Cancelled | Failed) -> _Plan:
        """The end of a turn that was not stale."""
        messages = list(outcome.messages)
        if isinstance(outcome, Completed):
            notice = (
                {"kind": outcome.notice, "message": present_notice(outcome.notice)}
                if outcome.notice
                else None
            )
            return cls(
                TurnStatus.COMPLETED,
                outcome.notice,
                None,
                notice,
                messages,
                {"usage": outcome.usage, "model": outcome.model},
            )
        if isinstance(outcome, Cancelled):
            _keep_partial(messages, outcome.partial, MessageStatus.CANCELLED)
            return cls(TurnStatus.CANCELLED, outcome.reason, None, None, messages, {})
        assert isinstance(outcome, Failed)
        error = {
            "kind": str(outcome.kind),
            "message": present_failure(outcome.kind, outcome.provider_kind),
        }
        _keep_partial(messages, outcome.partial, MessageStatus.INTERRUPTED)
        fields = {"error_kind": error["kind"], "error_message": error["message"]}
        return cls(TurnStatus.FAILED, "", error, None, messages, fields)


def _keep_partial(messages: list[PendingMessage], partial: str, status: str) -> None:
    """An interrupted answer's text, kept as a message marked `status` (E5: never an empty
    assistant text)."""
    if partial.strip():
        messages.append(
            PendingMessage(
                role=Role.ASSISTANT, content=partial, kind=MessageKind.ASSISTANT, status=status
            )
        )


def commit_outcome(
    *,
    turn: Turn,
    outcome: TurnOutcome,
    base_generation: int,
    states: SessionStates,
    fence: Lease | None = None,
    after: Callable[[], object] | None = None,
) -> CommitResult:
    """Commit a turn's end. With `fence`, raises `LeaseLost` (having written nothing) when
    the lease was lost. It publishes nothing: the caller announces `result.appended`, then
    the terminal, from wherever it runs (the worker from the event loop, so no database
    thread waits on the channel layer while it holds a connection). `after`: a read run in
    the transaction that commits the turn's messages, after its writes, on the dialog's row
    as the commit locked it (G6: the worker's after-turn read, no trip of its own); its
    value is `result.after` (None when the turn ended without messages to commit)."""
    session_pk = turn.session_id
    if isinstance(outcome, Stale):
        _finish_turn_durably(turn.pk, None, fence, status=TurnStatus.CANCELLED, reason="stale")
        return CommitResult(TurnStatus.CANCELLED, reason="stale")
    plan = _Plan.of(outcome)
    status, reason, error, notice = plan.status, plan.reason, plan.error, plan.notice
    messages, extra_fields = plan.messages, plan.fields

    def finish(session: Session) -> None:
        _finish_turn(turn.pk, status=status, reason=reason, **extra_fields)

    if not messages:
        _finish_turn_durably(turn.pk, None, fence, status=status, reason=reason, **extra_fields)
        return CommitResult(status, reason=reason, error=error, notice=notice)
    found: list[object] = []

    def read_after() -> None:
        assert after is not None
        found[:] = [after()]  # an attempt rolled back and run again reads again

    try:
        appended = services.messages_append(
            session_pk=session_pk,
            session=turn.session,
            messages=[_new(m) for m in messages],
            turn=turn,
            require_generation=base_generation,
            extra=finish,
            guard=fence.guard if fence is not None else None,
            publish_delta=False,
            then=read_after if after is not None else None,
        )
    except services.StaleSession:
        _finish_turn_durably(turn.pk, None, fence, status=TurnStatus.CANCELLED, reason="stale")
        return CommitResult(TurnStatus.CANCELLED, reason="stale")
    except StorageError:
        return commit_persistence_failure(turn_pk=turn.pk, fence=fence)
    states.apply_appended(appended)
    return CommitResult(
        status,
        reason=reason,
        error=error,
        appended=appended,
        notice=notice,
        after=found[0] if found else None,
    )


@dataclass
class Ending:
    """A turn's end, for `commit_outcomes`: `commit_outcome`'s arguments."""

    turn: Turn
    outcome: TurnOutcome
    base_generation: int
    fence: Lease


def commit_outcomes(
    endings: Sequence[Ending],
    *,
    states: SessionStates,
    after: Callable[[Ending], tuple[str, list[Any]]],
    read_after: Callable[[Ending, Sequence[Any] | None], object],
) -> list[CommitResult | object]:
    """`commit_outcome` for many turns' ends at once, on PostgreSQL, in one transaction (G6:
    a burst's answers end together, and their commits queued on the database threads).

    One round trip locks the dialogs' rows, skipping any another transaction holds; one
    sends every turn's writes (`rows.merged`: its messages, the row's update, its end) with
    its after-turn read (`after`'s statement, its row read by `read_after`, as
    `commit_outcome`'s `after`); then the COMMIT. For each ending in order: its
    `CommitResult`, or `ALONE`, for `commit_outcome` to commit on its own after this
    transaction: an end with nothing to commit, a row held elsewhere or gone, a lease lost,
    a dialog cleared or deleted (that call then raises `LeaseLost` or ends the turn stale,
    as for any turn). A database error rolls everything back and leaves every ending
    alone."""
    out: list[CommitResult | object] = [ALONE] * len(endings)
    plans = []
    for i, ending in enumerate(endings):
        if not isinstance(ending.outcome, Stale):
            plan = _Plan.of(ending.outcome)
            if plan.messages:
                plans.append((i, ending, plan))
    if not plans:
        return out
    try:
        done = _commit_together(plans, after=after, read_after=read_after)
    except DatabaseError as exc:
        # Rolled back: nothing of it stays, and each end is committed on its own.
        logger.warning("a batch of %d turn ends failed; each goes alone: %s", len(plans), exc)
        return out
    for i, plan, appended, found in done:
        states.apply_appended(appended)
        out[i] = CommitResult(
            plan.status,
            reason=plan.reason,
            error=plan.error,
            appended=appended,
            notice=plan.notice,
            after=found,
        )
    return out


def _commit_together(
    plans: list[tuple[int, Ending, _Plan]],
    *,
    after: Callable[[Ending], tuple[str, list[Any]]],
    read_after: Callable[[Ending, Sequence[Any] | None], object],
) -> list[tuple[int, _Plan, services.Appended, object]]:
    """`commit_outcomes`'s transaction: the ends it committed, with their after-turn reads."""
    done: list[tuple[int, _Plan, services.Appended, object]] = []
    with transaction.atomic():
        locked = services.lock_sessions_free([str(e.turn.session_id) for _i, e, _p in plans])
        sent = []
        with contextlib.ExitStack() as cursors:
            with rows.pipelined():
                for i, ending, plan in plans:
                    row = locked.pop(str(ending.turn.session_id), None)  # one end per dialog
                    if (
                        row is None
                        or not ending.fence.matches(row)
                        or row.generation != ending.base_generation
                        or row.deleted_at is not None
                    ):
                        continue
                    with rows.merged():
                        appended = services.append_locked(
                            row,
                            [_new(m) for m in plan.messages],
                            turn=ending.turn,
                            extra=functools.partial(_finish_planned, ending.turn, plan),
                        )
                    reading = cursors.enter_context(rows.cursor())
                    reading.execute(*after(ending))
                    sent.append((i, ending, plan, appended, reading))
            # Sent, the statements' results read: the rows of the after-turn reads.
            for i, ending, plan, appended, reading in sent:
                done.append((i, plan, appended, read_after(ending, reading.fetchone())))
    return done


def commit_persistence_failure(*, turn_pk: Any, fence: Lease | None = None) -> CommitResult:
    """C9/C10: the answer could not be saved, so the turn is not reported as completed: it
    ends failed (recorded when the database lets it)."""
    failure = {
        "kind": str(FailureKind.TURN_PERSISTENCE),
        "message": present_failure(FailureKind.TURN_PERSISTENCE),
    }
    _finish_turn_durably(
        turn_pk,
        None,
        fence,
        status=TurnStatus.FAILED,
        error_kind=failure["kind"],
        error_message=failure["message"],
    )
    return CommitResult(TurnStatus.FAILED, error=failure)


def start_messages(
    turn: Turn, *, staged: bool = True
) -> tuple[list[services.NewMessage], list[StagedInput]]:
    """What enters history when `turn` starts (C3, C4): its user message (a send's), then
    the steers an earlier failed turn left staged. Returns the messages and those inputs.
    `staged=False`: the caller knows nothing is staged (no read)."""
    new: list[services.NewMessage] = []
    if turn.mode in ("send", "edit"):
        source = dict(turn.source)
        new.append(
            services.NewMessage(
                role=Role.USER,
                content=turn.content,
                kind=MessageKind.USER_INPUT,
                created_at=turn.received_at,
                # H3: the send's attachments are its message's.
                media_refs=source.pop("attachments", None) or [],
                source=source,
            )
        )
    leftovers = (
        list(
            StagedInput.objects.filter(
                session_id=turn.session_id, status=StagedInput.Status.STAGED
            ).order_by("received_at")
        )
        if staged
        else []
    )
    for item in leftovers:
        new.append(
            services.NewMessage(
                role=Role.USER,
                content=item.content,
                kind=item.mode,
                created_at=item.received_at,
                source=dict(item.source),
            )
        )
    return new, leftovers


def take_staged(
    *, turn: Turn, fence: Lease | None = None, confirmed: bool = False
) -> list[PendingMessage]:
    """Claim the staged steer/inject inputs of the session for this turn's next boundary.

    Most boundaries find nothing staged; that is learnt in a read, beside other dialogs'
    writes (F7: on SQLite a write transaction waits for every other one, and a hundred turns
    ending together would queue their boundaries behind each other's commits). Only staged
    inputs take the write transaction that claims them. `confirmed`: the caller's read
    (`fence.confirm(STAGED_INPUTS)`, or `lease.confirm_all` for many turns) found some."""
    if confirmed:
        staged = True
    elif fence is not None:
        # One statement: the lease still ours, and whether anything is staged.
        staged = fence.confirm(STAGED_INPUTS)
    else:
        staged = StagedInput.objects.filter(
            session_id=turn.session_id, status=StagedInput.Status.STAGED
        ).exists()
    if not staged:
        return []
    with transaction.atomic():
        if fence is not None:
            fence.check()
        items = list(
            StagedInput.objects.select_for_update()
            .filter(session_id=turn.session_id, status=StagedInput.Status.STAGED)
            .order_by("received_at")
        )
        if not items:
            return []
        turn_services.staged_inputs_record(pks=[i.pk for i in items], turn=turn)
    return [
        PendingMessage(
            role=Role.USER,
            content=i.content,
            kind=i.mode,
            created_at=i.received_at,
            source=dict(i.source),
        )
        for i in items
    ]
