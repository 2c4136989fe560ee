"""Per-process housekeeping is batched (issue 10; C6, C11, G2): one checkpoint pass, one
transaction with a constant number of statements, for all the turns a process runs, and one
fenced statement renewing all the leases it holds.

The checkpoint pass is watched by wrapping `recovery.checkpoint_all` (the real function runs):
each call records the statements it ran on its own connection and what it found.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connection
from django.db.models import F
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from chatcore.engine import lease, queue, recovery, turn_controls
from sessions_app.models import Message, Session, Turn, TurnStatus
from tests.engine_helpers import chat_group_of, make_dialog, send
from tests.fakemodel import Reply, user_texts

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]

DIALOGS = 12
# Lock the held sessions, write the changed texts, read the stop flags.
STATEMENTS_PER_PASS = 3


@dataclass
class Pass:
    items: list[recovery.Checkpoint]
    statements: list[str]
    found: recovery.CheckpointPass


class PassLog:
    """Every checkpoint pass of the process: its turns, statements and findings."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.passes: list[Pass] = []
        real = recovery.checkpoint_all

        def counted(items: list[recovery.Checkpoint]) -> recovery.CheckpointPass:
            with CaptureQueriesContext(connection) as ctx:
                found = real(items)
            # Transaction control is not a statement of the pass (the transaction is one).
            statements = [
                q["sql"]
                for q in ctx.captured_queries
                if q["sql"].split()[0].upper() not in ("BEGIN", "COMMIT")
            ]
            self.passes.append(Pass(list(items), statements, found))
            return found

        monkeypatch.setattr(recovery, "checkpoint_all", counted)

    async def until(self, pred: Any, what: str, timeout: float = 30.0) -> Pass:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        seen = 0
        while True:
            for p in self.passes[seen:]:
                if pred(p):
                    return p
            seen = len(self.passes)
            if loop.time() > deadline:
                raise AssertionError(f"no checkpoint pass {what} in {len(self.passes)} passes")
            await asyncio.sleep(0.02)


def endless_answer(request: dict[str, Any]) -> Reply:
    """Each dialog's answer names its question and streams until the client hangs up."""
    last = [m["content"] for m in request["messages"] if m["role"] == "user"][-1]
    return Reply(text=f"answer to {last.split()[0]} ", endless=True)


async def run_many(make_engine: Any, fake_model: Any, user: Any, settings: Any) -> Any:
    """DIALOGS turns running at once in one process; checkpoints five times a second."""
    settings.CHAT = {
        **settings.CHAT,
        "CHECKPOINT_SECONDS": 0.2,
        "LEASE_SECONDS": 600,  # no renewal during the test
        "USER_RUNNING_TURNS": DIALOGS,
    }
    fake_model.default = endless_answer
    engine = await make_engine(name="batching-process")
    sessions = [await make_dialog(user, f"d{i}") for i in range(DIALOGS)]
    acks = [await send(engine, s, f"q{i} please") for i, s in enumerate(sessions)]
    await fake_model.requests_made(DIALOGS)
    return engine, sessions, [a.turn_id for a in acks]


def request_of(fake_model: Any, question: str) -> Any:
    return next(r for r in fake_model.requests if user_texts(r)[-1].startswith(question))


async def partials(turn_ids: list[str]) -> dict[str, str]:
    rows = await sync_to_async(
        lambda: dict(Turn.objects.filter(pk__in=turn_ids).values_list("pk", "partial_text"))
    )()
    return {str(pk): text for pk, text in rows.items()}


