"""What a bench run measures against, each in processes of its own (`compare_bench.py`,
`send_timeline.py`, `provider_bench.py`): the fake model (`Model`: `tests.fakemodel` serving
a fast and a paced answer), the floor relay (`start_floor`), the platform's `serve`
processes (`start_platform`), embedded or on a throwaway PostgreSQL database
(`scaled_env`, `throwaway_database`, `in_process_database`), and their API tokens.

Run as a script, it is the model's process (`--serve-model`) or makes the tokens in the
platform's database (`--make-tokens N`); `Model` and `make_tokens` start it so.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.ws_bench import answer_text  # noqa: E402
from tests.procs import embedded_env, free_port  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def serve_model(chars: int, chunk: int, pace: float) -> None:
    from tests.fakemodel import FakeModelServer, Reply

    text = answer_text(chars)
    # It keeps no request: every parsed body of a run kept alive made the collector's full
    # passes take 20-37 ms, each inside whichever turn was served then (one scaled turn of
    # every full run, always in its third repetition, the same point of the same work).
    server = FakeModelServer(record=False)
    fast = Reply(text=text, chunk=chunk)
    paced = Reply(text=text, chunk=chunk, delay=pace)
    # The last message says which: the check costs the same whatever the dialog's length (a
    # dump of every message grew with it, and counted as the platform's added time).
    server.default = lambda request: (
        paced if "paced" in str(request["messages"][-1].get("content")) else fast
    )
    server.start()
    # What the model holds for good out of the collector's view: a full pass over it stopped
    # the model for milliseconds, in the middle of whichever target's turn was measured.
    gc.collect()
    gc.freeze()
    print(server.port, flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()


class Model:
    def __init__(self, args: argparse.Namespace) -> None:
        self.text = answer_text(args.answer_chars)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve-model",
                "--answer-chars",
                str(args.answer_chars),
                "--chunk",
                str(args.chunk),
                "--pace",
                str(args.pace),
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.url = f"http://127.0.0.1:{self.proc.stdout.readline().strip()}/v1"

    def own_times(self, paced: bool, n: int = 20) -> tuple[float, float]:
        """The model's own time to first delta (p50) and to the end of one answer."""
        firsts, totals = self.own_samples(paced, n)
        return statistics.median(firsts), statistics.median(totals)

    def own_samples(self, paced: bool, n: int = 20) -> tuple[list[float], list[float]]:
        """`n` answers (2 when `paced`) asked directly, one after another: each one's time to
        first delta and to its end."""
        import httpx

        firsts, totals = [], []
        content = "paced" if paced else "fast"
        with httpx.Client(timeout=60) as client:
            for _ in range(n if not paced else 2):
                start = time.perf_counter()
                first = None
                body = {
                    "model": "m",
                    "stream": True,
                    "messages": [{"role": "user", "content": content}],
                }
                with client.stream("POST", f"{self.url}/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if first is None and '"content"' in line:
                            first = time.perf_counter()
                firsts.append((first or time.perf_counter()) - start)
                totals.append(time.perf_counter() - start)
        return firsts, totals

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


@dataclass
class Target:
    name: str
    urls: list[str]
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    platform: bool = True
    cleanup: list[Any] = field(default_factory=list)

    def cpu_seconds(self) -> float:
        total = 0.0
        for proc in self.procs:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
        return total

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for fn in self.cleanup:
            fn()


def _wait_port(port: int, proc: subprocess.Popen[str], log: Path) -> None:
    import socket

    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server did not start:\n{log.read_text()}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)


def _wait_settled(port: int, proc: subprocess.Popen[str], log: Path) -> None:
    """Until the `serve` process on `port` has finished starting: its engine started (the
    tokenizer's tables loaded) and its heap settled, which `/healthz` shows as its
    `collector` figures. A process still starting takes a core for a second or so; measured
    beside it, another process's turns would wait for it."""
    import httpx

    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server did not settle:\n{log.read_text()}")
        try:
            health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            health = {}
        if health.get("collector"):
            return
        time.sleep(0.1)


