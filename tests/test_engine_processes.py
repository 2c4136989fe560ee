"""Several engines on one database, as several server processes would be (C3, C6, C11, F1).

Each engine has its own process id and lease identity; they share the database and the
channel layer exactly as separate Daphne processes do in scaled mode.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from sessions_app.models import Message, Session, Turn
from tests.engine_helpers import chat_group_of, history, make_dialog, send
from tests.fakemodel import Reply, user_texts
from tests.test_engine_turns import terminals

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


async def test_two_engines_never_overlap_turns_of_one_dialog(
    make_engine, fake_model, recorder, user
):
    # covers: C3
    engines = [await make_engine(name="proc-1"), await make_engine(name="proc-2")]
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(*[Reply(text=f"answer {i} " * 5, chunk=2, delay=0.002) for i in range(6)])
    acks = []
    for i in range(6):
        acks.append(await send(engines[i % 2], session, f"m{i}"))
    done = await terminals(rec, [a.turn_id for a in acks], timeout=60)
    assert all(f["status"] == "completed" for f in done.values())
    assert fake_model.max_active == 1, "two turns of one dialog ran at the same time"
    reqs = fake_model.turn_requests()
    assert [user_texts(r)[-1] for r in reqs] == [f"m{i}" for i in range(6)]
    for i, req in enumerate(reqs[1:], start=1):
        assert any(
            m["role"] == "assistant" and m["content"].startswith(f"answer {i - 1}")
            for m in req.messages
        )


async def test_two_engines_run_different_dialogs_in_parallel(
    make_engine, fake_model, recorder, user
):
    # covers: C3
    e1, e2 = await make_engine(name="proc-1"), await make_engine(name="proc-2")
    a = await make_dialog(user, "a")
    b = await make_dialog(user, "b")
    rec = await recorder(chat_group_of(a))
    import threading

    gate = threading.Event()
    fake_model.script(Reply(text="a", gate=gate), Reply(text="b", gate=gate))
    ta = await send(e1, a, "for a")
    tb = await send(e2, b, "for b")
    await fake_model.requests_made(2)
    assert fake_model.max_active == 2
    gate.set()
    await terminals(rec, [ta.turn_id, tb.turn_id])


async def test_a_live_lease_of_another_process_is_never_stolen(make_engine, fake_model, user):
    # covers: C11, C3
    session = await make_dialog(user)
    await sync_to_async(Session.objects.filter(pk=session.pk).update)(
        lease_owner="other-process", lease_expires_at=timezone.now() + timedelta(seconds=60)
    )
    engine = await make_engine()
    await send(engine, session, "waits for the other process")
    await asyncio.sleep(0.5)
    assert fake_model.requests == []
    turn = await sync_to_async(Turn.objects.get)(session_id=session.pk)
    assert turn.status == "queued"


async def test_orphaned_work_is_recovered_in_order_after_a_crash(
    make_engine, fake_model, recorder, user
):
    # covers: C11, C2, A5
    session = await make_dialog(user)
    past = timezone.now() - timedelta(seconds=60)

    def crashed_state() -> None:
        Session.objects.filter(pk=session.pk).update(
            lease_owner="dead-process", lease_expires_at=past, turn_counter=3
        )
        Turn.objects.create(
            session_id=session.pk,
            owner=user,
            number=1,
            content="first",
            status="running",
            started_at=past,
            partial_text="I was saying som",
        )
        Turn.objects.create(session_id=session.pk, owner=user, number=2, content="second")
        Turn.objects.create(session_id=session.pk, owner=user, number=3, content="third")

    await sync_to_async(crashed_state)()
    # The interrupted turn's user message was recorded before the crash.
    from sessions_app import services

    await sync_to_async(services.messages_append)(
        session_pk=session.pk,
        messages=[services.NewMessage(role="user", content="first", kind="user_input")],
    )
    rec = await recorder(chat_group_of(session))
    await make_engine()  # its sweep finds the orphaned dialog
    turns = await sync_to_async(lambda: list(Turn.objects.order_by("number")))()
    done = await terminals(rec, [str(t.pk) for t in turns], timeout=30)
    first, second, third = (done[str(t.pk)] for t in turns)
    assert first["status"] == "failed" and first["error"]["kind"] == "interrupted"
    assert second["status"] == "completed" and third["status"] == "completed"
    rows = await history(session)
    assert [(m.role, m.content, m.status) for m in rows[1:]] == [
        ("user", "first", ""),
        ("assistant", "I was saying som", "interrupted"),
        ("user", "second", ""),
        ("assistant", "echo: second", ""),
        ("user", "third", ""),
        ("assistant", "echo: third", ""),
    ]


async def test_shutdown_is_bounded_and_keeps_queued_sends(make_engine, fake_model, recorder, user):
    # covers: F1, C2, C11
    engine = await make_engine(name="old-process")
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="never finishing", endless=True))
    running = await send(engine, session, "long")
    await fake_model.requests_made(1)
    queued = await send(engine, session, "after the restart")
    loop = asyncio.get_running_loop()
    started = loop.time()
    await engine.shutdown(grace=1)
    assert len(engine.supervisor) == 0
    assert loop.time() - started < 10
    done = await terminals(rec, [running.turn_id])
    assert done[running.turn_id]["status"] == "failed"
    assert done[running.turn_id]["error"]["kind"] == "interrupted"
    assert (await sync_to_async(Turn.objects.get)(pk=queued.turn_id)).status == "queued"
    # A new process picks the queued send up.
    await make_engine(name="new-process")
    done = await terminals(rec, [queued.turn_id], timeout=30)
    assert done[queued.turn_id]["status"] == "completed"
    assert (
        await sync_to_async(
            Message.objects.filter(session_id=session.pk, content="after the restart").count
        )()
        == 1
    )


async def _steal_lease(session_pk: str) -> None:
    """What another process's takeover does to the row: new owner, next epoch."""
    from django.db.models import F

    await sync_to_async(Session.objects.filter(pk=session_pk).update)(
        lease_owner="other-process",
        lease_expires_at=timezone.now() + timedelta(seconds=60),
        lease_epoch=F("lease_epoch") + 1,
    )