async def test_all_running_turns_are_checkpointed_in_one_pass_of_constant_statements(
    make_engine, fake_model, user, settings, monkeypatch
):
    # covers: C11, G2 (issue 10: one checkpoint pass per beat for all turns of a process)
    log = PassLog(monkeypatch)
    engine, sessions, turn_ids = await run_many(make_engine, fake_model, user, settings)
    wanted = set(turn_ids)
    full = await log.until(
        lambda p: (
            {i.turn_id for i in p.items} == wanted
            and {i.turn_id for i in p.items if i.text} == wanted
        ),
        "that wrote the text of every running turn",
    )
    assert len(full.statements) == STATEMENTS_PER_PASS, "\n".join(full.statements)
    assert full.found.lost == set() and full.found.cancel == set()
    # Every pass, with one turn or all of them, ran at most that many statements.
    for p in log.passes:
        assert len(p.statements) <= STATEMENTS_PER_PASS, "\n".join(p.statements)
    # The partial text of each turn is its own answer, on the turn record only (C11).
    stored = await partials(turn_ids)
    for i, turn_id in enumerate(turn_ids):
        assert stored[turn_id].startswith(f"answer to q{i} ")
    assert (
        await sync_to_async(
            Message.objects.filter(session_id__in=[s.pk for s in sessions], role="assistant").count
        )()
        == 0
    )
    # A pass writes only the texts that changed since the turn's last checkpoint.
    last_sent: dict[str, str] = {}
    for p in list(log.passes):
        for item in p.items:
            if item.text is not None:
                assert last_sent.get(item.turn_id) != item.text, "an unchanged text was sent"
                last_sent[item.turn_id] = item.text


async def test_a_stop_requested_elsewhere_reaches_only_its_turn(
    make_engine, fake_model, recorder, user, settings, monkeypatch
):
    # covers: C6 (fallback through the checkpoint), C11
    log = PassLog(monkeypatch)
    engine, sessions, turn_ids = await run_many(make_engine, fake_model, user, settings)
    rec = await recorder(chat_group_of(sessions[0]))
    stopped = turn_ids[3]
    # What a process that does not run the turn does for a stop (turn_controls.request_cancel).
    await sync_to_async(turn_controls.request_cancel)(stopped)
    found = await log.until(lambda p: stopped in p.found.cancel, "that saw the stop")
    assert found.found.cancel == {stopped}
    assert (await rec.terminal(stopped))["status"] == "cancelled"
    aborted = await sync_to_async(
        request_of(fake_model, "q3").aborted.wait, thread_sensitive=False
    )(15)
    assert aborted, "the stopped turn's upstream stream stayed open"
    # The other turns go on and keep being checkpointed.
    others = set(turn_ids) - {stopped}
    await log.until(
        lambda p: {i.turn_id for i in p.items} == others and any(i.text for i in p.items),
        "of the other turns after the stop",
    )
    statuses = await sync_to_async(
        lambda: dict(Turn.objects.filter(pk__in=turn_ids).values_list("pk", "status"))
    )()
    assert {str(pk): s for pk, s in statuses.items() if s != "running"} == {stopped: "cancelled"}
    assert [r for r in fake_model.requests if r.aborted.is_set()] == [request_of(fake_model, "q3")]


