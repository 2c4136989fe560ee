"""Database round trips a send costs before its first token (SPEC G6, STYLE 12).

A round trip, as counted here, is one exchange the engine has to wait for with the database
before it can go on: a transaction (the outermost `atomic` block entered, on any thread, with
everything run inside it), or a statement run in autocommit outside any transaction. Both are
counted on every thread (the ORM thread and the pool threads that read the context), from
`submit` until the model receives the request. Statements are printed for information."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connection, transaction
from django.db.backends.utils import CursorWrapper

from tests.engine_helpers import (
    HoldFirst,
    chat_group_of,
    gated_answers,
    history,
    make_dialog,
    send,
    until_waiting,
)
from tests.fakemodel import Reply, strip_runtime

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]

# G6: a send to an idle dialog is admitted, claimed under a fresh lease and its user message
# recorded in one transaction; the context is read in a second one.
ROUND_TRIPS_BEFORE_FIRST_TOKEN = 3
# ... and the statements in them: the admission (the locked row with the queue counts and
# the F7 slot's, after the rows' lock on PostgreSQL; the turn, the user message, the row's
# update, one statement on PostgreSQL) and the context (compaction, history window, memory
# notes; messages when the cache is behind). SQLite 6, PostgreSQL 5.
STATEMENTS_BEFORE_FIRST_TOKEN = 6


class TripCounter:
    """Counts transactions and autocommit statements on every thread while `counting`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lock = threading.Lock()
        self.counting = threading.Event()
        self.trips: list[str] = []
        self.statements: list[str] = []
        real_execute = CursorWrapper._execute
        real_enter = transaction.Atomic.__enter__
        counter = self

        def execute(self: CursorWrapper, sql: str, params: Any, *rest: Any) -> Any:
            if counter.counting.is_set() and not sql.startswith("BEGIN"):
                with counter.lock:
                    counter.statements.append(sql)
                    if not self.db.in_atomic_block:
                        counter.trips.append(f"autocommit: {sql}")
            return real_execute(self, sql, params, *rest)

        def enter(self: transaction.Atomic) -> None:
            outermost = not transaction.get_connection(self.using).in_atomic_block
            real_enter(self)
            if outermost and counter.counting.is_set():
                with counter.lock:
                    counter.trips.append(f"transaction on {threading.current_thread().name}")

        monkeypatch.setattr(CursorWrapper, "_execute", execute)
        monkeypatch.setattr(transaction.Atomic, "__enter__", enter)

    def snapshot(self) -> tuple[list[str], list[str]]:
        with self.lock:
            return list(self.trips), list(self.statements)


async def test_round_trips_before_the_first_token_of_a_send_to_an_idle_dialog(
    make_engine, fake_model, user, settings, monkeypatch
):
    # covers: G6
    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 600, "CHECKPOINT_SECONDS": 600}
    engine = await make_engine(name="counted")
    session = await make_dialog(user)
    await asyncio.sleep(0.5)  # the engine's first sweep runs at start; let it pass
    counter = TripCounter(monkeypatch)
    gate = threading.Event()
    fake_model.script(Reply(text="first token", gate=gate))
    try:
        counter.counting.set()
        ack = await send(engine, session, "hello")
        await fake_model.requests_made(1)
        trips, statements = counter.snapshot()
    finally:
        counter.counting.clear()
        gate.set()
    await engine.wait_idle(session.pk)
    print(f"\n{len(trips)} round trips, {len(statements)} statements before the first token")
    print("\n".join(statements))
    assert ack.position == 0
    assert 1 <= len(trips) <= ROUND_TRIPS_BEFORE_FIRST_TOKEN, "\n".join(trips)
    assert len(statements) <= STATEMENTS_BEFORE_FIRST_TOKEN, "\n".join(statements)
    # The turn ran to its end and its user message and answer are stored in order (C3).
    contents = [
        m.content
        async for m in session.messages.order_by("seq").exclude(role="system")
        if m.content
    ]
    assert contents[-2:] == ["hello", "first token"]