def start_floor(model: Model, tmp: Path) -> Target:
    port = free_port()
    log = tmp / "floor.log"
    env = {**os.environ, "FLOOR_MODEL_URL": model.url, "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "daphne"),
                "-p",
                str(port),
                "bench.floor_relay:application",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    _wait_port(port, proc, log)
    return Target("floor relay", [f"ws://127.0.0.1:{port}/ws/chat/"], [proc], platform=False)


def platform_env(model: Model, tmp: Path, **extra: str) -> dict[str, str]:
    return embedded_env(
        tmp,
        LLM_BASE_URL=model.url,
        LLM_MODEL="bench",
        CHAT_RATE_LIMIT_PER_MINUTE="1000000",
        CHAT_AUTO_TITLE_AFTER="1000000",
        CHAT_QUEUE_CAPACITY="1000",
        LOG_LEVEL="WARNING",
        **extra,
    )


def make_tokens(env: dict[str, str], n: int) -> list[str]:
    out = subprocess.run(
        [sys.executable, __file__, "--make-tokens", str(n)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


def _make_tokens_here(n: int) -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = "chatcore.settings"
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from sessions_app.services import api_token_issue

    call_command("migrate", verbosity=0)
    prefix = uuid.uuid4().hex[:6]
    for i in range(n):
        user = get_user_model().objects.create_user(f"b{prefix}{i}", password=None)
        print(api_token_issue(user=user, name="bench")[1])


def start_platform(name: str, env: dict[str, str], tmp: Path, processes: int, users: int) -> Target:
    from tests.procs import popen_manage

    tokens = make_tokens(env, users)
    target = Target(name, [], tokens=tokens)
    started = []
    for i in range(processes):
        port = free_port()
        log = tmp / f"serve-{i}.log"
        with log.open("w") as out:
            proc = popen_manage(
                "serve", "--port", str(port), env=env, stdout=out, stderr=subprocess.STDOUT
            )
        target.procs.append(proc)
        _wait_port(port, proc, log)
        target.urls.append(f"ws://127.0.0.1:{port}/ws/chat/")
        started.append((port, proc, log))
    # Measured once every process has started, not beside one still loading.
    for port, proc, log in started:
        _wait_settled(port, proc, log)
    return target


def throwaway_database(database_url: str) -> tuple[str, Any]:
    """A new database on `database_url`'s server: (its URL, a function that drops it)."""
    import psycopg

    name = f"bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = database_url.rsplit("/", 1)[0] + "/" + name

    def drop() -> None:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return url, drop


def in_process_database(database_url: str, prefix: str) -> Callable[[], None]:
    """Point this process's Django at a database of its own, before `django.setup()`: a
    throwaway one on `database_url`'s PostgreSQL server, or without one SQLite in a new
    temporary folder (`prefix`). Returns what to call at the end (drops the PostgreSQL one)."""
    if database_url:
        url, drop = throwaway_database(database_url)
        os.environ["DATABASE_URL"] = url
        return drop
    os.environ["CHAT_VAR_DIR"] = tempfile.mkdtemp(prefix=prefix)
    os.environ.pop("DATABASE_URL", None)
    return lambda: None


def scaled_env(
    model: Model, tmp: Path, database_url: str, redis_url: str
) -> tuple[dict[str, str], Any]:
    url, drop = throwaway_database(database_url)
    env = platform_env(model, tmp, DATABASE_URL=url, REDIS_URL=redis_url)
    return env, drop


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve-model", action="store_true")
    parser.add_argument("--answer-chars", type=int, default=1000)
    parser.add_argument("--chunk", type=int, default=4)
    parser.add_argument("--pace", type=float, default=0.02)
    parser.add_argument("--make-tokens", type=int, default=0)
    ns = parser.parse_args()
    if ns.serve_model:
        serve_model(ns.answer_chars, ns.chunk, ns.pace)
    elif ns.make_tokens:
        _make_tokens_here(ns.make_tokens)
    else:
        parser.error("--serve-model or --make-tokens N")