async def test_a_turn_whose_lease_was_taken_over_is_cancelled_and_writes_nothing(
    make_engine, fake_model, recorder, user, settings, monkeypatch
):
    # covers: G2 (the batched checkpoint is fenced per dialog), C11
    log = PassLog(monkeypatch)
    engine, sessions, turn_ids = await run_many(make_engine, fake_model, user, settings)
    rec = await recorder(chat_group_of(sessions[0]))
    stolen_session, stolen = sessions[5], turn_ids[5]
    await log.until(lambda p: stolen in {i.turn_id for i in p.items if i.text}, "with text")
    # What another process's takeover does to the row: new owner, next epoch. Any pass that
    # had the row locked before has committed by the time this returns.
    await sync_to_async(Session.objects.filter(pk=stolen_session.pk).update)(
        lease_owner="other-process",
        lease_expires_at=timezone.now() + timedelta(seconds=60),
        lease_epoch=F("lease_epoch") + 1,
    )
    before = await partials(turn_ids)
    lost = await log.until(lambda p: stolen in p.found.lost, "that found the lease lost")
    assert lost.found.lost == {stolen}
    # The same pass checkpointed the other turns whose text changed.
    written = {i.turn_id for i in lost.items if i.text is not None} - {stolen}
    assert written, "the pass that found the lost lease wrote nothing for the others"
    aborted = await sync_to_async(
        request_of(fake_model, "q5").aborted.wait, thread_sensitive=False
    )(15)
    assert aborted, "the upstream stream stayed open after the lease was lost"
    await engine.wait_idle(stolen_session.pk, timeout=30)
    # Two more passes for the others: their text grows, the stale turn's never moves.
    mark = len(log.passes)
    await log.until(lambda _p: len(log.passes) > mark + 1, "after the takeover")
    after = await partials(turn_ids)
    assert after[stolen] == before[stolen], "a stale holder wrote a checkpoint"
    grown = [t for t in turn_ids if t != stolen and len(after[t]) > len(before[t])]
    assert grown, "the other turns were not checkpointed after the takeover"
    row = await sync_to_async(Turn.objects.get)(pk=stolen)
    assert row.status == "running", "a stale holder wrote the turn's end"
    with pytest.raises(TimeoutError):
        await rec.until(lambda f: f["type"] == "turn_updated", timeout=1)
    assert engine.workers.tasks.get(stolen_session.pk) is None
    fresh = await sync_to_async(Session.objects.get)(pk=stolen_session.pk)
    assert fresh.lease_owner == "other-process", "a stale holder released another's lease"


def test_one_statement_renews_every_lease_and_a_taken_over_one_is_lost(user):
    # covers: G2, C3 (issue 10: one lease renewal statement for all dialogs of a process)
    from sessions_app import services

    sessions = [
        services.session_create(owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id=f"d{i}")
        for i in range(6)
    ]
    held = [lease.acquire(s.pk, owner="this-process", seconds=30) for s in sessions]
    assert all(h is not None for h in held)
    leases = [h for h in held if h is not None]
    # One lease expired without anybody taking it over: still ours. One was taken over. One
    # was released (the dialog's queue ran empty).
    expired, taken, released = leases[1], leases[2], leases[3]
    Session.objects.filter(pk=expired.session_pk).update(
        lease_expires_at=timezone.now() - timedelta(seconds=5)
    )
    Session.objects.filter(pk=taken.session_pk).update(
        lease_owner="other-process", lease_epoch=F("lease_epoch") + 1
    )
    lease.release(released)
    before = dict(Session.objects.values_list("pk", "lease_expires_at"))
    asked = time.monotonic()

    with CaptureQueriesContext(connection) as ctx:
        lost = queue.renew_leases(leases)

    assert len(ctx.captured_queries) == 1, [q["sql"] for q in ctx.captured_queries]
    assert lost == [taken]
    assert taken.lost and not taken.trusted
    rows = {s.pk: s for s in Session.objects.all()}
    for h in leases:
        if h in (taken, released):
            continue
        assert not h.lost and h.confirmed_at >= asked
        assert rows[h.session_pk].lease_expires_at > timezone.now() + timedelta(seconds=20)
        assert rows[h.session_pk].lease_expires_at > before[h.session_pk]
    # The takeover's row and the released one are left as they were.
    assert (rows[taken.session_pk].lease_owner, rows[taken.session_pk].lease_epoch) == (
        "other-process",
        taken.epoch + 1,
    )
    assert rows[taken.session_pk].lease_expires_at == before[taken.session_pk]
    assert rows[released.session_pk].lease_owner == ""
    assert not released.lost
    # Leases known lost or released are not asked about again.
    with CaptureQueriesContext(connection) as ctx:
        assert queue.renew_leases([taken, released]) == []
    assert ctx.captured_queries == []


