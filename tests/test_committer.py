"""The committer (`chatcore.engine.turns.committer`) on its own, against the real database:
how a turn's start and end become history and turn records (C3, C4, C9, C11, E5, G2)."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.utils import timezone

from chatcore.engine import admission, lease, queue
from chatcore.engine.ingress import Inbound
from chatcore.engine.lease import LeaseLost
from chatcore.engine.sessions import SessionStates
from chatcore.engine.turns.committer import commit_outcome, take_staged
from chatcore.engine.turns.outcome import (
    Cancelled,
    Completed,
    Failed,
    FailureKind,
    PendingMessage,
    Stale,
)
from sessions_app import services
from sessions_app.models import Message, MessageKind, MessageStatus, Role, StagedInput, Turn

pytestmark = [pytest.mark.django_db(transaction=True)]


def _dialog(user: Any) -> Any:
    return services.session_create(owner=user, channel="web", chat_id=f"u{user.pk}")


def _submit(user: Any, session: Any, content: str, mode: str = "send") -> Any:
    inbound = Inbound(
        owner=user,
        channel="web",
        chat_id=session.chat_id,
        content=content,
        sender_id=str(user.pk),
        mode=mode,
    )
    return admission.admit(inbound, session, cfg=settings.CHAT, states=SessionStates())


def _claim(session: Any) -> tuple[Turn, lease.Lease, queue.Started]:
    """Take the lease and start the next turn: claimed, user message recorded (C3)."""
    held = queue.acquire_lease(session.pk, owner="test", cfg=settings.CHAT)
    assert held is not None
    started = queue.claim_next(session.pk, held, cfg=settings.CHAT, states=SessionStates())
    assert isinstance(started, queue.Started)
    return started.turn, held, started


def _answer(text: str) -> PendingMessage:
    return PendingMessage(role=Role.ASSISTANT, content=text, kind=MessageKind.ASSISTANT)


def _history(session: Any) -> list[Message]:
    return list(Message.objects.filter(session_id=session.pk).order_by("seq"))


def test_a_claimed_turn_records_its_user_message_with_its_received_time(user):
    # covers: C3
    session = _dialog(user)
    _submit(user, session, "hello there")
    turn, held, started = _claim(session)
    appended, generation = started.appended, started.generation
    assert appended is not None
    last = _history(session)[-1]
    assert (last.role, last.content, last.kind) == (Role.USER, "hello there", "user_input")
    assert last.created_at == turn.received_at and last.turn_id == turn.pk
    assert generation == appended.session.generation


def test_steers_left_staged_are_recorded_after_the_next_user_message(user):
    # covers: C4
    session = _dialog(user)
    StagedInput.objects.create(
        session_id=session.pk,
        mode=StagedInput.Mode.STEER,
        content="left over",
        received_at=timezone.now(),
    )
    _submit(user, session, "next send")
    turn, held, _started = _claim(session)
    contents = [m.content for m in _history(session)[-2:]]
    assert contents == ["next send", "left over"]
    assert not StagedInput.objects.filter(status=StagedInput.Status.STAGED).exists()


def test_completed_outcome_commits_the_answer_and_closes_the_turn(user):
    # covers: C3, C9
    session = _dialog(user)
    _submit(user, session, "hi")
    turn, held, started = _claim(session)
    _appended, generation = started.appended, started.generation
    result = commit_outcome(
        turn=turn,
        outcome=Completed(messages=[_answer("the answer")], usage={"total_tokens": 7}),
        base_generation=generation,
        states=SessionStates(),
        fence=held,
    )
    assert result.status == "completed" and result.error is None
    stored = Turn.objects.get(pk=turn.pk)
    assert stored.status == "completed" and stored.finished_at is not None
    assert stored.usage == {"total_tokens": 7}
    last = _history(session)[-1]
    assert (last.role, last.content, last.turn_id) == (Role.ASSISTANT, "the answer", turn.pk)


def test_cancelled_outcome_keeps_the_partial_and_never_an_empty_answer(user):
    # covers: C6, E5
    session = _dialog(user)
    _submit(user, session, "one")
    turn, held, started = _claim(session)
    _a, generation = started.appended, started.generation
    result = commit_outcome(
        turn=turn,
        outcome=Cancelled(messages=[], partial="half an ans"),
        base_generation=generation,
        states=SessionStates(),
        fence=held,
    )
    assert result.status == "cancelled" and result.reason == "stopped"
    last = _history(session)[-1]
    assert (last.content, last.status) == ("half an ans", MessageStatus.CANCELLED)
    count = len(_history(session))
    lease.release(held)

    _submit(user, session, "two")
    turn2, held2, started2 = _claim(session)
    generation = started2.generation
    commit_outcome(
        turn=turn2,
        outcome=Failed(FailureKind.PROVIDER, "down", partial="   "),
        base_generation=generation,
        states=SessionStates(),
        fence=held2,
    )
    # Only the user message of the second turn was added: no blank assistant text.
    assert len(_history(session)) == count + 1
    stored = Turn.objects.get(pk=turn2.pk)
    assert stored.status == "failed" and stored.error_kind == str(FailureKind.PROVIDER)


def test_an_outcome_after_the_dialog_was_cleared_is_stale(user):
    # covers: C9
    session = _dialog(user)
    _submit(user, session, "hi")
    turn, held, started = _claim(session)
    _a, generation = started.appended, started.generation
    services.messages_clear(session=session)
    before = len(_history(session))
    result = commit_outcome(
        turn=turn,
        outcome=Completed(messages=[_answer("late")]),
        base_generation=generation,
        states=SessionStates(),
        fence=held,
    )
    assert (result.status, result.reason) == ("cancelled", "stale")
    assert len(_history(session)) == before
    again = commit_outcome(
        turn=turn, outcome=Stale(), base_generation=0, states=SessionStates(), fence=held
    )
    assert again.reason == "stale"


def test_a_lost_lease_commits_nothing(user):
    # covers: G2
    session = _dialog(user)
    _submit(user, session, "hi")
    turn, held, started = _claim(session)
    _a, generation = started.appended, started.generation
    before = len(_history(session))
    # Another process took the dialog over (a new epoch).
    lease.release(held)
    other = queue.acquire_lease(session.pk, owner="other", cfg=settings.CHAT)
    assert other is not None
    with pytest.raises(LeaseLost):
        commit_outcome(
            turn=turn,
            outcome=Completed(messages=[_answer("from the old holder")]),
            base_generation=generation,
            states=SessionStates(),
            fence=held,
        )
    assert len(_history(session)) == before
    assert Turn.objects.get(pk=turn.pk).status == "running"


def test_staged_inputs_are_taken_once(user):
    # covers: C4, C5
    session = _dialog(user)
    _submit(user, session, "first")
    turn, held, _started = _claim(session)
    _submit(user, session, "steer me", mode="steer")
    _submit(user, session, "note this", mode="inject")
    taken = take_staged(turn=turn, fence=held)
    assert [(p.kind, p.content) for p in taken] == [("steer", "steer me"), ("inject", "note this")]
    assert take_staged(turn=turn, fence=held) == []
    assert set(StagedInput.objects.values_list("recorded_in", flat=True)) == {turn.pk}


def test_a_boundary_of_a_turn_that_lost_its_lease_takes_nothing(user):
    # covers: C4, G2
    session = _dialog(user)
    _submit(user, session, "first")
    turn, held, _started = _claim(session)
    lease.release(held)
    other = queue.acquire_lease(session.pk, owner="other", cfg=settings.CHAT)
    assert other is not None
    # Nothing staged: still refused (the turn's process no longer speaks for the dialog).
    with pytest.raises(LeaseLost):
        take_staged(turn=turn, fence=held)
    _submit(user, session, "steer me", mode="steer")
    with pytest.raises(LeaseLost):
        take_staged(turn=turn, fence=held)
    assert StagedInput.objects.get().recorded_in is None
