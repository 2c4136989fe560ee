"""Background jobs go through the scheduler the engine is built with (B4, B5; issue 12): no
module global picks an engine, and the engine never imports the Celery tasks (they are
enqueued by name). Also the import contract itself (STYLE 15)."""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import cache
from django.test import override_settings

from chatcore.engine import jobs
from chatcore.engine.scheduler import CeleryScheduler
from tests.engine_helpers import chat_group_of, make_dialog, send
from tests.test_engine_turns import terminals

pytestmark = [pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parent.parent


async def test_an_injected_celery_scheduler_enqueues_the_title_job_by_name(
    make_engine, fake_model, recorder, user
):
    # covers: B4 (the scaled path: a task name after commit, once per dialog)
    sent: list[tuple[str, dict[str, Any]]] = []

    def send_task(name: str, *, kwargs: dict[str, Any]) -> None:
        sent.append((name, kwargs))

    cache.clear()
    with override_settings(CHAT={**settings.CHAT, "AUTO_TITLE_AFTER": 2}):
        engine = await make_engine(scheduler=CeleryScheduler(send_task=send_task))
        session = await make_dialog(user)
        rec = await recorder(chat_group_of(session))
        for text in ("one", "two", "three"):
            ack = await send(engine, session, text)
            await terminals(rec, [ack.turn_id])
    # Due after the first turn (welcome, user, answer); the pending guard keeps it to one.
    # The job carries the title's stage (B4), decided here rather than by the worker.
    assert sent == [
        ("sessions_app.tasks.generate_title", {"session_pk": session.pk, "stage": "auto"})
    ]


async def test_each_engine_runs_its_own_jobs(make_engine, fake_model, recorder, user):
    # covers: B5 (two engines in one process: a job asked of one runs under that one, even
    # when the other, started later, has shut down)
    first = await make_engine(name="first")
    second = await make_engine(name="second")
    await second.shutdown(grace=2)
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    cache.clear()
    await sync_to_async(first.scheduler.schedule)(
        "compact_session", session_pk=session.pk, manual=True
    )
    frames = await rec.until(lambda f: f["type"] == "system_notification")
    assert frames[-1]["content"] == "Nothing to compact yet."


def test_the_import_contract_holds() -> None:
    # covers: STYLE 15 (channels -> engine -> services/selectors -> models -> common)
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(  # noqa: S603
        [str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.redis
def test_the_broker_is_connected_at_start_and_the_first_job_goes_over_that_connection(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # covers: B4, B5, G6 (issue 10: Celery's first send in a process imports the broker's
    # transport and connects, about 0.1 s of the interpreter, which every stream of the
    # process paid when its first title or summary was scheduled; the engine's start does it)
    import redis
    from celery import Celery

    name = f"warm-{uuid.uuid4().hex[:8]}"
    queue = f"test-{name}"
    app = Celery(name, broker=redis_url, set_as_current=False)
    app.conf.update(task_default_queue=queue, broker_transport_options={"client_name": name})
    probe = redis.Redis.from_url(redis_url)

    def connections() -> int:
        return sum(1 for c in probe.client_list() if c.get("name") == name)

    scheduler = CeleryScheduler(app=app)
    try:
        assert connections() == 0
        scheduler.warm()
        made = connections()
        assert made >= 1
        cache.delete(jobs.guard_key("generate_title", name))
        scheduler.schedule("generate_title", session_pk=name)  # outside a transaction: now
        assert probe.llen(queue) == 1  # enqueued
        assert connections() == made  # over the connection made at start
    finally:
        cache.delete(jobs.guard_key("generate_title", name))
        probe.delete(queue)
        app.close()

    # A broker that is away at start is no error: it is said, and the first job connects.
    away = Celery(f"{name}-away", broker="redis://127.0.0.1:1/0", set_as_current=False)
    caplog.set_level(logging.WARNING, logger="chatcore.engine.scheduler")
    CeleryScheduler(app=away).warm()
    assert "could not reach the broker at start" in caplog.text
    away.close()


def test_a_frozen_broker_fails_a_job_within_seconds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # covers: I3, G5 (kombu waits forever for a broker that accepts and never answers,
    # unless told: the settings' transport options bound each publish, and the job is said
    # not enqueued; the next turn that makes it due schedules it again)
    import shutil
    import time

    from celery import Celery

    from tests.conftest import IN_CI
    from tests.scaled import RedisServer

    if shutil.which("redis-server") is None:
        if IN_CI:
            pytest.fail("needs the redis-server binary (CI must run it)")
        pytest.skip("needs the redis-server binary")
    server = RedisServer(tmp_path / "redis").start()
    options = {**settings.CELERY_BROKER_TRANSPORT_OPTIONS, "socket_timeout": 0.5}
    options["socket_connect_timeout"] = 0.5
    app = Celery(f"frozen-{uuid.uuid4().hex[:8]}", broker=server.url, set_as_current=False)
    app.conf.update(broker_transport_options=options)
    caplog.set_level(logging.WARNING, logger="chatcore.engine.scheduler")
    server.freeze()
    try:
        started = time.monotonic()
        CeleryScheduler(app=app).schedule("generate_title", session_pk=uuid.uuid4().hex)
        assert time.monotonic() - started < 10
        assert "generate_title not enqueued" in caplog.text
    finally:
        server.stop()
        app.close()
