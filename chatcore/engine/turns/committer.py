"""The turn committer (C9): a generation check, then all of a turn's messages and its
terminal status in one transaction. Completed is published only after that commit; a stale
turn commits nothing; a persistence failure is never reported as completed.

Every write here takes the turn's `Lease` (G2) and checks it in its own transaction: a
process that lost the dialog's lease gets `LeaseLost` and has written nothing."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from chatcore.common.errors import StorageError
from sessions_app import services, storage, turn_services
from sessions_app.models import (
    MessageKind,
    MessageStatus,
    Role,
    Session,
    StagedInput,
    Turn,
    TurnStatus,
)

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

    messages = list(outcome.messages)
    notice = None
    if isinstance(outcome, Completed):
        status, reason, error = TurnStatus.COMPLETED, outcome.notice, None
        extra_fields: dict[str, Any] = {"usage": outcome.usage}
        if outcome.notice:
            notice = {"kind": outcome.notice, "message": present_notice(outcome.notice)}
    elif isinstance(outcome, Cancelled):
        status, reason, error = TurnStatus.CANCELLED, outcome.reason, None
        extra_fields = {}
        if outcome.partial.strip():  # E5: never an empty assistant text
            messages.append(
                PendingMessage(
                    role=Role.ASSISTANT,
                    content=outcome.partial,
                    kind=MessageKind.ASSISTANT,
                    status=MessageStatus.CANCELLED,
                )
            )
    else:
        assert isinstance(outcome, Failed)
        status, reason = TurnStatus.FAILED, ""
        error = {
            "kind": str(outcome.kind),
            "message": present_failure(outcome.kind, outcome.provider_kind),
        }
        extra_fields = {"error_kind": str(outcome.kind), "error_message": error["message"]}
        if outcome.partial.strip():  # E5: never an empty assistant text
            messages.append(
                PendingMessage(
                    role=Role.ASSISTANT,
                    content=outcome.partial,
                    kind=MessageKind.ASSISTANT,
                    status=MessageStatus.INTERRUPTED,
                )
            )

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
    if turn.mode == "send":
        new.append(
            services.NewMessage(
                role=Role.USER,
                content=turn.content,
                kind=MessageKind.USER_INPUT,
                created_at=turn.received_at,
                source=dict(turn.source),
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


def take_staged(*, turn: Turn, fence: Lease | None = None) -> list[PendingMessage]:
    """Claim the staged steer/inject inputs of the session for this turn's next boundary.

    Most boundaries find nothing staged; that is learnt in a read, beside other dialogs'
    writes (F7: on SQLite a write transaction waits for every other one, and a hundred turns
    ending together would queue their boundaries behind each other's commits). Only staged
    inputs take the write transaction that claims them."""
    if fence is not None:
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
