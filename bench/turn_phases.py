"""Where a turn's CPU goes, embedded mode: every trip to the database threads (`on_db`) a
turn makes, with its calls, thread CPU and statements per turn, and the event loop's CPU.

    .venv/bin/python bench/turn_phases.py [--turns 200] [--code-root PATH]

Sequential turns in one dialog against a zero-latency model (`httpx.MockTransport`), after a
warm-up; CPU is thread CPU time (`time.thread_time`), so the figures hold up on a busy
machine better than wall times. `--code-root` measures another checkout (a worktree of an
older commit) with the same script, for a before/after in one sitting. It creates its own
SQLite database in a temporary folder.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# This checkout's helpers, whichever checkout is measured (`--code-root`).
from bench.engine_bench import start_engine  # noqa: E402


class Trips:
    """Per-function totals of the database threads' calls while `counting`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counting = False
        self.by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
        self.local = threading.local()

    def install(self) -> None:
        from django.db.backends.utils import CursorWrapper

        from chatcore.common import dbthreads

        trips = self
        real_execute = getattr(CursorWrapper, "_execute")  # noqa: B009
        real_call = dbthreads._call

        def execute(self: CursorWrapper, sql: str, params: Any, *rest: Any) -> Any:
            trips.local.statements = getattr(trips.local, "statements", 0) + 1
            return real_execute(self, sql, params, *rest)

        def call(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            inner = fn
            while hasattr(inner, "func"):
                inner = inner.func
            name = getattr(inner, "__qualname__", type(inner).__name__)
            started, wall = time.thread_time(), time.perf_counter()
            trips.local.statements = 0
            try:
                return real_call(fn, *args, **kwargs)
            finally:
                if trips.counting:
                    with trips.lock:
                        row = trips.by_name[name]
                        row[0] += 1
                        row[1] += time.thread_time() - started
                        row[2] += trips.local.statements
                        row[3] += time.perf_counter() - wall

        setattr(CursorWrapper, "_execute", execute)  # noqa: B010
        dbthreads._call = call


async def main(args: argparse.Namespace, trips: Trips) -> None:
    from asgiref.sync import sync_to_async
    from channels.layers import get_channel_layer

    from chatcore.common import publish
    from chatcore.engine.engine import Inbound
    from sessions_app import services

    user, engine = await start_engine()
    layer = get_channel_layer()
    session = await sync_to_async(services.session_create)(
        owner=user, channel="api", chat_id=f"u{user.pk}", dialog_id="phases"
    )
    channel = await layer.new_channel("bench.")
    await layer.group_add(publish.session_group(session.pk), channel)
    await layer.group_add(publish.chat_group(session.channel, session.chat_id), channel)
    firsts: list[float] = []

    async def one(i: int) -> None:
        inbound = Inbound(
            owner=user, channel="api", chat_id=f"u{user.pk}", content=f"q {i}", sender_id="b"
        )
        started = time.perf_counter()
        ack = await engine.submit(inbound, session)
        first = None
        while True:
            message = await layer.receive(channel)
            frames = [one["frame"] for one in publish.unfold(message)]
            mine = [f for f in frames if f.get("turn_id") == ack.turn_id]
            if first is None and any(f["type"] == "turn_snapshot" for f in mine):
                first = time.perf_counter() - started
            if any(f["type"] == "turn_updated" for f in mine):
                break
        firsts.append((first or 0.0) * 1000)
        # Past the lease's linger: every turn starts on an idle dialog.
        await asyncio.sleep(0.15)

    for i in range(args.warmup):
        await one(i)
    firsts.clear()
    trips.counting = True
    loop_started, process_started = time.thread_time(), time.process_time()
    for i in range(args.turns):
        await one(i)
    loop_cpu = time.thread_time() - loop_started
    process_cpu = time.process_time() - process_started
    trips.counting = False
    await engine.shutdown(grace=5)

    n = args.turns
    firsts.sort()
    print(f"{n} sequential turns in one dialog (after {args.warmup} to warm up)")
    print(
        f"submit to first snapshot, in process: p50 {firsts[n // 2]:.2f} ms,"
        f" p90 {firsts[int(n * 0.9)]:.2f} ms"
    )
    print(
        f"CPU per turn: process {process_cpu / n * 1000:.2f} ms, loop {loop_cpu / n * 1000:.2f} ms"
    )
    print()
    print(
        "| database trip | calls/turn | thread CPU/turn (ms) | wall/turn (ms) | statements/turn |"
    )
    print("|---|---|---|---|---|")
    total = total_wall = 0.0
    for name, (calls, cpu, statements, wall) in sorted(
        trips.by_name.items(), key=lambda kv: -kv[1][3]
    ):
        total += cpu
        total_wall += wall
        if calls / n < 0.5:
            continue  # housekeeping that runs once a second, not per turn
        print(
            f"| `{name}` | {calls / n:.2f} | {cpu / n * 1000:.2f} | {wall / n * 1000:.2f}"
            f" | {statements / n:.1f} |"
        )
    print(f"| all database threads | | {total / n * 1000:.2f} | {total_wall / n * 1000:.2f} | |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--code-root", default=str(ROOT), help="the checkout to measure")
    parser.add_argument(
        "--database-url",
        default="",
        help="scaled mode: a PostgreSQL server to create a throwaway database on",
    )
    parser.add_argument("--redis-url", default="", help="scaled mode: the channel layer's Redis")
    ns = parser.parse_args()
    sys.path.insert(0, str(Path(ns.code_root).resolve()))
    database_url, drop = "", None
    if ns.database_url:
        from bench.servers import throwaway_database

        database_url, drop = throwaway_database(ns.database_url)
    os.environ.update(
        {
            "CHAT_VAR_DIR": tempfile.mkdtemp(prefix="chat-phases-"),
            "DATABASE_URL": database_url,
            "REDIS_URL": ns.redis_url,
            "LOG_LEVEL": "WARNING",
            "CHAT_RATE_LIMIT_PER_MINUTE": "1000000",
            "CHAT_WRITE_RATE_PER_MINUTE": "1000000",
            "DJANGO_SETTINGS_MODULE": "chatcore.settings",
        }
    )
    import django

    django.setup()
    found = Trips()
    found.install()
    try:
        asyncio.run(main(ns, found))
    finally:
        if drop is not None:
            from django.db import connections

            connections.close_all()
            drop()
