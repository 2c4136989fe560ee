"""Titles, compaction and sweeps (B4, B5, A6, A7, F1), in both modes: `embedded` runs the
jobs in-process under the engine's supervisor; `celery` runs them on a real Celery worker
consuming from the real Redis, with the Redis channel layer, as scaled mode does."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import override_settings
from django.utils import timezone

from chatcore.engine import jobs
from sessions_app import services
from sessions_app.models import Compaction, Message, Session
from tests.engine_helpers import chat_group_of, make_dialog, send
from tests.fakemodel import Reply, echo_reply
from tests.test_engine_turns import terminals

pytestmark = [pytest.mark.django_db(transaction=True)]


class Model:
    """Routes the fake server's requests: turns echo; titles and summaries get their own
    (replaceable) replies."""

    def __init__(self) -> None:
        self.title: Reply = Reply(text="Kyoto trip plans")
        self.summary: Reply = Reply(text="SUMMARY: the user plans a trip to Kyoto")
        self.title_requests: list[dict[str, Any]] = []
        self.title_arrivals: list[float] = []  # monotonic time each title request came in
        self.summary_requests: list[dict[str, Any]] = []

    def __call__(self, body: dict[str, Any]) -> Reply:
        if body.get("tools"):
            return echo_reply(body)
        system = body["messages"][0]["content"]
        if "title" in system or "标题" in system:
            self.title_requests.append(body)
            self.title_arrivals.append(time.monotonic())
            return self.title
        self.summary_requests.append(body)
        return self.summary


@pytest.fixture
def model(fake_model) -> Model:
    m = Model()
    fake_model.default = m
    return m


def _cfg(fake_model, **chat: Any) -> dict[str, Any]:
    return {
        "CHAT": {
            **settings.CHAT,
            "AUTO_TITLE_AFTER": 2,
            "RATE_LIMIT_PER_MINUTE": 10_000,
            "TITLE_RETRY_DELAYS": [0.05, 0.1, 0.2],
            **chat,
        },
        "LLM": {**settings.LLM, "BASE_URL": fake_model.url, "RETRY_BASE_DELAY": 0.01},
    }


@pytest.fixture(params=["embedded", pytest.param("celery", marks=pytest.mark.redis)])
def mode(request, fake_model) -> Iterator[str]:
    from django.core.cache import cache

    cache.clear()
    if request.param == "embedded":
        with override_settings(**_cfg(fake_model, LEASE_SECONDS=3, CLEANUP_INTERVAL_SECONDS=0)):
            yield "embedded"
        return
    redis_url = request.getfixturevalue("redis_url")
    from celery.contrib.testing.worker import start_worker

    from chatcore.celery import app

    queue = f"test-{uuid.uuid4().hex[:8]}"
    layers = {
        "default": {
            "BACKEND": "chatcore.common.redislayer.RedisPubSubLayer",
            "CONFIG": {"hosts": [redis_url]},
        }
    }
    app.conf.update(
        broker_url=redis_url,
        task_default_queue=queue,
        task_always_eager=False,
        broker_connection_retry_on_startup=True,
        # The worker's blocking read of the queue returns every 0.1 s (1 s by default), so
        # stopping the worker after each test does not wait out a whole second.
        broker_transport_options={
            **settings.CELERY_BROKER_TRANSPORT_OPTIONS,
            "polling_interval": 0.1,
        },
    )
    with override_settings(
        SCALED=True, REDIS_URL=redis_url, CHANNEL_LAYERS=layers, **_cfg(fake_model)
    ):
        with start_worker(
            app,
            pool="threads",
            concurrency=2,
            perform_ping_check=False,
            queues=[queue],
            loglevel="WARNING",
            shutdown_timeout=10,
        ):
            yield "celery"


async def until(pred, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await sync_to_async(pred)():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def chat(engine, session, rec, *texts: str) -> None:
    for text in texts:
        ack = await send(engine, session, text)
        await terminals(rec, [ack.turn_id])


async def title_of(session) -> tuple[str, str]:
    fresh = await sync_to_async(Session.objects.get)(pk=session.pk)
    return fresh.title, fresh.title_source


# --- B4: titles ------------------------------------------------------------------------------


async def test_title_is_generated_committed_and_broadcast(mode, model, make_engine, recorder, user):
    # covers: B4
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    await chat(engine, session, rec, "I want to visit Kyoto", "in spring")
    frames = await rec.until(lambda f: f["type"] == "session_updated", timeout=30)
    assert frames[-1]["title"] == "Kyoto trip plans"
    assert await title_of(session) == ("Kyoto trip plans", "auto")
    request = model.title_requests[0]
    assert "tools" not in request
    assert "title" in request["messages"][0]["content"]
    assert "I want to visit Kyoto" in request["messages"][1]["content"]


async def test_chinese_conversation_gets_the_chinese_title_prompt(
    mode, model, make_engine, recorder, user
):
    # covers: B4, F5
    model.title = Reply(text="京都春季旅行计划")
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    await chat(engine, session, rec, "我想去京都", "春天去")
    await rec.until(lambda f: f["type"] == "session_updated", timeout=30)
    assert "5-15 个中文字符" in model.title_requests[0]["messages"][0]["content"]
    assert (await title_of(session))[0] == "京都春季旅行计划"


async def test_rename_during_title_generation_wins(
    mode, model, fake_model, make_engine, recorder, user
):
    # covers: B4
    gate = threading.Event()
    model.title = Reply(text="Late automatic title", gate=gate)
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    await chat(engine, session, rec, "one", "two")
    await until(lambda: bool(model.title_requests))
    await sync_to_async(services.session_rename)(session=session, title="My own title")
    gate.set()
    await until(lambda: all(r.finished.is_set() for r in fake_model.requests))
    await asyncio.sleep(0.3)
    assert await title_of(session) == ("My own title", "user")


async def test_title_failure_is_a_warning_and_changes_nothing(
    mode, model, make_engine, recorder, user, caplog
):
    # covers: B4, C10
    caplog.set_level(logging.WARNING)
    model.title = Reply(status=500)
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    await chat(engine, session, rec, "one", "two")
    await until(lambda: any("title generation failed" in r.getMessage() for r in caplog.records))
    assert await title_of(session) == ("Dialog default", "default")
    assert not [f for f in rec.frames if f["type"] in ("session_updated", "system_notification")]


async def test_title_work_never_delays_the_next_turn(mode, model, make_engine, recorder, user):
    # covers: B4, C3
    gate = threading.Event()
    model.title = Reply(text="Eventually", gate=gate)
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    await chat(engine, session, rec, "one", "two")
    await until(lambda: bool(model.title_requests))
    # The title request hangs; the next turn still runs to completion.
    await chat(engine, session, rec, "three")
    assert (await title_of(session))[1] == "default"
    gate.set()
    await until(lambda: Session.objects.get(pk=session.pk).title == "Eventually")


async def test_the_next_turn_never_waits_for_the_title_to_be_scheduled(
    model, fake_model, make_engine, recorder, user
):
    # covers: B4, C3 (the title job is scheduled beside the worker: the dialog's next turn
    # does not wait for the job's guard on Redis or the broker)
    scheduler = HeldScheduler("generate_title")
    with override_settings(**_cfg(fake_model)):
        engine = await make_engine(scheduler=scheduler)
        session = await make_dialog(user)
        rec = await recorder(chat_group_of(session))
        try:
            first = await send(engine, session, "one")
            second = await send(engine, session, "two")
            third = await send(engine, session, "three")
            done = await terminals(rec, [first.turn_id, second.turn_id, third.turn_id], timeout=5)
            assert {f["status"] for f in done.values()} == {"completed"}
            # The title became due after the second answer (and, with no title yet, again
            # after the third); its scheduling is still held.
            assert scheduler.asked and set(scheduler.asked) == {str(session.pk)}
            assert not scheduler.gate.is_set()
        finally:
            scheduler.gate.set()


async def test_title_job_is_idempotent(mode, model, make_engine, user):
    # covers: B4 (re-delivery of the same task)
    await make_engine()
    session = await make_dialog(user)
    for text in ("one", "two"):
        await sync_to_async(services.messages_append)(
            session_pk=session.pk,
            messages=[services.NewMessage(role="user", content=text, kind="user_input")],
        )
    if mode == "celery":
        from sessions_app import tasks

        tasks.generate_title.delay(session.pk)
        await until(lambda: Session.objects.get(pk=session.pk).title_source == "auto")
        # The same task delivered again (acks_late after a lost ack): no model call, no change.
        result = tasks.generate_title.delay(session.pk)
        await until(lambda: result.id and len(model.title_requests) >= 1)
        await asyncio.sleep(1)
    else:
        await jobs.generate_title(session_pk=session.pk)
        await jobs.generate_title(session_pk=session.pk)
    assert len(model.title_requests) == 1
    assert await title_of(session) == ("Kyoto trip plans", "auto")


# --- B5: compaction --------------------------------------------------------------------------


async def test_compaction_summary_feeds_the_next_request_and_keeps_messages(
    mode, model, fake_model, make_engine, recorder, user
):
    # covers: B5, C7
    engine = await make_engine()
    session = await make_dialog(user, "long")
    rec = await recorder(chat_group_of(session))
    await chat(engine, session, rec, *[f"message number {i}" for i in range(6)])
    before = await sync_to_async(
        lambda: list(Message.objects.filter(session_id=session.pk).values_list("seq", "content"))
    )()
    await sync_to_async(engine.scheduler.schedule)(
        "compact_session", session_pk=session.pk, manual=True
    )
    frames = await rec.until(
        lambda f: f["type"] == "session_updated" and "compacted_through" in f, timeout=30
    )
    through = frames[-1]["compacted_through"]
    compaction = await sync_to_async(Compaction.objects.get)(session_id=session.pk)
    assert compaction.through_seq == through and "SUMMARY" in compaction.summary
    # Stored messages are never rewritten.
    after = await sync_to_async(
        lambda: list(Message.objects.filter(session_id=session.pk).values_list("seq", "content"))
    )()
    assert after == before
    await chat(engine, session, rec, "and now?")
    request = fake_model.turn_requests()[-1]
    contents = [str(m["content"]) for m in request.messages]
    assert any("SUMMARY: the user plans a trip to Kyoto" in c for c in contents)
    assert not any("message number 0" in c for c in contents)
    assert any("message number 5" in c for c in contents)
    assert model.summary_requests[0]["messages"][0]["role"] == "system"
    assert "Summarise" in model.summary_requests[0]["messages"][0]["content"]


class HeldScheduler:
    """A scheduler whose `job` blocks until `gate` is set (a broker that is slow to take it);
    other jobs are dropped."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.gate = threading.Event()
        self.asked: list[str] = []

    def schedule(self, job: str, **kwargs: Any) -> None:
        if job == self.job:
            self.asked.append(str(kwargs["session_pk"]))
            self.gate.wait(30)

    def warm(self) -> None:
        pass