async def test_the_first_send_to_a_dialog_this_process_created_reads_none_of_its_history(
    make_engine, fake_model, user, settings, monkeypatch
):
    # covers: G6, B2, A5 (a dialog created here, as a client's connection, `/new` or the
    # REST API creates one, is held in this process's history from its start: its first
    # turn is built without reading its messages; one created elsewhere is read once)
    from chatcore.common.dbthreads import on_db
    from chatcore.engine.sessions import dialog_create
    from sessions_app.models import Message

    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 600, "CHECKPOINT_SECONDS": 600}
    engine = await make_engine(name="created-here")
    here = await on_db(dialog_create)(
        owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id="here", states=engine.states
    )
    elsewhere = await make_dialog(user, dialog_id="elsewhere")
    await asyncio.sleep(0.5)  # the engine's first sweep runs at start; let it pass
    reads: dict[str, list[str]] = {}
    for session in (here, elsewhere):
        counter = TripCounter(monkeypatch)
        gate = threading.Event()
        fake_model.script(Reply(text="first token", gate=gate))
        try:
            counter.counting.set()
            await send(engine, session, "hello")
            request = (await fake_model.requests_made(1))[-1]
            _trips, statements = counter.snapshot()
        finally:
            counter.counting.clear()
            gate.set()
        await engine.wait_idle(session.pk)
        fake_model.requests.clear()
        # The messages' read (`selectors.messages_for_context`), not the context's window,
        # which sums their stored lengths.
        table = f'FROM "{Message._meta.db_table}" m WHERE'
        reads[session.dialog_id] = [
            s for s in statements if s.startswith('SELECT m."id"') and table in s
        ]
        # The model saw the same input either way: the user message after the welcome's
        # place (the welcome itself is never sent to the model).
        assert strip_runtime(request.body["messages"][-1]["content"]) == "hello"
    assert reads["here"] == []
    assert len(reads["elsewhere"]) == 1, reads


async def test_a_send_to_an_idle_dialog_reaches_the_model_after_one_or_two_hand_offs_from_the_loop(
    make_engine, fake_model, recorder, user, settings, monkeypatch
):
    # covers: G6 (issue 10 item 2: the send admitted, claimed under the lease and its user
    # message recorded in one trip to a database thread, the model request right after: the
    # turn's input is built as soon as the admission has decided (where the admission is
    # round trips to a server, from the context it read with its lock) or committed (SQLite),
    # handed on by the admission's own thread, not by the event loop after it)
    from chatcore.common import dbthreads

    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 600, "CHECKPOINT_SECONDS": 600}
    engine = await make_engine(name="hand-offs")
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="an earlier answer"))
    first = await send(engine, session, "earlier")
    assert (await rec.terminal(first.turn_id))["status"] == "completed"
    await engine.wait_idle(session.pk)
    await asyncio.sleep(0.5)  # past the lease's linger: the dialog is idle, its lease free
    loop_thread = threading.current_thread()
    from_loop: list[str] = []
    counting = threading.Event()
    threads = dbthreads.executor()
    real_submit = threads.submit

    def submit(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        if counting.is_set() and threading.current_thread() is loop_thread:
            from_loop.append(repr(args[-1] if args else fn))
        return real_submit(fn, *args, **kwargs)

    monkeypatch.setattr(threads, "submit", submit)
    gate = threading.Event()
    fake_model.script(Reply(text="the answer", gate=gate))
    try:
        counting.set()
        ack = await send(engine, session, "now")
        await fake_model.requests_made(2)
        counting.clear()
    finally:
        gate.set()
    assert (await rec.terminal(ack.turn_id))["status"] == "completed"
    # The admission, which hands the build on itself.
    assert len(from_loop) <= 1, "\n".join(from_loop)
    # The model saw the whole dialog, the new message last.
    assert [m["content"] for m in fake_model.turn_requests()[-1].messages[1:-1]] == [
        "earlier",
        "an earlier answer",
    ]


async def test_a_send_right_after_an_answer_starts_under_the_lingering_lease(
    make_engine, fake_model, user, settings, monkeypatch
):
    # covers: G6, C3, G2 (a script's next send: no new lease, no claim of its own)
    from chatcore.engine import worker
    from sessions_app.models import Session

    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 600, "CHECKPOINT_SECONDS": 600}
    # A linger no machine outlasts between the first answer and the next send.
    monkeypatch.setattr(worker, "LINGER_SECONDS", 30.0)
    engine = await make_engine(name="counted")
    session = await make_dialog(user)
    await asyncio.sleep(0.5)  # the engine's first sweep runs at start; let it pass
    fake_model.script(Reply(text="first answer"))
    first = await send(engine, session, "one")
    for _ in range(500):
        if session.pk in engine.workers.lingering:
            break
        await asyncio.sleep(0.01)
    assert session.pk in engine.workers.lingering
    # The first turn's after-turn work (the F7 look for dialogs waiting for a slot, a task
    # of its own) is not the second send's: let it end before counting.
    for _ in range(500):
        if not any(":waiting:" in t.get_name() for t in engine.supervisor._tasks):
            break
        await asyncio.sleep(0.01)
    epoch = (await Session.objects.aget(pk=session.pk)).lease_epoch

    counter = TripCounter(monkeypatch)
    gate = threading.Event()
    fake_model.script(Reply(text="second answer", gate=gate))
    try:
        counter.counting.set()
        second = await send(engine, session, "two")
        await fake_model.requests_made(2)
        trips, statements = counter.snapshot()
    finally:
        counter.counting.clear()
        gate.set()
    monkeypatch.setattr(worker, "LINGER_SECONDS", 0.1)
    engine.workers._wakeups[session.pk].set()  # end the long linger now
    await engine.wait_idle(session.pk)
    print(f"\n{len(trips)} round trips, {len(statements)} statements before the first token")
    print("\n".join(statements))
    assert first.position == 0 and second.position == 0
    # The admitting transaction and the context read: no claim, no lease taken anew.
    assert 1 <= len(trips) <= 2, "\n".join(trips)
    assert len(statements) <= STATEMENTS_BEFORE_FIRST_TOKEN, "\n".join(statements)
    row = await Session.objects.aget(pk=session.pk)
    assert row.lease_epoch == epoch
    contents = [
        m.content
        async for m in session.messages.order_by("seq").exclude(role="system")
        if m.content
    ]
    assert contents == ["one", "first answer", "two", "second answer"]


