"""Scale-out benchmark (SPEC G6): turns per second at saturation and the added time to first
token with 1, 2 and 4 `serve` processes in scaled mode (PostgreSQL + Redis), the same fake
model for all, printed as ratios to the 1-process figures; and the database round trips a send
to an idle dialog costs before its first token.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \\
        .venv/bin/python bench/scale_bench.py [--processes 1,2,4] [--dialogs 16] [--sends 4]

DATABASE_URL names a PostgreSQL server the script may create a throwaway database on (it is
dropped at the end). Redis is a private `redis-server` on a free port. The model is
`tests.fakemodel.FakeModelServer` in its own process, answering every request at once with a
short streamed text, so what is measured is the platform.

- *turns/s at saturation*: `--dialogs` dialogs spread over the processes (dialog i is sent to
  process i mod N over REST), each with `--sends` sends submitted up front; turns per second
  from the first send until every turn is terminal (read from the database).
- *added time to first token*: one WebSocket client per process, one send at a time, from the
  `send` frame to the first `turn_snapshot` (p50 over `--ttft` sends per level).
- *round trips before the first token*: statements the engine runs from `submit` until the
  model receives the request, for a send to an idle dialog (an in-process engine with a
  statement counter on its database thread, as `tests/test_round_trips.py` pins it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ANSWER = "A short streamed answer from the benchmark model, a few words at a time. " * 3


def serve_model() -> None:
    from tests.fakemodel import FakeModelServer, Reply

    server = FakeModelServer(record=False)
    server.default = lambda _request: Reply(text=ANSWER, chunk=8)
    server.start()
    print(server.port, flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()


def start_model() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve-model"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    port = proc.stdout.readline().strip()
    if not port:
        raise SystemExit("the fake model server did not start")
    return proc, f"http://127.0.0.1:{port}/v1"


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def admin(url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(url.replace("postgres://", "postgresql://", 1), autocommit=True) as conn:
        conn.execute(sql)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def saturate(bases: list[str], token: str, owner_pk: int, dialogs: int, sends: int) -> float:
    import httpx

    from sessions_app.models import Turn

    clients = [
        httpx.Client(
            base_url=f"{b}/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=60
        )
        for b in bases
    ]
    run = f"r{time.monotonic_ns() % 10**9}"
    sids = []
    for i in range(dialogs):
        r = clients[i % len(clients)].post(
            "/sessions",
            json={"channel": "api", "chat_id": f"u{owner_pk}", "dialog_id": f"{run}{i}"},
        )
        r.raise_for_status()
        sids.append(r.json()["session_id"])
    before = Turn.objects.filter(status__in=("completed", "failed", "cancelled")).count()
    total = dialogs * sends
    started = time.perf_counter()

    def submit(i: int, sid: str) -> None:
        client = clients[i % len(clients)]
        for n in range(sends):
            client.post(f"/sessions/{sid}/messages", json={"content": f"m{n}"}).raise_for_status()

    threads = [threading.Thread(target=submit, args=(i, s)) for i, s in enumerate(sids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    while (
        Turn.objects.filter(status__in=("completed", "failed", "cancelled")).count() - before
        < total
    ):
        time.sleep(0.05)
    elapsed = time.perf_counter() - started
    failed = Turn.objects.filter(status="failed").count()
    if failed:
        print(f"  warning: {failed} failed turns")
    for c in clients:
        c.close()
    return total / elapsed


def first_tokens(bases: list[str], token: str, owner_pk: int, count: int) -> list[float]:
    import httpx
    from websockets.sync.client import connect

    run = f"t{time.monotonic_ns() % 10**9}"
    for j, base in enumerate(bases):
        httpx.post(
            f"{base}/api/v1/sessions",
            json={"channel": "web", "chat_id": f"u{owner_pk}", "dialog_id": f"{run}{j}"},
            headers={"Authorization": f"Bearer {token}"},
        ).raise_for_status()
    out: list[float] = []
    for i in range(count):
        j = i % len(bases)
        base = bases[j]
        url = base.replace("http://", "ws://") + f"/ws/chat/?dialog_id={run}{j}"
        with connect(url, additional_headers={"Authorization": f"Bearer {token}"}) as ws:
            while json.loads(ws.recv())["type"] != "session_history":
                pass
            sent = time.perf_counter()
            ws.send(json.dumps({"type": "send", "content": f"t{i}", "dialog_id": f"{run}{j}"}))
            first = None
            while True:
                frame = json.loads(ws.recv())
                if frame["type"] == "turn_snapshot" and first is None:
                    first = time.perf_counter() - sent
                if frame["type"] == "turn_updated":
                    break
            assert first is not None
            out.append(first)
    return out


async def round_trips(model_url: str, owner: Any) -> int:
    from asgiref.sync import SyncToAsync, sync_to_async
    from django.db import connection

    from chatcore.engine.engine import Engine, Inbound
    from chatcore.engine.provider import OpenAIProvider
    from sessions_app import services

    engine = Engine(
        provider=OpenAIProvider(base_url=model_url, api_key="", model="fake"), name="bench"
    )
    await engine.start()
    session = await sync_to_async(services.session_create)(
        owner=owner, channel="api", chat_id=f"u{owner.pk}", dialog_id="roundtrips"
    )
    await asyncio.sleep(0.5)
    statements: list[str] = []

    def count(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if not sql.startswith("BEGIN"):
            statements.append(sql)
        if "sessions_app_compaction" in sql:  # the last read before the model request
            counted.append(len(statements))
        return execute(sql, params, many, context)

    counted: list[int] = []
    SyncToAsync.single_thread_executor.submit(
        lambda: connection.execute_wrappers.append(count)
    ).result()
    try:
        await engine.submit(
            Inbound(
                owner=owner,
                channel="api",
                chat_id=session.chat_id,
                content="hello",
                sender_id=str(owner.pk),
            ),
            session,
        )
        await engine.wait_idle(session.pk)
    finally:
        SyncToAsync.single_thread_executor.submit(
            lambda: connection.execute_wrappers.remove(count)
        ).result()
        await engine.shutdown(grace=2)
    return counted[0] if counted else len(statements)


def main(args: argparse.Namespace) -> None:
    base_url = os.environ.get("DATABASE_URL", "")
    if not base_url.startswith("postgres"):
        raise SystemExit("set DATABASE_URL to a PostgreSQL server (a throwaway database is made)")
    from tests.procs import ServeProcess
    from tests.scaled import RedisServer

    name = f"scale_bench_{os.getpid()}"
    admin(base_url, f'CREATE DATABASE "{name}"')
    db_url = with_database(base_url, name)
    tmp = Path(tempfile.mkdtemp(prefix="scale-bench-"))
    redis_server = RedisServer(tmp / "redis").start()
    model, model_url = start_model()
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "REDIS_URL": redis_server.url,
        "LLM_BASE_URL": model_url,
        "LLM_MODEL": "fake",
        "CHAT_RATE_LIMIT_PER_MINUTE": "1000000",
        "CHAT_AUTO_TITLE_AFTER": "1000000",
        "PYTHONUNBUFFERED": "1",
    }
    os.environ.update({"DATABASE_URL": db_url, "REDIS_URL": ""})
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatcore.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from sessions_app import services

    results: dict[int, tuple[float, float]] = {}
    try:
        call_command("migrate", verbosity=0)
        owner = get_user_model().objects.create_user("bench")
        _t, token = services.api_token_issue(user=owner)
        trips = asyncio.run(round_trips(model_url, owner))
        print(f"cores: {os.cpu_count()}")
        print(f"database round trips before the first token (idle dialog): {trips}")
        for n in args.processes:
            servers = []
            for i in range(n):
                var = tmp / f"p{n}-{i}"
                var.mkdir()
                server = ServeProcess(var, {**env, "CHAT_VAR_DIR": str(var)})
                server.start()
                servers.append(server)
            try:
                bases = [s.base for s in servers]
                saturate(bases, token, owner.pk, max(2, args.dialogs // 4), 1)  # warm up
                rate = saturate(bases, token, owner.pk, args.dialogs, args.sends)
                ttft = statistics.median(first_tokens(bases, token, owner.pk, args.ttft))
                results[n] = (rate, ttft)
                print(f"{n} process(es): {rate:.1f} turns/s, added TTFT p50 {ttft * 1000:.0f} ms")
            finally:
                for s in servers:
                    s.stop()
        one_rate, one_ttft = results[args.processes[0]]
        print()
        print("| processes | turns/s | ratio | added TTFT p50 | ratio |")
        print("|---|---|---|---|---|")
        for n, (rate, ttft) in results.items():
            print(
                f"| {n} | {rate:.1f} | {rate / one_rate:.2f}x | {ttft * 1000:.0f} ms "
                f"| {ttft / one_ttft:.2f}x |"
            )
    finally:
        assert model.stdin is not None
        model.stdin.close()
        model.wait(timeout=10)
        redis_server.stop()
        from django.db import connections

        connections.close_all()
        admin(base_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-model", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--processes", default="1,2,4", type=lambda s: [int(x) for x in s.split(",")]
    )
    parser.add_argument("--dialogs", type=int, default=16)
    parser.add_argument("--sends", type=int, default=4)
    parser.add_argument("--ttft", type=int, default=20, help="sends timed per level")
    ns = parser.parse_args()
    if ns.serve_model:
        serve_model()
    else:
        main(ns)