async def test_a_long_dialogs_answer_never_waits_for_its_compaction_to_be_scheduled(
    model, fake_model, make_engine, recorder, user
):
    # covers: B5, G6 (scheduling the summary of a dialog past its budget is off the turn's
    # path: in scaled mode it is a round trip to Redis and one to the broker)
    scheduler = HeldScheduler("compact_session")
    with override_settings(**_cfg(fake_model)):
        engine = await make_engine(scheduler=scheduler)
        session = await make_dialog(user, "long")
        rec = await recorder(chat_group_of(session))
        await chat(
            engine, session, rec, *[f"message number {i} " + "words " * 40 for i in range(4)]
        )
        assert not scheduler.asked
        # From here the input no longer fits: the oldest messages are left out.
        engine.builder.context_window = 400
        try:
            ack = await send(engine, session, "and now?")
            done = await terminals(rec, [ack.turn_id], timeout=5)
            assert done[ack.turn_id]["status"] == "completed"
            # The answer came while the scheduling was still held.
            assert scheduler.asked == [str(session.pk)] and not scheduler.gate.is_set()
            request = fake_model.turn_requests()[-1]
            assert not any("message number 0" in str(m["content"]) for m in request.messages)
        finally:
            scheduler.gate.set()


async def test_compaction_is_skipped_when_the_dialog_changed(
    mode, model, make_engine, recorder, user
):
    # covers: B5
    gate = threading.Event()
    model.summary = Reply(text="stale summary", gate=gate)
    engine = await make_engine()
    session = await make_dialog(user, "long")
    rec = await recorder(chat_group_of(session))
    await chat(engine, session, rec, *[f"m{i}" for i in range(5)])
    await sync_to_async(engine.scheduler.schedule)(
        "compact_session", session_pk=session.pk, manual=True
    )
    await until(lambda: bool(model.summary_requests))
    await sync_to_async(services.messages_clear)(session=session)
    gate.set()
    await asyncio.sleep(1.0)
    assert await sync_to_async(Compaction.objects.filter(session_id=session.pk).count)() == 0