def test_an_idle_dialog_gives_its_lease_up_in_one_statement_unless_a_turn_is_queued(user):
    # covers: C1, C11, G2 (issue 10: the release after a turn looks at the queue atomically;
    # a turn started under the lease at its admission, for the holder to run, keeps it too)
    from django.conf import settings as django_settings

    from chatcore.engine.sessions import SessionStates
    from sessions_app import services

    def dialog(name: str) -> Any:
        return services.session_create(
            owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id=name
        )

    idle, waiting, taken = dialog("idle"), dialog("waiting"), dialog("taken")
    handed = dialog("handed")
    held: dict[str, lease.Lease] = {}
    for s in (idle, waiting, taken, handed):
        got = lease.acquire(s.pk, owner="this-process", seconds=30)
        assert got is not None
        held[s.pk] = got
    Turn.objects.create(session=waiting, owner=user, number=1, content="queued meanwhile")
    Turn.objects.create(
        session=handed, owner=user, number=1, content="started", status=TurnStatus.RUNNING
    )
    Session.objects.filter(pk=taken.pk).update(
        lease_owner="other-process", lease_epoch=F("lease_epoch") + 1
    )

    with CaptureQueriesContext(connection) as ctx:
        released = {pk: queue.release_if_idle(h) for pk, h in held.items()}
    # One statement each; on PostgreSQL the row's lock first (see `lease.release_if_idle`).
    per_release = 2 if connection.features.has_select_for_update else 1
    statements = [q["sql"] for q in ctx.captured_queries if q["sql"] not in ("BEGIN", "COMMIT")]
    assert len(statements) == 4 * per_release, statements

    assert released == {idle.pk: True, waiting.pk: False, taken.pk: False, handed.pk: False}
    rows = {s.pk: s for s in Session.objects.all()}
    # The idle dialog's lease is free for whoever queues next.
    assert rows[idle.pk].lease_owner == "" and rows[idle.pk].lease_expires_at is None
    # The queued turn keeps the lease with its holder, which claims it next; so does the
    # turn started under it, which the holder runs next.
    assert rows[waiting.pk].lease_owner == "this-process"
    assert rows[handed.pk].lease_owner == "this-process"
    claimed = queue.claim_next(
        waiting.pk, held[waiting.pk], cfg=django_settings.CHAT, states=SessionStates()
    )
    assert isinstance(claimed, queue.Started) and claimed.turn.content == "queued meanwhile"
    # A successor's lease is never cleared.
    assert (rows[taken.pk].lease_owner, rows[taken.pk].lease_epoch) == (
        "other-process",
        held[taken.pk].epoch + 1,
    )


def test_the_sweep_finds_dialogs_with_work_and_no_live_lease_in_one_statement_when_none(user):
    # covers: C11, F7, G2 (every process's sweep, every few seconds: with nothing to pick up
    # it costs one statement; a queued turn under no lease or an expired one is found, a
    # live lease's is not)
    from django.conf import settings as django_settings

    from sessions_app import services

    def dialog(name: str) -> Any:
        return services.session_create(
            owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id=name
        )

    cfg = django_settings.CHAT
    running, idle = dialog("running"), dialog("idle")
    assert lease.acquire(running.pk, owner="this-process", seconds=30) is not None
    Turn.objects.create(
        session=running, owner=user, number=1, content="under way", status=TurnStatus.RUNNING
    )
    with CaptureQueriesContext(connection) as ctx:
        assert recovery.orphaned_sessions(scope=None, cfg=cfg) == []
    assert len(ctx.captured_queries) == 1, [q["sql"] for q in ctx.captured_queries]

    # A queued turn whose dialog has no lease, and one whose lease ran out.
    leaseless, expired = dialog("leaseless"), dialog("expired")
    Turn.objects.create(session=leaseless, owner=user, number=1, content="waits")
    assert lease.acquire(expired.pk, owner="gone-process", seconds=30) is not None
    Turn.objects.create(session=expired, owner=user, number=1, content="waits too")
    Session.objects.filter(pk=expired.pk).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    found = recovery.orphaned_sessions(scope=None, cfg=cfg)
    assert sorted(found) == sorted([leaseless.pk, expired.pk])
    assert idle.pk not in found and running.pk not in found
    # A scope leaves out what is not this engine's to run.
    scoped = recovery.orphaned_sessions(scope=lambda qs: qs.filter(pk=expired.pk), cfg=cfg)
    assert scoped == [expired.pk]
