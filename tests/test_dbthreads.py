"""The database threads (`chatcore.common.dbthreads`; SPEC F7, I2, I3): a call that blocks
holds its own thread only, never the event loop; a synchronous caller's calls run on its own
thread, inside its open transaction."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from asgiref.sync import async_to_sync
from django.db import connection, transaction

from chatcore.common import dbthreads
from chatcore.common.dbthreads import Batch, Lane, on_db, start_on_db


async def test_blocked_database_threads_leave_the_loop_and_the_other_threads_running() -> None:
    # covers: I3, F7 (a database call that hangs slows only what waits for it)
    gate = threading.Event()
    count = dbthreads.thread_count()
    try:
        stuck = asyncio.ensure_future(on_db(gate.wait)(10))
        # One thread held: the others still take calls.
        assert await asyncio.wait_for(on_db(lambda: "answered")(), 5) == "answered"
        rest = [asyncio.ensure_future(on_db(gate.wait)(10)) for _ in range(count - 1)]
        queued = asyncio.ensure_future(on_db(lambda: "queued")())
        # Every thread held: the loop's timers still fire on time, the queued call waits.
        started = time.monotonic()
        await asyncio.sleep(0.05)
        assert time.monotonic() - started < 2  # the held threads wait 10 s
        assert not queued.done()
    finally:
        gate.set()
    assert await asyncio.wait_for(queued, 5) == "queued"
    assert await asyncio.wait_for(asyncio.gather(stuck, *rest), 5) == [True] * count


@pytest.mark.both_dbs
@pytest.mark.django_db(transaction=True)
def test_a_synchronous_callers_calls_run_on_its_thread_inside_its_transaction() -> None:
    # covers: I2 (asgiref's undocumented `AsyncToSync.executors`, measured with asgiref
    # 3.13.0: if an upgrade changes it, these calls go to a database thread, outside the
    # caller's transaction, and this fails)
    caller = threading.current_thread()
    seen: list[tuple[str, bool, bool]] = []

    def probe(where: str) -> str:
        seen.append((where, threading.current_thread() is caller, connection.in_atomic_block))
        return where

    async def calls() -> None:
        assert await on_db(probe)("on_db") == "on_db"
        assert await Lane("sync-caller").run(lambda: probe("lane")) == "lane"
        batch: Batch[str, str] = Batch("sync-caller", lambda items: [probe(i) for i in items])
        assert await batch.run("batch") == "batch"
        assert start_on_db(lambda: probe("started")) is None

    with transaction.atomic():
        async_to_sync(calls)()
    assert seen == [(where, True, True) for where in ("on_db", "lane", "batch")]
