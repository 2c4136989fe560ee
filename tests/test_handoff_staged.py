"""A send handed to the worker as its last turn ends (G6) keeps the queue's order with what
that turn left staged (C4, C5): it starts under the worker's lease only when nothing is
staged, and inputs staged while such a turn runs stay staged for it instead of being taken
by the ended turn's after-turn step."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings

from chatcore.engine import admission, after_turn, queue
from chatcore.engine.ingress import Inbound
from chatcore.engine.sessions import SessionStates
from chatcore.engine.turns.committer import CommitResult
from sessions_app import services
from sessions_app.models import StagedInput, Turn, TurnStatus

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


def _dialog(user: Any) -> Any:
    return services.session_create(owner=user, channel="web", chat_id=f"u{user.pk}")


def _inbound(user: Any, session: Any, content: str) -> Inbound:
    return Inbound(
        owner=user, channel="web", chat_id=session.chat_id, content=content, sender_id="s"
    )


def _admit_under(held: Any, user: Any, session: Any) -> tuple[Any, Any]:
    """A send admitted while this process's worker holds the dialog's lease."""
    return admission.admit_and_start(
        _inbound(user, session, "next"),
        session,
        cfg=settings.CHAT,
        states=SessionStates(),
        start_as=None,
        held=held,
    )


def _staged(session: Any, content: str) -> StagedInput:
    return StagedInput.objects.create(session=session, mode=StagedInput.Mode.STEER, content=content)


def test_a_send_under_the_workers_lease_queues_while_inputs_are_staged(user: Any) -> None:
    # covers: G6, C4 (a steer the last turn left staged goes first)
    session = _dialog(user)
    held = queue.acquire_lease(session.pk, owner="worker", cfg=settings.CHAT)
    assert held is not None
    _staged(session, "left by the last turn")
    ack, started = _admit_under(held, user, session)
    assert started is None and ack.turn_id is not None
    assert Turn.objects.get(pk=ack.turn_id).status == TurnStatus.QUEUED

    # With nothing staged the same send starts at once, under that lease.
    StagedInput.objects.all().delete()
    other = services.session_create(
        owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id="other"
    )
    held_other = queue.acquire_lease(other.pk, owner="worker", cfg=settings.CHAT)
    assert held_other is not None
    _ack, started = _admit_under(held_other, user, other)
    assert started is not None and started.lease is held_other
    assert started.turn.status == TurnStatus.RUNNING


def test_inputs_staged_for_a_running_turn_stay_staged_for_it(user: Any) -> None:
    # covers: C4, C5, G6 (the ended turn's after-turn step leaves them to the running turn)
    session = _dialog(user)
    held = queue.acquire_lease(session.pk, owner="worker", cfg=settings.CHAT)
    assert held is not None
    ended = Turn.objects.create(
        session=session, owner=user, number=1, status=TurnStatus.COMPLETED, content="one"
    )
    Turn.objects.create(
        session=session, owner=user, number=2, status=TurnStatus.RUNNING, content="two"
    )
    steer = _staged(session, "for the running turn")
    ended.session = session
    after_turn.after_turn_staged(
        ended,
        CommitResult(TurnStatus.COMPLETED),
        held,
        states=SessionStates(),
        cfg=settings.CHAT,
    )
    steer.refresh_from_db()
    assert steer.status == StagedInput.Status.STAGED
    assert not Turn.objects.filter(session=session, status=TurnStatus.QUEUED).exists()
