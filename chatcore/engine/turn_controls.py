"""Stop, retry and continue (C6, E5): what a user asks of a dialog's queue besides a send,
each in one transaction on the dialog's locked row (`queue.lock_live`), and the cut answer
a continue turn goes on with. Synchronous, ORM-only functions, run on the database threads."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from chatcore.common.errors import NothingToContinue, NothingToRetry
from sessions_app import storage
from sessions_app.models import (
    Message,
    MessageStatus,
    Role,
    Session,
    StagedInput,
    Turn,
    TurnMode,
    TurnStatus,
)

from .ingress import Ack
from .queue import enqueue_locked, lock_live, position
from .turns.outcome import Notice, PendingMessage

CONTINUE_INSTRUCTION = (
    "Your previous answer was cut off because it reached the length limit. Continue it "
    "exactly where it stopped, without repeating anything already written and without any "
    "preamble."
)


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