async def test_a_send_made_as_soon_as_the_answer_ends_is_handed_to_the_worker(
    make_engine, fake_model, user, settings, monkeypatch, recorder
):
    # covers: G6, C3, C1 (a client that sends the moment it sees `turn_updated`, while the
    # worker is still on its after-turn steps: no wait for a claim of its own)
    from chatcore.engine import queue
    from sessions_app.models import Session

    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 600, "CHECKPOINT_SECONDS": 600}
    engine = await make_engine(name="handed")
    session = await make_dialog(user)
    handed: list[str] = []
    claimed: list[str] = []
    hand_off, claim_next = engine.workers.hand_off, queue.claim_next

    async def spy_hand_off(started: Any) -> None:
        handed.append(str(started.turn.pk))
        await hand_off(started)

    def spy_claim_next(*args: Any, **kwargs: Any) -> Any:
        found = claim_next(*args, **kwargs)
        if isinstance(found, queue.Started):
            claimed.append(str(found.turn.pk))
        return found

    monkeypatch.setattr(engine.workers, "hand_off", spy_hand_off)
    monkeypatch.setattr(queue, "claim_next", spy_claim_next)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="first answer"), Reply(text="second answer"))
    first = await send(engine, session, "one")
    epoch = (await Session.objects.aget(pk=session.pk)).lease_epoch
    await rec.until(lambda f: f["type"] == "turn_updated" and f["turn_id"] == first.turn_id)
    second = await send(engine, session, "two")
    assert (await rec.terminal(second.turn_id))["status"] == "completed"
    await engine.wait_idle(session.pk)
    assert handed == [second.turn_id]
    assert claimed == []
    # Under the first turn's lease, at its epoch: no lease taken anew (G2).
    assert second.position == 0
    assert (await Session.objects.aget(pk=session.pk)).lease_epoch == epoch
    contents = [
        m.content
        async for m in session.messages.order_by("seq").exclude(role="system")
        if m.content
    ]
    assert contents == ["one", "first answer", "two", "second answer"]


async def test_no_statement_runs_while_the_answer_streams(
    make_engine, fake_model, recorder, user, settings, monkeypatch
):
    # covers: G6, C11, D1 (issue 10 item 2: 0 database round trips per token; the partial
    # text reaches the database only through the once-a-second checkpoint, kept out here)
    from chatcore.common import publish

    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 600, "CHECKPOINT_SECONDS": 600}
    engine = await make_engine(name="per-token")
    session = await make_dialog(user)
    await asyncio.sleep(0.5)  # the engine's first sweep runs at start; let it pass
    rec = await recorder(publish.session_group(session.pk))
    answer = "".join(f"w{i} " for i in range(200))
    gate = threading.Event()
    # 200 deltas, paced, then the stream holds (before its finish) until the test lets it go.
    fake_model.script(Reply(text=answer, chunk=5, delay=0.002, gate=gate))
    counter = TripCounter(monkeypatch)
    ack = await send(engine, session, "stream it")
    text = ""

    def apply(frame: dict[str, Any]) -> bool:
        nonlocal text
        if frame["type"] == "turn_snapshot" and frame["turn_id"] == ack.turn_id:
            text = text[: frame["text_offset"]] + frame["text"]
        return len(text) > 0

    try:
        await rec.until(apply, timeout=15)
        counter.counting.set()
        await rec.until(lambda frame: apply(frame) and len(text) == len(answer), timeout=15)
        _trips, statements = counter.snapshot()
    finally:
        counter.counting.clear()
        gate.set()
    await engine.wait_idle(session.pk)
    assert text == answer
    assert statements == [], "\n".join(statements)