async def test_compact_command_with_little_history_says_so(
    mode, model, make_engine, recorder, user
):
    # covers: B5, B3
    from chatcore.engine.commands import CommandContext, run_command

    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    ctx = CommandContext(
        owner=user, channel="web", chat_id=session.chat_id, current=session, engine=engine
    )
    result = await run_command(ctx, "/compact")
    assert result.command == "compact" and result.ok
    frame = (await rec.until(lambda f: f["type"] == "system_notification", timeout=20))[-1]
    assert "Nothing to compact" in frame["content"]
    assert model.summary_requests == []


# --- A7 / A6: sweeps -------------------------------------------------------------------------


async def test_purge_after_retention(mode, make_engine, user):
    # covers: A7
    keep = await make_dialog(user, "keep")
    recent = await make_dialog(user, "recent")
    old = await make_dialog(user, "old")
    for s in (recent, old):
        await sync_to_async(services.session_soft_delete)(session=s)
    await sync_to_async(Session.objects.filter(pk=old.pk).update)(
        deleted_at=timezone.now() - timedelta(days=settings.CHAT["RETENTION_DAYS"] + 1)
    )
    if mode == "celery":
        from sessions_app import tasks

        tasks.purge_deleted_sessions.delay()
    else:
        await make_engine()  # its sweep purges in embedded mode
    await until(lambda: not Session.objects.filter(pk=old.pk).exists())
    assert not await sync_to_async(Message.objects.filter(session_id=old.pk).exists)()
    assert await sync_to_async(Session.objects.filter(pk__in=[keep.pk, recent.pk]).count)() == 2


async def test_idle_session_state_is_evicted(mode, make_engine, recorder, user):
    # covers: A6
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    await chat(engine, session, rec, "hello")
    assert session.pk in engine.states
    with override_settings(CHAT={**settings.CHAT, "SESSION_TTL_SECONDS": 0}):
        if mode == "celery":
            from sessions_app import tasks

            tasks.evict_idle_session_states.delay()
        await until(lambda: session.pk not in engine.states)
