"""Reconnect storms beside the floor, in one run on one machine (issue 57): N WebSockets
opened at once against the floor relay (`bench/floor_relay.py`) and the platform, every
figure of the platform as a ratio to the floor's of the same run.

    .venv/bin/python bench/reconnect_bench.py [--sockets 3000] [--in-flight 200]
        [--scaled --database-url postgres://postgres@127.0.0.1:5432/test
                  --redis-url redis://127.0.0.1:6379/11]

Targets: the floor relay; the platform in embedded mode (one `manage.py serve`: SQLite WAL,
in-memory channel layer); with `--scaled`, one `serve` on PostgreSQL + Redis (a throwaway
database made on the given server and dropped afterwards). Each platform target gets users
(`--per-user` sockets each, their bearer tokens), each with `--dialogs` dialogs, the most
recent holding `--messages` messages.

Per target, on a server just started (its caches cold, as after a restart):
- fresh storm: `--sockets` connects, at most `--in-flight` handshakes under way, each counted
  open at its first `session_history`: wall time, handshakes/s, server CPU per connect (user +
  system time of the server process over the storm / sockets);
- memory per idle socket: the storm opens its sockets in two halves, each holding about half
  of every user's sockets; the server's RSS with every socket open and idle, less its RSS
  after the first half, per socket of the second: what one more idle socket costs beside
  the ones its user opened first (the platform keeps one list per user and one page per
  dialog, shared by their sockets). "all-in": the same from before the storm, those shared
  caches included; and the RSS itself;
- `sessions` round trip with every socket open: `--round-trips` asked one after another on
  sockets picked at random, p50 / p99;
- then every socket closes, the server is restarted, and a resuming storm opens them again,
  each saying what it holds (`dialog_id`, `since`, `sessions_etag`, `last_id`): counted open at
  its `history_delta` (or a `session_history`: a full reload, counted).
The floor ignores what a socket says it holds: its resuming storm is a fresh one again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.compare_bench import parse_variant  # noqa: E402
from bench.servers import CLK_TCK, _wait_port, _wait_settled, throwaway_database  # noqa: E402
from bench.ws_bench import percentile  # noqa: E402
from tests.procs import embedded_env, free_port, popen_manage  # noqa: E402

# --- Servers ----------------------------------------------------------------------------------


@dataclass
class Server:
    """One server process of a target, started again on the same port by `restart`."""

    name: str
    command: list[str]
    env: dict[str, str]
    log: Path
    platform: bool
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws/chat/"

    def start(self) -> None:
        with self.log.open("a") as out:
            if self.platform:
                self.proc = popen_manage(
                    "serve", "--port", str(self.port), env=self.env, stdout=out, stderr=out
                )
            else:
                self.proc = subprocess.Popen(
                    [
                        *self.command,
                        "-v",
                        "0",
                        "-p",
                        str(self.port),
                        "bench.floor_relay:application",
                    ],
                    cwd=ROOT,
                    env=self.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
        _wait_port(self.port, self.proc, self.log)
        if self.platform:
            _wait_settled(self.port, self.proc, self.log)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def cpu_seconds(self) -> float:
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def rss_bytes(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


def seed(args: argparse.Namespace) -> None:
    """In the target's environment: migrate, then users with tokens, dialogs and messages
    written in bulk; prints one token per user."""
    os.environ["DJANGO_SETTINGS_MODULE"] = "chatcore.settings"
    import django

    django.setup()
    from datetime import timedelta

    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.utils import timezone

    from chatcore.common.ids import owner_chat_id
    from sessions_app.models import Message, Session
    from sessions_app.services import api_token_issue

    call_command("migrate", verbosity=0)
    now = timezone.now()
    text = "a sentence of an earlier answer, long enough to look like one. " * 3
    for i in range(args.seed):
        user = get_user_model().objects.create_user(f"r{i}", password=None)
        dialogs = []
        for j in range(args.dialogs):
            count = args.messages if j == 0 else 2
            dialogs.append(
                Session(
                    owner=user,
                    channel="web",
                    chat_id=owner_chat_id(user.pk),
                    dialog_id=f"d{j}",
                    title=f"Dialog {j} of user {i}",
                    created_at=now - timedelta(hours=j + 1),
                    last_active_at=now - timedelta(minutes=j),
                    last_seq=count,
                    head_seq=count,
                    message_count=count // 2,
                    total_message_count=count,
                    state_version=count,
                )
            )
        Session.objects.bulk_create(dialogs)
        Message.objects.bulk_create(
            Message(
                session=dialog,
                seq=seq,
                parent_seq=seq - 1 or None,
                role="user" if seq % 2 else "assistant",
                content=f"{seq}: {text}",
                created_at=now - timedelta(minutes=60) + timedelta(seconds=seq),
            )
            for dialog in dialogs
            for seq in range(1, dialog.last_seq + 1)
        )
        print(api_token_issue(user=user, name="bench")[1], flush=True)
    # A live database's planner knows its tables (autovacuum analyses them); one filled just
    # now would plan each connect's reads as scans of tables it believes empty.
    from django.db import connection

    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")


# --- Clients ----------------------------------------------------------------------------------


@dataclass
class Held:
    """What one socket holds after a storm: its dialog, revision, list etag, newest message."""

    token: str | None
    dialog_id: str = ""
    since: int = 0
    etag: str = ""
    last_id: str = ""


async def open_one(url: str, held: Held, resume: bool, gate: asyncio.Semaphore) -> Any:
    """Opens one socket, reads until its history (a `session_history`, or the resume's
    `history_delta`) and returns (socket, whether it was a full history, sessions unchanged)."""
    from websockets.asyncio.client import connect

    query = {}
    if resume and held.dialog_id:
        query = {"dialog_id": held.dialog_id, "since": held.since}
        query.update({"sessions_etag": held.etag} if held.etag else {})
        query.update({"last_id": held.last_id} if held.last_id else {})
    headers = {"Authorization": f"Bearer {held.token}"} if held.token else {}
    async with gate:
        ws = await connect(
            url + ("?" + urlencode(query) if query else ""),
            additional_headers=headers,
            max_size=None,
            compression=None,
            open_timeout=120,
        )
        unchanged = False
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 120))
            kind = frame.get("type")
            if kind == "sessions":
                held.etag = frame.get("etag", "")
                unchanged = bool(frame.get("unchanged"))
            elif kind in ("session_history", "history_delta"):
                held.dialog_id = frame.get("dialog_id") or held.dialog_id
                held.since = int(frame["history_revision"])
                if frame["messages"]:
                    held.last_id = frame["messages"][-1]["id"]
                return ws, kind == "session_history", unchanged


async def storm(url: str, holds: list[Held], resume: bool, in_flight: int) -> dict[str, Any]:
    gate = asyncio.Semaphore(in_flight)
    start = time.perf_counter()
    results = await asyncio.gather(*(open_one(url, h, resume, gate) for h in holds))
    wall = time.perf_counter() - start
    return {
        "sockets": [r[0] for r in results],
        "wall": wall,
        "full": sum(r[1] for r in results),
        "unchanged": sum(r[2] for r in results),
    }


async def round_trips(sockets: list[Any], n: int) -> list[float]:
    """`sessions` asked on sockets picked at random, one after another: ms each."""
    out = []
    for ws in random.sample(sockets, min(n, len(sockets))):
        start = time.perf_counter()
        await ws.send(json.dumps({"type": "sessions"}))
        while json.loads(await asyncio.wait_for(ws.recv(), 60)).get("type") != "sessions":
            pass
        out.append((time.perf_counter() - start) * 1000)
    return out


async def close_all(sockets: list[Any]) -> None:
    gate = asyncio.Semaphore(500)

    async def close(ws: Any) -> None:
        async with gate:
            await ws.close()

    await asyncio.gather(*(close(ws) for ws in sockets), return_exceptions=True)


# --- One target -------------------------------------------------------------------------------


def measure(server: Server, holds: list[Held], args: argparse.Namespace) -> dict[str, Any]:
    """Both storms against `server` (started here, restarted between them)."""
    row: dict[str, Any] = {}

    async def fresh() -> None:
        warm = await storm(server.url, holds[:10], False, 10)  # imports, first connections
        await close_all(warm["sockets"])
        await asyncio.sleep(1.0)
        # In two halves, each holding about half of every user's sockets: the second half's
        # memory is what a socket costs by itself, beside what its user's first ones made.
        half = len(holds) // 2
        rss0, cpu0 = server.rss_bytes(), server.cpu_seconds()
        first = await storm(server.url, holds[:half], False, args.in_flight)
        cpu = server.cpu_seconds() - cpu0
        await asyncio.sleep(2.0)  # idle
        rss1, cpu1 = server.rss_bytes(), server.cpu_seconds()
        second = await storm(server.url, holds[half:], False, args.in_flight)
        cpu += server.cpu_seconds() - cpu1
        await asyncio.sleep(2.0)
        rss = server.rss_bytes()
        sockets = first["sockets"] + second["sockets"]
        rtt = await round_trips(sockets, args.round_trips)
        row["fresh"] = {
            "wall": first["wall"] + second["wall"],
            "cpu_ms": cpu / len(holds) * 1000,
            "mem_kib": (rss - rss1) / (len(holds) - half) / 1024,
            "all_kib": (rss - rss0) / len(holds) / 1024,
            "rss_mib": rss / 2**20,
            "rtt_p50": statistics.median(rtt),
            "rtt_p99": percentile(rtt, 99),
            "full": first["full"] + second["full"],
            "unchanged": first["unchanged"] + second["unchanged"],
        }
        await close_all(sockets)  # on the loop they were opened on

    server.start()
    try:
        asyncio.run(fresh())
    finally:
        server.stop()

    async def resumed() -> None:
        cpu0 = server.cpu_seconds()
        done = await storm(server.url, holds, True, args.in_flight)
        cpu = server.cpu_seconds() - cpu0
        row["resume"] = {
            "wall": done["wall"],
            "cpu_ms": cpu / len(holds) * 1000,
            "full": done["full"],
            "unchanged": done["unchanged"],
        }
        await close_all(done["sockets"])

    server.start()
    try:
        asyncio.run(resumed())
    finally:
        server.stop()
    return row


def platform_server(name: str, env: dict[str, str], tmp: Path, args: argparse.Namespace) -> Any:
    users = -(-args.sockets // args.per_user)
    made = subprocess.run(
        [sys.executable, __file__, "--seed", str(users), *seed_args(args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    tokens = made.stdout.split()
    holds = [Held(tokens[i % users]) for i in range(args.sockets)]
    server = Server(name, [], env, tmp / f"{name.replace(' ', '-')}.log", platform=True)
    return server, holds


def seed_args(args: argparse.Namespace) -> list[str]:
    return ["--dialogs", str(args.dialogs), "--messages", str(args.messages)]


def platform_env(tmp: Path, per_user: int, **extra: str) -> dict[str, str]:
    return embedded_env(
        tmp, LOG_LEVEL="WARNING", CHAT_USER_SOCKETS_MAX=str(max(20, per_user)), **extra
    )


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    floor = rows["floor relay"]
    print(
        f"\n{os.cpu_count()} cores; {args.sockets} sockets, {args.in_flight} handshakes in "
        f"flight; platform: {args.per_user} sockets per user, {args.dialogs} dialogs each, "
        f"the current one of {args.messages} messages; ratios to the floor of this run\n"
    )
    print(
        "| target | storm | wall (s) | x floor | handshakes/s | CPU/connect (ms) | x floor "
        "| memory/idle socket (KiB) | x floor | all-in (KiB) | RSS (MiB) "
        "| sessions RTT p50 / p99 (ms) | full histories | sessions unchanged |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        for kind in ("fresh", "resume"):
            f, base = row[kind], floor[kind]
            mem = rtt = rss = ""
            if kind == "fresh":
                ratio = f["mem_kib"] / max(floor["fresh"]["mem_kib"], 0.1)
                mem = f"{f['mem_kib']:.1f} | {ratio:.2f} | {f['all_kib']:.1f}"
                rss = f"{f['rss_mib']:.0f}"
                rtt = f"{f['rtt_p50']:.1f} / {f['rtt_p99']:.1f}"
            else:
                mem = " |  | "
            print(
                f"| {name} | {kind} | {f['wall']:.2f} | {f['wall'] / base['wall']:.2f} "
                f"| {args.sockets / f['wall']:.0f} | {f['cpu_ms']:.2f} "
                f"| {f['cpu_ms'] / base['cpu_ms']:.2f} | {mem} | {rss} | {rtt} "
                f"| {f['full']} | {f['unchanged']} |"
            )
    print(
        "\nTargets: fresh storm wall and CPU/connect <= 2x the floor, resuming <= 1.5x, "
        "memory/idle socket <= 1.25x, RSS < 1024 MiB at 10,000 sockets, sessions RTT p99 < 50 ms."
    )
    for name, row in rows.items():
        if name == "floor relay":
            continue
        fresh, resume = row["fresh"], row["resume"]
        missed = [
            label
            for label, value, bound in (
                ("fresh wall", fresh["wall"] / floor["fresh"]["wall"], 2.0),
                ("fresh CPU", fresh["cpu_ms"] / floor["fresh"]["cpu_ms"], 2.0),
                ("resume wall", resume["wall"] / floor["resume"]["wall"], 1.5),
                ("resume CPU", resume["cpu_ms"] / floor["resume"]["cpu_ms"], 1.5),
                ("memory", fresh["mem_kib"] / max(floor["fresh"]["mem_kib"], 0.1), 1.25),
                ("RTT p99 ms", fresh["rtt_p99"], 50.0),
            )
            if value > bound
        ]
        print(f"- {name}: {'missed: ' + ', '.join(missed) if missed else 'all met'}")


def main(args: argparse.Namespace) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 2 * args.sockets + 1000))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))  # servers inherit it
    if want < args.sockets + 100:
        raise SystemExit(f"open files limited to {want}: too few for {args.sockets} sockets")
    tmp = Path(tempfile.mkdtemp(prefix="reconnect-bench-"))
    daphne = [str(Path(sys.executable).parent / "daphne")]
    floor_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    floor = Server("floor relay", daphne, floor_env, tmp / "floor.log", platform=False)
    rows = {"floor relay": measure(floor, [Held(None) for _ in range(args.sockets)], args)}
    print("floor relay", rows["floor relay"], flush=True)
    plans = []
    if "embedded" not in args.skip:
        (tmp / "emb").mkdir()
        plans.append(("platform, embedded", platform_env(tmp / "emb", args.per_user)))
    drops = []
    if args.scaled:
        url, drop = throwaway_database(args.database_url)
        drops.append(drop)
        (tmp / "scaled").mkdir()
        env = platform_env(
            tmp / "scaled", args.per_user, DATABASE_URL=url, REDIS_URL=args.redis_url
        )
        plans.append(("platform, PG + Redis", env))
    base = list(plans)
    for label, extra in args.variant:  # the platform again with this environment added
        for name, env in base:
            folder = tmp / f"{label}-{len(plans)}"
            folder.mkdir()
            more = {**env, **extra, "CHAT_VAR_DIR": str(folder)}
            if env.get("DATABASE_URL"):
                more["DATABASE_URL"], drop = throwaway_database(args.database_url)
                drops.append(drop)
            plans.append((f"{name} [{label}]", more))
    try:
        for name, env in plans:
            server, holds = platform_server(name, env, tmp, args)
            rows[name] = measure(server, holds, args)
            print(name, rows[name], flush=True)
    finally:
        for drop in drops:
            drop()
    report(rows, args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sockets", type=int, default=3000)
    parser.add_argument("--in-flight", type=int, default=200, help="handshakes under way at most")
    parser.add_argument("--per-user", type=int, default=10, help="platform sockets per user")
    parser.add_argument("--dialogs", type=int, default=12, help="dialogs per user")
    parser.add_argument("--messages", type=int, default=120, help="messages of the current one")
    parser.add_argument("--round-trips", type=int, default=300, help="`sessions` round trips")
    parser.add_argument("--scaled", action="store_true", help="also PostgreSQL + Redis")
    parser.add_argument("--skip", action="append", default=[], choices=["embedded"])
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        type=parse_variant,
        metavar="LABEL:VAR=VALUE[,VAR=VALUE]",
        help="also each platform target with this environment added (SPEC I1)",
    )
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL", ""))
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""))
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.seed:
        seed(ns)
    else:
        if ns.scaled and not (ns.database_url and ns.redis_url):
            parser.error("--scaled needs --database-url and --redis-url (or the env vars)")
        main(ns)