async def test_a_turns_end_is_its_last_boundary_and_one_transaction(
    make_engine, fake_model, recorder, user, settings, monkeypatch
):
    # covers: G6, C4, C9 (from the model's last token to the worker's next step: the last
    # step boundary's look for staged inputs, then one transaction that commits the answer
    # and the turn's end and reads what is left after it: staged inputs, queued turns, the
    # party's waiting dialogs; no trip of its own for that read)
    from chatcore.engine import worker

    settings.CHAT = {
        **settings.CHAT,
        "LEASE_SECONDS": 600,
        "CHECKPOINT_SECONDS": 600,
        "AUTO_TITLE_AFTER": 1000,
    }
    monkeypatch.setattr(worker, "LINGER_SECONDS", 5.0)  # the lease's release comes later
    engine = await make_engine(name="turn-end")
    session = await make_dialog(user)
    await asyncio.sleep(0.5)  # the engine's first sweep runs at start; let it pass
    rec = await recorder(chat_group_of(session))
    gate = threading.Event()
    fake_model.script(Reply(text="the whole answer", gate=gate))
    counter = TripCounter(monkeypatch)
    ack = await send(engine, session, "answer me")
    await fake_model.requests_made(1)
    await asyncio.sleep(0.2)  # the answer's text is in; the stream holds before its end
    try:
        counter.counting.set()
        gate.set()
        done = await rec.terminal(ack.turn_id, timeout=15)
        await asyncio.sleep(0.3)  # anything the worker does after the end, before the linger
        trips, statements = counter.snapshot()
    finally:
        counter.counting.clear()
    assert done["status"] == "completed"
    assert len(trips) == 2, "\n".join(trips)
    assert trips[0].startswith("autocommit:") and trips[1].startswith("transaction")
    print("\n".join(statements))
    contents = [
        m.content
        async for m in session.messages.order_by("seq").exclude(role="system")
        if m.content
    ]
    assert contents[-2:] == ["answer me", "the whole answer"]


async def test_after_an_answer_one_read_tells_the_worker_there_is_nothing_to_claim(
    make_engine, fake_model, recorder, user, settings, monkeypatch
):
    # covers: G6, C1, C3, F7 (the after-turn read that checks the lease and staged inputs
    # also says whether turns are queued and whether another dialog of the party waits: with
    # none, the worker claims nothing and looks for no waiting dialog; a turn another process
    # queued while the answer ran, which no kick of ours announced, runs next)
    from asgiref.sync import sync_to_async
    from django.conf import settings as live

    from chatcore.engine import admission, after_turn, queue
    from chatcore.engine.ingress import Inbound
    from chatcore.engine.sessions import SessionStates

    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 600, "CHECKPOINT_SECONDS": 600}
    engine = await make_engine(name="after-turn")
    session = await make_dialog(user)
    claims: list[str] = []
    claim_next = queue.claim_next

    def spy_claim_next(session_pk: str, *args: Any, **kwargs: Any) -> Any:
        claims.append(session_pk)
        return claim_next(session_pk, *args, **kwargs)

    monkeypatch.setattr(queue, "claim_next", spy_claim_next)
    looked: list[str] = []
    waiting_dialogs = after_turn.waiting_dialogs

    def spy_waiting_dialogs(turn: Any, **kwargs: Any) -> Any:
        looked.append(str(turn.pk))
        return waiting_dialogs(turn, **kwargs)

    monkeypatch.setattr(after_turn, "waiting_dialogs", spy_waiting_dialogs)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="first answer"))
    first = await send(engine, session, "one")
    assert (await rec.terminal(first.turn_id))["status"] == "completed"
    await engine.wait_idle(session.pk)
    assert claims == []

    gate = threading.Event()
    fake_model.script(Reply(text="second answer", gate=gate), Reply(text="third answer"))
    second = await send(engine, session, "two")
    await fake_model.requests_made(2)
    elsewhere = Inbound(
        owner=user, channel="web", chat_id=session.chat_id, content="three", sender_id="s"
    )
    # Admitted as another process admits it: queued behind the running turn, no kick here.
    third = await sync_to_async(admission.admit)(
        elsewhere, session, cfg=live.CHAT, states=SessionStates()
    )
    assert third.position == 1
    gate.set()
    assert (await rec.terminal(second.turn_id))["status"] == "completed"
    assert (await rec.terminal(third.turn_id))["status"] == "completed"
    await engine.wait_idle(session.pk)
    assert claims == [session.pk]  # the third turn's claim, and no read after it
    # No other dialog of the user waited for a slot: F7's look for one never ran.
    assert looked == []
    contents = [
        m.content
        async for m in session.messages.order_by("seq").exclude(role="system")
        if m.content
    ]
    assert contents == ["one", "first answer", "two", "second answer", "three", "third answer"]