async def test_a_stale_holder_commits_and_publishes_nothing(
    make_engine, fake_model, recorder, user, settings
):
    # covers: G2 (the commit checks the lease's epoch in its own transaction)
    import threading

    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 60}  # no renewal during the test
    engine = await make_engine(name="stale-process")
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    gate = threading.Event()
    fake_model.script(Reply(text="an answer nobody may keep", gate=gate))
    ack = await send(engine, session, "hello")
    await fake_model.requests_made(1)
    await _steal_lease(session.pk)
    gate.set()
    await engine.wait_idle(session.pk, timeout=30)
    turn = await sync_to_async(Turn.objects.get)(pk=ack.turn_id)
    assert turn.status == "running", "a stale holder wrote the turn's end"
    rows = await history(session)
    assert [m.content for m in rows if m.role == "assistant"] == []
    assert [
        f for f in rec.frames if f.get("turn_id") == ack.turn_id and f["type"] != "history_delta"
    ] == []
    with pytest.raises(TimeoutError):
        await rec.until(lambda f: f["type"] == "turn_updated", timeout=1)
    fresh = await sync_to_async(Session.objects.get)(pk=session.pk)
    assert fresh.lease_owner == "other-process", "a stale holder released another's lease"


async def test_losing_a_renewal_cancels_the_turn_and_closes_the_stream(
    make_engine, fake_model, recorder, user, settings
):
    # covers: G2 (a lost renewal cancels the local turn at once; the upstream closes)
    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 3}
    engine = await make_engine(name="renewing-process")
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="streaming until told otherwise ", endless=True))
    ack = await send(engine, session, "go on")
    await fake_model.requests_made(1)
    await _steal_lease(session.pk)
    aborted = await sync_to_async(fake_model.requests[0].aborted.wait, thread_sensitive=False)(15)
    assert aborted, "the upstream stream stayed open after the lease was lost"
    await engine.wait_idle(session.pk, timeout=30)
    assert (await sync_to_async(Turn.objects.get)(pk=ack.turn_id)).status == "running"
    assert [f for f in rec.frames if f["type"] == "turn_updated"] == []
