"""Turns that end together commit together, one transaction per batch, on PostgreSQL (SPEC G6,
C9, G2; `committer.commit_outcomes`, `chatcore.engine.gather`).

Whatever a batch does not commit there and then (a dialog cleared under its turn, a lease lost,
a row another transaction holds, a failed transaction) is committed on its own, exactly as any
turn's end."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import OperationalError, connection, connections, transaction
from django.db.models import F

from chatcore.common import publish
from chatcore.engine import admission_batch, after_turn, queue
from chatcore.engine.gather import ALONE
from chatcore.engine.ingress import Inbound
from chatcore.engine.lease import LeaseLost
from chatcore.engine.sessions import SessionStates
from chatcore.engine.turns.committer import (
    CommitResult,
    Ending,
    commit_outcome,
    commit_outcomes,
)
from chatcore.engine.turns.outcome import Completed, PendingMessage
from sessions_app import services
from sessions_app.models import Message, MessageKind, Session, Turn, TurnStatus
from tests.conftest import require_postgresql
from tests.engine_helpers import (
    Exchanges,
    HoldFirst,
    chat_group_of,
    gated_answers,
    history,
    make_dialog,
    send,
    until_waiting,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]

# The batch's lock of its dialogs' rows (`services.lock_sessions_free`), as its statement reads.
BATCH_LOCK = 'WHERE s."id" = ANY(%s) ORDER BY s."id" FOR UPDATE SKIP LOCKED'


@pytest.fixture(autouse=True)
def _postgresql() -> None:
    require_postgresql()


def _started(make_user: Any, count: int) -> list[queue.Started]:
    """`count` dialogs, each with a send's turn started under this process's lease."""
    dialogs = []
    for _ in range(count):
        owner = make_user()
        dialogs.append(services.session_create(owner=owner, channel="web", chat_id=f"u{owner.pk}"))
    out = []
    for i, session in enumerate(dialogs):
        inbound = Inbound(
            owner=session.owner,
            channel="web",
            chat_id=session.chat_id,
            content=f"question {i}",
            sender_id=str(session.owner_id),
        )
        outcome = admission_batch.admit_and_start_many(
            [admission_batch.Admission(inbound, session, "this-process")],
            cfg=settings.CHAT,
            states=SessionStates(),
        )[0]
        assert isinstance(outcome, tuple), outcome
        out.append(outcome[1])
    return out


def _ending(started: queue.Started, answer: str) -> Ending:
    outcome = Completed(
        messages=[PendingMessage(role="assistant", content=answer, kind=MessageKind.ASSISTANT)],
        usage={"completion_tokens": 3},
    )
    return Ending(started.turn, outcome, started.generation, started.lease)


def _commit_many(endings: list[Ending], states: SessionStates) -> list[Any]:
    return commit_outcomes(
        endings,
        states=states,
        after=lambda e: after_turn.after_turn_statement(e.turn, e.fence),
        read_after=lambda e, row: after_turn.after_turn_of(row, e.fence),
    )


def _answers(session_pk: str) -> list[tuple[int, str]]:
    return [
        (m.seq, m.content)
        for m in Message.objects.filter(session_id=session_pk, role="assistant").order_by("seq")
    ]


def test_a_batch_of_turn_ends_commits_every_answer_in_four_round_trips(
    make_user: Any, django_assert_num_queries: Any
) -> None:
    # covers: G6, C9, A3, A4 (psycopg's BEGIN; the rows locked in one round trip; every
    # turn's messages, row update, end and after-turn read in one more; the COMMIT; each
    # answer in its dialog's history held here)
    started = _started(make_user, 5)
    states = SessionStates()
    for st in started:  # the dialogs' histories, held here through their user messages
        assert len(states.history(Session.objects.get(pk=st.session.pk))) == 2
    connection.ensure_connection()
    with Exchanges(connection.connection) as exchanges:
        results = _commit_many([_ending(s, f"answer {i}") for i, s in enumerate(started)], states)
    assert exchanges.count <= 4
    for i, (st, result) in enumerate(zip(started, results, strict=True)):
        assert isinstance(result, CommitResult), result
        assert (result.status, result.error) == (TurnStatus.COMPLETED, None)
        assert result.after == after_turn.AfterTurn(staged=False, queued=False, party_waiting=False)
        turn = Turn.objects.get(pk=st.turn.pk)
        assert (turn.status, turn.usage) == (TurnStatus.COMPLETED, {"completion_tokens": 3})
        live = Session.objects.get(pk=st.session.pk)
        assert _answers(st.session.pk) == [(live.last_seq, f"answer {i}")]
        assert result.appended is not None
        assert live.state_version == result.appended.session.state_version
        assert [m.content for m in result.appended.messages] == [f"answer {i}"]
    lives = [Session.objects.get(pk=s.session.pk) for s in started]
    with django_assert_num_queries(0):
        held = [states.history(live) for live in lives]
    for i, messages in enumerate(held):
        assert [(m.role, m.content) for m in messages][-2:] == [
            ("user", f"question {i}"),
            ("assistant", f"answer {i}"),
        ]


def test_a_batch_leaves_a_cleared_dialog_a_lost_lease_and_a_held_row_to_their_own_commits(
    make_user: Any,
) -> None:
    # covers: C9, G2, F7 (the batch writes nothing for a dialog cleared under its turn, nor
    # under a lease another process took, and waits for no lock; each such end then goes
    # alone: stale, LeaseLost with nothing written, and committed once the row is free; the
    # rest of the batch commits meanwhile)
    cleared, stolen, held, ok = _started(make_user, 4)
    Session.objects.filter(pk=cleared.session.pk).update(generation=F("generation") + 1)
    Session.objects.filter(pk=stolen.session.pk).update(
        lease_owner="another-process", lease_epoch=F("lease_epoch") + 1
    )
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                Session.objects.select_for_update().get(pk=held.session.pk)
                locked.set()
                release.wait(10)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold)
    holder.start()
    states = SessionStates()
    endings = [_ending(s, "answer") for s in (cleared, stolen, held, ok)]
    try:
        assert locked.wait(10)
        results = _commit_many(endings, states)
    finally:
        release.set()
        holder.join()
    assert results[:3] == [ALONE] * 3
    assert isinstance(results[3], CommitResult) and results[3].status == TurnStatus.COMPLETED
    for st in (cleared, stolen, held):
        assert _answers(st.session.pk) == []
        assert Turn.objects.get(pk=st.turn.pk).status == TurnStatus.RUNNING
    assert [c for _s, c in _answers(ok.session.pk)] == ["answer"]

    def alone(ending: Ending) -> CommitResult:
        return commit_outcome(
            turn=ending.turn,
            outcome=ending.outcome,
            base_generation=ending.base_generation,
            states=states,
            fence=ending.fence,
        )

    stale = alone(endings[0])
    assert (stale.status, stale.reason) == (TurnStatus.CANCELLED, "stale")
    with pytest.raises(LeaseLost):
        alone(endings[1])
    assert _answers(stolen.session.pk) == []
    assert alone(endings[2]).status == TurnStatus.COMPLETED
    assert [c for _s, c in _answers(held.session.pk)] == ["answer"]


def test_a_batch_whose_writes_fail_leaves_nothing_and_each_end_goes_alone(
    make_user: Any,
) -> None:
    # covers: A4, C9 (the batch's transaction rolls back whole: no answer of it is stored, no
    # turn ended, the history held here unchanged; each end is then committed on its own,
    # with its own retries)
    started = _started(make_user, 3)
    states = SessionStates()
    before = [
        [m.seq for m in states.history(Session.objects.get(pk=s.session.pk))] for s in started
    ]
    writes = []

    def fail_the_second(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if sql.startswith("WITH ") and "INSERT" in sql:
            writes.append(sql)
            if len(writes) == 2:
                raise OperationalError("the server went away mid-batch")
        return execute(sql, params, many, context)

    with connection.execute_wrapper(fail_the_second):
        results = _commit_many([_ending(s, "answer") for s in started], states)
    assert results == [ALONE] * 3
    for st, seqs in zip(started, before, strict=True):
        assert _answers(st.session.pk) == []
        assert Turn.objects.get(pk=st.turn.pk).status == TurnStatus.RUNNING
        live = Session.objects.get(pk=st.session.pk)
        assert [m.seq for m in states.history(live)] == seqs


async def test_answers_that_end_together_commit_together_and_every_client_sees_its_end(
    make_engine: Any, make_user: Any, fake_model: Any, recorder: Any, settings: Any
) -> None:
    # covers: G6, C9, D1, D2 (six answers held back, then let go together: their ends are
    # committed in batches, not one transaction each; every dialog gets its whole answer,
    # its history_delta and its turn_updated, in order)
    settings.CHAT = {**settings.CHAT, "AUTO_TITLE_AFTER": 1000}
    engine = await make_engine(name="ends-together")
    endings = engine.workers.ends.endings
    assert endings is not None
    endings.alone_limit = 1
    dialogs = [await make_dialog(await sync_to_async(make_user)()) for _ in range(6)]
    recorders = [await recorder(chat_group_of(s), publish.session_group(s.pk)) for s in dialogs]
    gate = threading.Event()
    fake_model.default = gated_answers(gate)

    def alone(sql: str) -> bool:  # a commit alone: the first waits for the other ends
        return sql.endswith('WHERE s."id" = %s FOR UPDATE')

    def batch(sql: str, params: Any) -> int | None:
        return len(params[0]) if BATCH_LOCK in sql else None

    try:
        async with HoldFirst(alone, note=batch) as hold:
            acks = [await send(engine, s, f"question {i}") for i, s in enumerate(dialogs)]
            await fake_model.requests_made(6)
            await asyncio.sleep(0.2)  # every answer's text is in; each holds before its end
            gate.set()
            await hold.reached()
            await until_waiting(lambda: endings._waiting, 5, "the other ends")
            hold.release()
            ends = [
                await rec.terminal(ack.turn_id, timeout=15)
                for rec, ack in zip(recorders, acks, strict=True)
            ]
    finally:
        gate.set()
    assert [end["status"] for end in ends] == ["completed"] * 6
    # The first end alone; the five that came while it was under way, in one transaction.
    assert hold.seen == [5]
    for i, (session, rec, ack) in enumerate(zip(dialogs, recorders, acks, strict=True)):
        got = [(m.role, m.content) for m in await history(session) if m.role != "system"]
        assert got[-2:] == [("user", f"question {i}"), ("assistant", f"the answer to question {i}")]
        frames = [f for f in rec.frames if f.get("turn_id") == ack.turn_id]
        kinds = [f["type"] for f in frames]
        assert kinds.index("turn_updated") == len(kinds) - 1
        deltas = [f for f in frames if f["type"] == "history_delta"]
        assert [m["content"] for m in deltas[-1]["messages"]] == [f"the answer to question {i}"]
        text = ""
        for frame in frames:
            if frame["type"] == "turn_snapshot":
                assert frame["text_offset"] <= len(text)
                text = text[: frame["text_offset"]] + frame["text"]
        assert text == f"the answer to question {i}"