@pytest.mark.postgres
async def test_a_sends_context_is_read_in_its_admission_and_sees_every_compaction_before_it(
    make_engine, fake_model, user, settings, monkeypatch
):
    # covers: G6, B5, C7 (on PostgreSQL a send's context is read in its admission's round
    # trip, ahead of its lock: its build reads nothing more; a compaction that lands before
    # the admission is in the model's input, and so is one that another transaction commits
    # while the admission's lock waits: the build sees the row's revision moved, reads anew)
    from chatcore.engine import admission_lock
    from sessions_app import selectors, turn_services
    from sessions_app.models import Session

    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 600, "CHECKPOINT_SECONDS": 600}
    engine = await make_engine(name="context")
    session = await make_dialog(user)
    fake_model.script(Reply(text="first answer"))
    await send(engine, session, "one")
    await engine.wait_idle(session.pk)

    reads: list[str] = []
    real_read, real_lock = selectors.turn_context, admission_lock.lock_for_admission
    before_lock = threading.Event()
    holding, go = threading.Event(), threading.Event()

    def read(**kwargs: Any) -> Any:
        reads.append(kwargs["session_pk"])
        return real_read(**kwargs)

    def compact(summary: str, *, hold: bool = False) -> None:
        """On a connection of its own; `hold`: lock the row first and wait for `go`."""
        try:
            with transaction.atomic():
                row = Session.objects.select_for_update().get(pk=session.pk)
                if hold:
                    holding.set()
                    assert go.wait(10)
                turn_services.compaction_commit(
                    session_pk=row.pk,
                    through=row.last_seq,
                    generation=row.generation,
                    summary=summary,
                )
        finally:
            connection.close()

    def lock(*args: Any, **kwargs: Any) -> Any:
        if before_lock.is_set():
            other = threading.Thread(target=compact, args=("SUMMARY BEFORE THE ADMISSION",))
            other.start()
            other.join(10)
        assert kwargs.get("context") is not None  # the context goes with the admission
        return real_lock(*args, **kwargs)

    def waiting_locks() -> int:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT COUNT(*) FROM pg_locks WHERE NOT granted")
                return int(cursor.fetchone()[0])
        finally:
            connection.close()

    monkeypatch.setattr(selectors, "turn_context", read)
    monkeypatch.setattr(admission_lock, "lock_for_admission", lock)

    fake_model.script(Reply(text="second answer"))
    await send(engine, session, "two")
    await engine.wait_idle(session.pk)
    assert reads == []  # built from what the admission read
    sent = json.dumps(fake_model.requests[-1].messages)
    assert "first answer" in sent and "two" in sent

    before_lock.set()
    fake_model.script(Reply(text="third answer"))
    await send(engine, session, "three")
    await engine.wait_idle(session.pk)
    before_lock.clear()
    assert reads == []
    sent = json.dumps(fake_model.requests[-1].messages)
    assert "SUMMARY BEFORE THE ADMISSION" in sent
    assert "first answer" not in sent and "three" in sent

    other = threading.Thread(
        target=compact, args=("SUMMARY WHILE IT WAITS",), kwargs={"hold": True}
    )
    other.start()
    try:
        assert await asyncio.to_thread(holding.wait, 10)
        fake_model.script(Reply(text="fourth answer"))
        sending = asyncio.create_task(send(engine, session, "four"))
        # The admission's round trip is in: its context read, its lock waiting.
        for _ in range(500):
            if await asyncio.to_thread(waiting_locks):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the admission never waited for the dialog's row")
    finally:
        go.set()
        await asyncio.to_thread(other.join, 10)
    await asyncio.wait_for(sending, 30)
    await engine.wait_idle(session.pk)
    assert reads == [session.pk]  # read again after the admission
    sent = json.dumps(fake_model.requests[-1].messages)
    assert "SUMMARY WHILE IT WAITS" in sent
    assert "third answer" not in sent and "four" in sent


