"""Sends that come while other admissions are under way are admitted together, one
transaction per batch, on PostgreSQL (SPEC G6, C1, C2, C3, F7; `Engine.admissions`, a
`chatcore.engine.gather.Gathered`).

Whatever a batch does not start there and then (a busy or deleted dialog, a failed
transaction) is admitted on its own, exactly as any send."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import OperationalError, connection, connections, transaction
from django.utils import timezone

from chatcore.common.errors import NotFound
from chatcore.engine import admission, admission_batch
from chatcore.engine.gather import ALONE
from chatcore.engine.ingress import Inbound
from chatcore.engine.sessions import SessionStates
from sessions_app import services
from sessions_app.models import Message, Session, Turn, TurnStatus
from tests.conftest import require_postgresql
from tests.engine_helpers import (
    HoldFirst,
    Sent,
    history,
    make_dialog,
    send,
    until_waiting,
)
from tests.fakemodel import Reply, echo_reply, strip_runtime

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]

# The batch's lock of its dialogs' rows (`admission_lock.lock_many`), as its statement reads.
BATCH_LOCK = 'WHERE s."id" = ANY(%s) AND s."deleted_at" IS NULL ORDER BY s."id" FOR UPDATE SKIP'

# A single admission's lock of its dialog's and its sender's rows
# (`admission_lock.lock_for_admission`).
SINGLE_LOCK = "FOR UPDATE OF s, u"


@pytest.fixture(autouse=True)
def _postgresql() -> None:
    require_postgresql()


def _dialogs(make_user: Any, count: int) -> list[Session]:
    out = []
    for _ in range(count):
        owner = make_user()
        out.append(services.session_create(owner=owner, channel="web", chat_id=f"u{owner.pk}"))
    return out


def _admission(session: Session, content: str, **kw: Any) -> admission_batch.Admission:
    inbound = Inbound(
        owner=session.owner,
        channel="web",
        chat_id=session.chat_id,
        content=content,
        sender_id=str(session.owner_id),
    )
    return admission_batch.Admission(inbound, session, "this-process", **kw)


def test_a_batch_of_sends_to_idle_dialogs_starts_every_turn_in_a_round_trip_each(
    make_user: Any,
) -> None:
    # covers: G6, C1, C3, G2 (every dialog's and sender's rows locked and counted in one
    # round trip; each turn, its user message and lease in one statement; psycopg's BEGIN
    # and the one COMMIT)
    dialogs = _dialogs(make_user, 5)
    started_seen: list[str] = []
    batch = [
        _admission(s, f"hello {i}", on_started=lambda st: started_seen.append(str(st.turn.pk)))
        for i, s in enumerate(dialogs)
    ]
    sent = Sent()
    with connection.execute_wrapper(sent):
        outcomes = admission_batch.admit_and_start_many(
            batch, cfg=settings.CHAT, states=SessionStates()
        )
    # The two locks and a count per dialog, together; then one statement per started turn.
    assert sent.piped == [True] * (2 + len(batch)) + [False] * len(batch)
    assert all(sql.startswith("WITH ") for sql, _piped in sent.statements[2 + len(batch) :])
    for i, (session, outcome) in enumerate(zip(dialogs, outcomes, strict=True)):
        assert isinstance(outcome, tuple), outcome
        ack, started = outcome
        assert ack.position == 0 and ack.turn_id == str(started.turn.pk)
        turn = Turn.objects.get(pk=ack.turn_id)
        assert (turn.status, turn.session_id, turn.content) == (
            TurnStatus.RUNNING,
            session.pk,
            f"hello {i}",
        )
        users = Message.objects.filter(session_id=session.pk, role="user")
        assert [(m.content, m.turn_id) for m in users] == [(f"hello {i}", turn.pk)]
        live = Session.objects.get(pk=session.pk)
        assert (live.lease_owner, live.lease_epoch) == ("this-process", started.lease.epoch)
        assert live.state_version == started.session.state_version
    assert sorted(started_seen) == sorted(str(o[1].turn.pk) for o in outcomes)  # type: ignore[index]


def test_a_batch_records_its_user_messages_in_the_history_this_process_holds(
    make_user: Any, django_assert_num_queries: Any
) -> None:
    # covers: A4, A5, G6 (as for a send admitted alone: once committed, the user message
    # joins the dialog's history held here, so the turn's build and the next one read
    # nothing of it again)
    dialogs = _dialogs(make_user, 3)
    states = SessionStates()
    for session in dialogs:
        assert [m.seq for m in states.history(session)] == [1]  # the welcome (B2)
    outcomes = admission_batch.admit_and_start_many(
        [_admission(s, f"hello {i}") for i, s in enumerate(dialogs)],
        cfg=settings.CHAT,
        states=states,
    )
    assert all(isinstance(o, tuple) for o in outcomes), outcomes
    lives = [Session.objects.get(pk=s.pk) for s in dialogs]
    with django_assert_num_queries(0):
        held = [states.history(live) for live in lives]
    for i, (live, messages) in enumerate(zip(lives, held, strict=True)):
        assert live.last_seq == 2
        assert [(m.seq, m.role, m.content) for m in messages][1:] == [(2, "user", f"hello {i}")]


def test_a_batch_leaves_a_busy_dialog_and_a_deleted_one_to_their_own_admissions(
    make_user: Any,
) -> None:
    # covers: C1, C2 (a busy dialog's send queues behind its running turn; a deleted dialog's
    # is refused; neither is written by the batch, and the others start)
    idle, busy, gone = _dialogs(make_user, 3)
    first = admission_batch.admit_and_start_many(
        [_admission(busy, "running")], cfg=settings.CHAT, states=SessionStates()
    )[0]
    assert isinstance(first, tuple)
    Session.objects.filter(pk=gone.pk).update(deleted_at=timezone.now())

    outcomes = admission_batch.admit_and_start_many(
        [_admission(idle, "hi"), _admission(busy, "next"), _admission(gone, "lost")],
        cfg=settings.CHAT,
        states=SessionStates(),
    )
    assert isinstance(outcomes[0], tuple)
    assert outcomes[1] is ALONE and outcomes[2] is ALONE
    assert list(Turn.objects.filter(session_id=busy.pk).values_list("content", flat=True)) == [
        "running"
    ]
    assert not Turn.objects.filter(session_id=gone.pk).exists()

    # On their own, exactly as any send: queued behind the running turn; refused.
    ack, started = admission.admit_and_start(
        _admission(busy, "next").inbound,
        busy,
        cfg=settings.CHAT,
        states=SessionStates(),
        start_as="this-process",
    )
    assert started is None and ack.position == 1
    with pytest.raises(NotFound):
        admission.admit_and_start(
            _admission(gone, "lost").inbound,
            gone,
            cfg=settings.CHAT,
            states=SessionStates(),
            start_as="this-process",
        )


def test_a_send_whose_row_another_transaction_holds_goes_alone_and_holds_up_no_other(
    make_user: Any,
) -> None:
    # covers: G6, F7 (a batch waits for no lock: a dialog's row or a sender's row held by
    # another transaction leaves that send to its own admission, which waits there; the rest
    # of the batch starts meanwhile)
    first, dialog_held, sender_held, last = _dialogs(make_user, 4)
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                Session.objects.select_for_update().get(pk=dialog_held.pk)
                get_user_model().objects.select_for_update().get(pk=sender_held.owner_id)
                locked.set()
                release.wait(10)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)
        outcomes = admission_batch.admit_and_start_many(
            [
                _admission(s, f"hello {i}")
                for i, s in enumerate([first, dialog_held, sender_held, last])
            ],
            cfg=settings.CHAT,
            states=SessionStates(),
        )
    finally:
        release.set()
        holder.join()
    assert isinstance(outcomes[0], tuple) and isinstance(outcomes[3], tuple)
    assert outcomes[1] is ALONE and outcomes[2] is ALONE
    assert not Turn.objects.filter(session_id__in=[dialog_held.pk, sender_held.pk]).exists()


def test_a_batch_whose_writes_fail_leaves_nothing_and_each_send_goes_alone(
    make_user: Any,
) -> None:
    # covers: A4, C2 (the batch's transaction rolls back whole; no send is lost: each is
    # admitted on its own, with its own retries)
    dialogs = _dialogs(make_user, 3)
    writes = []

    def fail_the_second(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if sql.startswith("WITH ") and "INSERT" in sql:
            writes.append(sql)
            if len(writes) == 2:
                raise OperationalError("the server went away mid-batch")
        return execute(sql, params, many, context)

    with connection.execute_wrapper(fail_the_second):
        outcomes = admission_batch.admit_and_start_many(
            [_admission(s, f"hello {i}") for i, s in enumerate(dialogs)],
            cfg=settings.CHAT,
            states=SessionStates(),
        )
    assert outcomes == [ALONE] * 3
    for session in dialogs:
        assert not Turn.objects.filter(session_id=session.pk).exists()
        assert not Message.objects.filter(session_id=session.pk, role="user").exists()
        assert Session.objects.get(pk=session.pk).lease_owner == ""


async def test_sends_that_arrive_while_an_admission_is_under_way_go_together_and_all_answer(
    make_engine: Any, make_user: Any, fake_model: Any
) -> None:
    # covers: G6, C1, C3 (six sends to idle dialogs admitted in one batch; a second send to one
    # of them in the same burst queues behind its first, in order; every answer arrives)
    engine = await make_engine(name="batched")
    assert engine.admissions is not None
    engine.admissions.alone_limit = 1
    dialogs = [await make_dialog(await sync_to_async(make_user)()) for _ in range(7)]
    # The first answer in dialogs[1] waits, so its second send finds the turn running.
    answering = threading.Event()

    def reply(request: dict[str, Any]) -> Reply:
        if strip_runtime(request["messages"][-1]["content"]) == "hello 1":
            return Reply(text="echo: hello 1", gate=answering)
        return echo_reply(request)

    fake_model.default = reply

    def lock(sql: str, params: Any) -> str | None:
        return "batch" if BATCH_LOCK in sql else "single" if SINGLE_LOCK in sql else None

    try:
        async with HoldFirst(lambda sql: SINGLE_LOCK in sql, note=lock) as hold:
            first = asyncio.create_task(send(engine, dialogs[0], "first"))
            await hold.reached()
            burst = [
                asyncio.create_task(send(engine, session, f"hello {i}"))
                for i, session in enumerate(dialogs[1:], start=1)
            ]
            again = asyncio.create_task(send(engine, dialogs[1], "again"))
            await until_waiting(lambda: engine.admissions._waiting, 7, "the burst's sends")
            hold.release()
            acks = await asyncio.gather(first, *burst)
            again_ack = await again
    finally:
        answering.set()

    assert [ack.position for ack in acks] == [0] * 7
    assert again_ack.position == 1
    # The first alone; the six together; the second send to dialogs[1] in a batch of its own,
    # which left it (a busy dialog) to its own admission.
    assert hold.seen == ["single", "batch", "batch", "single"]

    async def answered(session: Session, count: int) -> list[tuple[str, str]]:
        deadline = time.monotonic() + 15
        while True:
            got = [(m.role, m.content) for m in await history(session) if m.role != "system"]
            done = [m for m in got if m[0] == "assistant"]
            if len(done) >= count or time.monotonic() > deadline:
                return got
            await asyncio.sleep(0.05)

    assert (await answered(dialogs[0], 1))[-2:] == [
        ("user", "first"),
        ("assistant", "echo: first"),
    ]
    assert (await answered(dialogs[1], 2))[-4:] == [
        ("user", "hello 1"),
        ("assistant", "echo: hello 1"),
        ("user", "again"),
        ("assistant", "echo: again"),
    ]
    for i, session in enumerate(dialogs[2:], start=2):
        assert (await answered(session, 1))[-2:] == [
            ("user", f"hello {i}"),
            ("assistant", f"echo: hello {i}"),
        ]
