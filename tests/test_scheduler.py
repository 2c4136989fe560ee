"""Background jobs go through the scheduler the engine is built with (B4, B5; issue 12): no
module global picks an engine, and the engine never imports the Celery tasks (they are
enqueued by name). Also the import contract itself (STYLE 15)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import cache
from django.test import override_settings

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
    assert sent == [("sessions_app.tasks.generate_title", {"session_pk": session.pk})]


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
