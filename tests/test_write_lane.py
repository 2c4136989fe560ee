"""The write lane (G6, issue 10 item 3): on SQLite, whose writes take turns anyway, the
admissions and final commits of many turns go to the database threads a batch per trip
(`chatcore.common.dbthreads.Lane`), each with its own result, its own error and its own
retries; readers and `/stop` do not wait for the lane."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest
from django.db import OperationalError

from chatcore.common import dbthreads
from chatcore.common.dbthreads import Lane
from sessions_app import storage
from tests.engine_helpers import history, make_dialog, send

pytestmark = [pytest.mark.django_db(transaction=True)]


def _count_trips(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the functions the database threads ran, one per trip."""
    trips: list[str] = []
    real = dbthreads._call

    def call(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        trips.append(getattr(fn, "__name__", repr(fn)))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(dbthreads, "_call", call)
    return trips


async def test_a_burst_of_sends_is_admitted_in_a_few_trips_and_every_one_runs(
    make_engine, fake_model, user, settings, monkeypatch
):
    # covers: G6, C1, C3 (one trip per batch of admissions, each send its own turn)
    settings.CHAT = {**settings.CHAT, "USER_RUNNING_TURNS": 100}
    engine = await make_engine()
    assert engine.writes is not None  # embedded mode: SQLite
    dialogs = [await make_dialog(user, f"d{i}") for i in range(24)]
    trips = _count_trips(monkeypatch)
    acks = await asyncio.gather(*(send(engine, d, f"question {i}") for i, d in enumerate(dialogs)))
    batches = trips.count("_run_each")
    monkeypatch.undo()
    assert all(ack.turn_id and ack.position == 0 for ack in acks)
    assert len({ack.turn_id for ack in acks}) == 24
    # Sends that arrived while a trip was under way went together in the next one.
    assert 1 <= batches < 24
    await engine.wait_idle()
    for i, dialog in enumerate(dialogs):
        texts = [m.content for m in await history(dialog) if m.role in ("user", "assistant")]
        assert texts[0] == f"question {i}"
        assert len(texts) == 2


async def test_each_call_of_a_batch_has_its_own_result_error_and_context() -> None:
    # covers: G6, A4 (one call's failure is its own; the caller's context goes with its call)
    lane = Lane("test")
    flag: contextvars.ContextVar[str] = contextvars.ContextVar("flag", default="unset")

    def ok(n: int) -> Any:
        return lambda: (n, flag.get())

    def broken() -> Any:
        raise OperationalError("database is locked")

    async def call(n: int) -> Any:
        flag.set(f"caller {n}")
        if n == 3:
            return await lane.run(broken)
        return await lane.run(ok(n))

    results = await asyncio.gather(*(call(n) for n in range(6)), return_exceptions=True)
    assert isinstance(results[3], OperationalError)
    assert [r for i, r in enumerate(results) if i != 3] == [
        (n, f"caller {n}") for n in range(6) if n != 3
    ]


async def test_a_write_in_the_lane_is_retried_after_its_backoff(settings) -> None:
    # covers: A4 (the lane keeps storage's retries: one attempt per trip, the wait on the loop)
    settings.CHAT = {**settings.CHAT, "STORAGE_RETRY_DELAYS_MS": [10, 10]}
    lane = Lane("test")
    attempts: list[int] = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise OperationalError("database is locked")
        return "written"

    assert await storage.astorage_retry(flaky, what="test", lane=lane) == "written"
    assert len(attempts) == 3