@pytest.mark.postgres
async def test_a_burst_s_first_turn_reaches_the_model_before_the_burst_s_last_admission(
    make_engine, fake_model, make_user, settings, monkeypatch
):
    # covers: G6, F7 (issue 10: a hundred sends at once; a turn already admitted is built
    # while the burst's other sends are admitted, a batch per transaction, so its first token
    # does not wait for the burst's last admission)
    from asgiref.sync import sync_to_async

    from chatcore.common import dbthreads
    from chatcore.engine import admission

    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 600, "CHECKPOINT_SECONDS": 600}
    engine = await make_engine(name="burst-order")
    width = dbthreads.thread_count() * 3
    sessions = [
        await make_dialog(await sync_to_async(make_user)(f"order{i}")) for i in range(width)
    ]
    log: list[str] = []
    real_admit = admission.admit_and_start

    def admit(*args: Any, **kwargs: Any) -> Any:

        found = real_admit(*args, **kwargs)
        time.sleep(0.05)  # each admission holds its database thread a while
        log.append("admitted")
        return found

    def reply(request: dict[str, Any]) -> Reply:
        log.append("model request")
        return Reply(text="hi")

    monkeypatch.setattr(admission, "admit_and_start", admit)
    fake_model.default = reply
    acks = await asyncio.gather(*(send(engine, s, "hello") for s in sessions))
    assert all(ack.turn_id is not None for ack in acks)
    await engine.wait_idle()
    assert log.count("model request") == width
    # The first turn's request came once the first admissions were through, not after the
    # admissions queued behind them.
    assert log[: log.index("model request")].count("admitted") <= dbthreads.thread_count(), log


async def _questions_answered(
    engine: Any,
    user: Any,
    fake_model: Any,
    recorder: Any,
    *,
    after_each: Callable[[int], bool] = lambda _i: True,
) -> None:
    """Three sends to a new dialog of `user`, each once the last was answered; `after_each`
    holds after each answer."""
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    for i in range(3):
        fake_model.script(Reply(text=f"answer {i}"))
        ack = await send(engine, session, f"question {i}")
        assert (await rec.terminal(ack.turn_id))["status"] == "completed"
        assert after_each(i), i


@pytest.mark.postgres
async def test_a_started_sends_model_request_goes_out_before_its_worker_asks_for_it(
    make_engine, fake_model, recorder, user, settings, monkeypatch
):
    # covers: G6 (issue 10: on PostgreSQL the request is sent from the loop once the
    # admission has committed and the input built beside it is ready, ahead of the trip back
    # to the sender and on to the worker; the worker's runner takes it as its first step's:
    # one request a turn, sends that follow an answer at once included. F7: the request,
    # its body the window's messages joined, is made on the database thread that built the
    # input, not on the event loop, which sends it as it is)
    from chatcore.engine.provider import OpenAIProvider
    from chatcore.engine.turns.runner import OpenedRequest

    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 600, "CHECKPOINT_SECONDS": 600}
    taken: list[OpenedRequest] = []
    real_take = OpenedRequest.take
    made: list[tuple[str, Any]] = []
    real_prepare = OpenAIProvider.prepare_request

    def take(self: OpenedRequest) -> Any:
        taken.append(self)
        return real_take(self)

    def prepare(self: OpenAIProvider, **kwargs: Any) -> Any:
        ahead = real_prepare(self, **kwargs)
        made.append((threading.current_thread().name, ahead))
        return ahead

    monkeypatch.setattr(OpenedRequest, "take", take)
    monkeypatch.setattr(OpenAIProvider, "prepare_request", prepare)
    await _questions_answered(await make_engine(name="opened"), user, fake_model, recorder)
    assert len(taken) == 3
    requests = fake_model.turn_requests()
    assert len(requests) == 3
    assert len(made) == 3
    for i, (opened, request, (thread, ahead)) in enumerate(zip(taken, requests, made, strict=True)):
        assert strip_runtime(request.messages[-1]["content"]) == f"question {i}"
        assert opened.request.max_tokens == next(
            request.body[k] for k in ("max_tokens", "max_completion_tokens") if k in request.body
        )
        assert thread.startswith("chat-db") and thread != threading.current_thread().name
        assert request.body == json.loads(ahead.request.content)  # sent as it was made


@pytest.mark.postgres
async def test_a_turn_whose_build_began_after_its_admission_committed_keeps_the_history_held(
    make_engine, fake_model, recorder, user, settings, monkeypatch
):
    # covers: A4, A5, G6 (the user message joins the history this process holds once it is
    # committed, also when the build beside the admission only began after that: a burst
    # keeps the database threads busy. The dialog's next build reads no message again)

    from chatcore.engine.engine import Engine
    from sessions_app import selectors

    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 600, "CHECKPOINT_SECONDS": 600}
    real_prepare = Engine._prepare_early

    def late(self: Engine, started: Any, *, committed: bool) -> Any:
        time.sleep(0.2)  # the admission has committed, and recorded what it could, by now
        return real_prepare(self, started, committed=committed)

    monkeypatch.setattr(Engine, "_prepare_early", late)
    reads: list[int] = []
    real_read = selectors.messages_for_context

    def read(**kwargs: Any) -> Any:
        reads.append(kwargs["after_seq"])
        return real_read(**kwargs)

    monkeypatch.setattr(selectors, "messages_for_context", read)
    engine = await make_engine(name="late-build")
    # Only the first build read the dialog's history (the welcome).
    await _questions_answered(
        engine, user, fake_model, recorder, after_each=lambda i: len(reads) == 1
    )
    requests = fake_model.turn_requests()
    assert [strip_runtime(m["content"]) for m in requests[-1].messages[1:]] == [
        "question 0",
        "answer 0",
        "question 1",
        "answer 1",
        "question 2",
    ]


async def test_a_started_turns_user_message_reaches_the_socket_before_any_of_its_answer(
    make_engine, fake_model, user, settings
):
    # covers: G6, C3, D1, D2 (the model request goes out first; the user message's delta is
    # still sent once, before the turn's first snapshot, from a model that answers at once:
    # a send to an idle dialog, then sends that follow each answer at once)
    from chatcore.engine import runtime
    from tests.ws_helpers import bearer, open_ws

    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 600, "CHECKPOINT_SECONDS": 600}
    engine = await make_engine(name="ordered")
    runtime.set_engine(engine)
    try:
        await make_dialog(user)
        ws, connected = await open_ws(await bearer(user))
        assert connected
        assert (await ws.next())["type"] == "sessions"
        assert (await ws.next())["type"] == "session_history"
        for i in range(3):
            fake_model.script(Reply(text=f"answer {i}", chunk=1))
            await ws.send({"type": "send", "content": f"question {i}", "client_msg_id": f"q{i}"})
            frames = await ws.until(lambda f: f["type"] == "turn_updated")
            turn_id = frames[-1]["turn_id"]
            mine = [f for f in frames if f.get("turn_id") in (turn_id, None)]
            kinds = [f["type"] for f in mine]
            assert kinds[0] == "queued" and kinds[1] == "history_delta", kinds
            assert [m["content"] for m in mine[1]["messages"]] == [f"question {i}"]
            assert kinds.index("turn_snapshot") == 2, kinds
            text = ""
            for snapshot in (f for f in mine if f["type"] == "turn_snapshot"):
                assert snapshot["text_offset"] <= len(text)
                text = text[: snapshot["text_offset"]] + snapshot["text"]
            assert text == f"answer {i}"
            assert kinds[-2:] == ["history_delta", "turn_updated"], kinds
            assert kinds.count("history_delta") == 2, kinds
            assert frames[-1]["status"] == "completed"
        await ws.close()
    finally:
        runtime.set_engine(None)


async def test_a_slow_publish_of_the_user_message_still_reaches_clients_before_its_answer(
    make_engine, fake_model, recorder, user, settings, monkeypatch
):
    # covers: G6, C3, D1 (the turn's first snapshot waits for its user message's delta to
    # be published, however long that publish takes, and however fast the model answers)
    from channels.layers import get_channel_layer

    from chatcore.common import publish

    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 600, "CHECKPOINT_SECONDS": 600}
    engine = await make_engine(name="slow-delta")
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session), publish.session_group(session.pk))
    layer = get_channel_layer()
    real_group_send = layer.group_send

    async def group_send(group: str, message: dict[str, Any]) -> None:
        frames = [one["frame"] for one in publish.unfold(message) if "frame" in one]
        if any(f.get("type") == "history_delta" and f.get("turn_id") for f in frames):
            await asyncio.sleep(0.3)  # the question's publish is slow (a busy layer)
        await real_group_send(group, message)

    monkeypatch.setattr(layer, "group_send", group_send)
    fake_model.script(Reply(text="an answer at once", chunk=50))
    ack = await send(engine, session, "a question")
    frames = await rec.until(lambda f: f["type"] == "turn_updated" and f["turn_id"] == ack.turn_id)
    mine = [f for f in frames if f.get("turn_id") == ack.turn_id]
    kinds = [f["type"] for f in mine]
    assert kinds[0] == "history_delta", kinds
    assert [m["content"] for m in mine[0]["messages"]] == ["a question"]
    assert "turn_snapshot" in kinds and kinds[-1] == "turn_updated", kinds


async def test_step_boundaries_that_come_together_are_read_together(
    make_engine: Any, make_user: Any, fake_model: Any, recorder: Any
) -> None:
    # covers: G6, C4, G2 (the last step boundary of turns ending together: one statement
    # for several, each turn still told its own staged inputs; a steer staged for one of
    # them is taken at its boundary and causes its one more step)
    engine = await make_engine(name="boundaries")
    engine.workers.boundaries.alone_limit = 1
    dialogs = [await make_dialog(await sync_to_async(make_user)()) for _ in range(5)]
    recorders = [await recorder(chat_group_of(s)) for s in dialogs]
    gate = threading.Event()
    fake_model.default = gated_answers(gate)

    def together(sql: str, params: Any) -> int | None:
        if not sql.startswith('SELECT s."id", s."lease_owner", s."lease_epoch", EXISTS'):
            return None
        # The dialogs asked about: an array on PostgreSQL, one parameter each on SQLite.
        return len(params[-1]) if isinstance(params[-1], list) else len(params) - 1

    def alone(sql: str) -> bool:  # a boundary's read alone: the first waits for the rest
        return sql.startswith("SELECT EXISTS") and sql.count("EXISTS") == 1 and "lease_owner" in sql

    try:
        async with HoldFirst(alone, note=together) as hold:
            acks = [await send(engine, s, f"question {i}") for i, s in enumerate(dialogs)]
            await fake_model.requests_made(5)
            await send(engine, dialogs[2], "and briefly", mode="steer")
            await asyncio.sleep(0.2)
            gate.set()
            await hold.reached()
            await until_waiting(lambda: engine.workers.boundaries._waiting, 4, "the boundaries")
            hold.release()
            ends = [
                await rec.terminal(ack.turn_id, timeout=15)
                for rec, ack in zip(recorders, acks, strict=True)
            ]
    finally:
        gate.set()
    assert [end["status"] for end in ends] == ["completed"] * 5
    assert hold.seen == [4]  # the four that came while the first was read, in one statement
    steered = [(m.role, m.content) for m in await history(dialogs[2]) if m.role != "system"]
    assert steered[-3:] == [
        ("assistant", "the answer to question 2"),
        ("user", "and briefly"),
        ("assistant", "the answer to and briefly"),
    ]
    for i in (0, 1, 3, 4):
        got = [(m.role, m.content) for m in await history(dialogs[i]) if m.role != "system"]
        assert got[-2:] == [("user", f"question {i}"), ("assistant", f"the answer to question {i}")]


@pytest.mark.postgres
async def test_the_build_beside_an_admission_that_rolls_back_goes_unused(
    make_engine, fake_model, user, monkeypatch
):
    # covers: A4, C2, G6 (the input built beside an admission whose COMMIT fails is never
    # sent: the model request opens only on commit; the admission tried again starts the
    # turn, built anew, and the user message is stored and sent once)
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.utils import OperationalError

    from chatcore.engine import admission
    from chatcore.engine.engine import Engine

    failing: set[str] = set()
    real_start = admission.start_locked
    real_commit = BaseDatabaseWrapper.commit
    real_prepare = Engine._prepare_early
    builds: list[bool] = []

    def start_locked(*args: Any, **kwargs: Any) -> Any:
        if not builds:  # the first attempt: its COMMIT fails
            failing.add(threading.current_thread().name)
        return real_start(*args, **kwargs)

    def commit(self: BaseDatabaseWrapper) -> None:
        name = threading.current_thread().name
        if name in failing:
            failing.discard(name)
            raise OperationalError("could not serialize access (the test's)")
        real_commit(self)

    def prepare(self: Engine, started: Any, *, committed: bool) -> Any:
        builds.append(committed)
        return real_prepare(self, started, committed=committed)

    monkeypatch.setattr(admission, "start_locked", start_locked)
    monkeypatch.setattr(BaseDatabaseWrapper, "commit", commit)
    monkeypatch.setattr(Engine, "_prepare_early", prepare)
    engine = await make_engine(name="rolled-back")
    session = await make_dialog(user)
    fake_model.script(Reply(text="answered once"))
    ack = await send(engine, session, "hello")
    assert ack.turn_id is not None
    await engine.wait_idle(session.pk)
    assert len(builds) == 2  # one beside each attempt
    requests = fake_model.turn_requests()
    assert len(requests) == 1
    assert [strip_runtime(m["content"]) for m in requests[0].messages[1:]] == ["hello"]
    assert [m.content for m in await history(session) if m.role == "user"] == ["hello"]
