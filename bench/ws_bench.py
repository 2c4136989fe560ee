"""WebSocket fan-out benchmark: N concurrent `/ws/chat/` clients against ONE real Daphne
process (`manage.py serve`, embedded mode: SQLite in WAL mode, in-memory channel layer), each
streaming a long answer from a zero-latency model.

    .venv/bin/python bench/ws_bench.py [--clients 1,10,100] [--rounds N]
                                       [--answer-chars 4000] [--chunk 4]

The model is `tests.fakemodel.FakeModelServer` (a real OpenAI-compatible HTTP server) in its
own process, replying to every request with the same long text streamed in `--chunk`
character deltas and no delay, so what is measured is the platform: admission, the turn,
snapshot coalescing, the channel layer, the consumer and Daphne. Each level gets fresh users
(one per client, so the per-user rate limit never interferes); every client connects and reads
its connect frames, then all start at once and send `--rounds` messages one after another,
each waiting for its `turn_updated` (default max(3, 50 // clients), so the single-client level
has enough samples for a p99).

Figures per level:
- delivered characters/s and tokens/s: answer characters received by all clients over the
  level's wall time (first send to last terminal); a token is one model delta of `--chunk`
  characters (4 by default, about one English token);
- frames and bytes per answer: WebSocket frames (and their UTF-8 bytes) a client receives from
  its `queued` to its `turn_updated`, snapshots included;
- added time to first token, p50/p99: from sending the frame to the first `turn_snapshot`.
Every answer is rebuilt from its snapshot tails and checked against the committed message.

It creates its own database in a temporary folder and stops the server it started.
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = "the quick brown fox jumps over a lazy dog while streaming tokens to many tabs".split()


def answer_text(chars: int) -> str:
    out: list[str] = []
    size = 0
    i = 0
    while size < chars:
        word = WORDS[i % len(WORDS)] + " "
        out.append(word)
        size += len(word)
        i += 1
    return "".join(out)[:chars]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# --- The model, in its own process ----------------------------------------------------------


def serve_model(chars: int, chunk: int) -> None:
    from tests.fakemodel import FakeModelServer, Reply

    text = answer_text(chars)
    server = FakeModelServer(record=False)
    server.default = lambda _request: Reply(text=text, chunk=chunk)
    server.start()
    print(server.port, flush=True)
    try:
        sys.stdin.read()  # until the parent closes our stdin
    finally:
        server.stop()


def start_model(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve-model",
            "--answer-chars",
            str(args.answer_chars),
            "--chunk",
            str(args.chunk),
        ],
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


# --- The server -----------------------------------------------------------------------------


def start_daphne(env: dict[str, str], var_dir: Path) -> tuple[subprocess.Popen[str], int, Any]:
    from tests.procs import free_port, popen_manage

    port = free_port()
    log = open(var_dir / "serve.log", "w")  # noqa: SIM115 - closed by the caller
    proc = popen_manage("serve", "--port", str(port), env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "Serving on" not in (var_dir / "serve.log").read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("serve did not start:\n" + (var_dir / "serve.log").read_text())
        time.sleep(0.1)
    return proc, port, log


def make_tokens(prefix: str, n: int) -> list[str]:
    """Users with tokens, written straight into the server's database (same SQLite file)."""
    from django.contrib.auth import get_user_model
    from django.db import connections

    from sessions_app.services import api_token_issue

    user_model = get_user_model()
    tokens = []
    for i in range(n):
        user = user_model.objects.create_user(f"{prefix}{i}", password=None)
        tokens.append(api_token_issue(user=user, name="bench")[1])
    connections.close_all()
    return tokens


# --- The clients ----------------------------------------------------------------------------


@dataclass
class Answer:
    ack: float
    started: float
    ttft: float
    total: float
    frames: int
    bytes: int
    chars: int
    sent_at: float
    done_at: float


async def client(
    url: str, token: str, rounds: int, start: asyncio.Event, ready: list[int]
) -> list[Answer]:
    from websockets.asyncio.client import connect

    answers = []
    async with connect(
        url, additional_headers={"Authorization": f"Bearer {token}"}, max_size=None
    ) as ws:
        for expected in ("sessions", "session_history"):
            frame = json.loads(await ws.recv())
            assert frame["type"] == expected, frame
        ready.append(1)
        await start.wait()
        for r in range(rounds):
            sent_at = time.perf_counter()
            await ws.send(json.dumps({"type": "send", "content": f"question {r}"}))
            first = acked = started = None
            frames = size = 0
            text = ""
            committed = None
            while True:
                raw = await ws.recv()
                now = time.perf_counter()
                frames += 1
                size += len(raw.encode() if isinstance(raw, str) else raw)
                frame = json.loads(raw)
                kind = frame["type"]
                if kind == "queued":
                    acked = now
                elif kind == "history_delta" and started is None:
                    started = now
                if kind == "turn_snapshot":
                    if first is None:
                        first = now
                    assert frame["text_offset"] == len(text), "a tail that does not apply"
                    text = text[: frame["text_offset"]] + frame["text"]
                elif kind == "history_delta" and frame["turn_id"]:
                    assistant = [m for m in frame["messages"] if m["role"] == "assistant"]
                    if assistant:
                        committed = assistant[-1]["content"]
                elif kind == "turn_updated":
                    assert frame["status"] == "completed", frame
                    break
                elif kind == "error":
                    raise RuntimeError(frame)
            assert committed is not None and text == committed, "snapshots != committed answer"
            answers.append(
                Answer(
                    ack=(acked or now) - sent_at,
                    started=(started or now) - sent_at,
                    ttft=(first or now) - sent_at,
                    total=now - sent_at,
                    frames=frames,
                    bytes=size,
                    chars=len(committed),
                    sent_at=sent_at,
                    done_at=now,
                )
            )
    return answers


async def run_level(url: str, tokens: list[str], rounds: int) -> list[Answer]:
    start = asyncio.Event()
    ready: list[int] = []
    tasks = [asyncio.create_task(client(url, t, rounds, start, ready)) for t in tokens]
    while len(ready) < len(tokens):
        for task in tasks:
            if task.done() and task.exception():
                raise task.exception()  # type: ignore[misc]
        await asyncio.sleep(0.01)
    start.set()
    results = await asyncio.gather(*tasks)
    return [a for answers in results for a in answers]


def report(n: int, answers: list[Answer], chunk: int) -> dict[str, float]:
    wall = max(a.done_at for a in answers) - min(a.sent_at for a in answers)
    chars = sum(a.chars for a in answers)
    ttft = [a.ttft * 1000 for a in answers]
    return {
        "clients": n,
        "answers": len(answers),
        "wall_s": wall,
        "chars_per_s": chars / wall,
        "tokens_per_s": chars / chunk / wall,
        "frames_per_answer": statistics.mean(a.frames for a in answers),
        "bytes_per_answer": statistics.mean(a.bytes for a in answers),
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_p99_ms": percentile(ttft, 99),
        "answer_p50_ms": statistics.median(a.total * 1000 for a in answers),
        "ack_p50_ms": statistics.median(a.ack * 1000 for a in answers),
        "start_p50_ms": statistics.median(a.started * 1000 for a in answers),
    }


def main(args: argparse.Namespace) -> None:
    levels = [int(x) for x in args.clients.split(",") if x.strip()]
    model, model_url = start_model(args)
    tmp = Path(tempfile.mkdtemp(prefix="ws-bench-"))
    from tests.procs import embedded_env

    env = embedded_env(
        tmp,
        LLM_BASE_URL=model_url,
        LLM_MODEL="bench",
        CHAT_RATE_LIMIT_PER_MINUTE="1000000",
        CHAT_AUTO_TITLE_AFTER="1000000",
        CHAT_QUEUE_CAPACITY="1000",
        LOG_LEVEL="WARNING",
    )
    os.environ.update(env)
    os.environ["DJANGO_SETTINGS_MODULE"] = "chatcore.settings"
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    tokens = {n: make_tokens(f"l{n}u", n) for n in levels}
    server, port, log = start_daphne(env, tmp)
    url = f"ws://127.0.0.1:{port}/ws/chat/"
    rows = []
    try:
        for n in levels:
            rounds = args.rounds or max(3, 50 // n)
            answers = asyncio.run(run_level(url, tokens[n], rounds))
            row = report(n, answers, args.chunk)
            rows.append(row)
            print(
                f"{n:>4} clients: {row['chars_per_s']:>9.0f} chars/s "
                f"{row['tokens_per_s']:>8.0f} tokens/s  "
                f"{row['frames_per_answer']:.1f} frames/answer  "
                f"{row['bytes_per_answer']:.0f} B/answer  "
                f"TTFT p50 {row['ttft_p50_ms']:.1f} ms p99 {row['ttft_p99_ms']:.1f} ms  "
                f"(p50: queued {row['ack_p50_ms']:.1f} ms, user delta "
                f"{row['start_p50_ms']:.1f} ms, turn_updated {row['answer_p50_ms']:.0f} ms; "
                f"{row['answers']} answers "
                f"in {row['wall_s']:.2f} s)",
                flush=True,
            )
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        assert model.stdin is not None
        model.stdin.close()
        model.wait(timeout=10)
    print(
        f"\nanswer {args.answer_chars} chars in {args.chunk}-char deltas, "
        f"{args.rounds or 'max(3, 50 // clients)'} sends per client; "
        f"server log: {tmp / 'serve.log'}"
    )
    print("| clients | chars/s | tokens/s | frames/answer | bytes/answer | TTFT p50 | TTFT p99 |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['clients']} | {row['chars_per_s']:.0f} | {row['tokens_per_s']:.0f} "
            f"| {row['frames_per_answer']:.1f} | {row['bytes_per_answer']:.0f} "
            f"| {row['ttft_p50_ms']:.0f} ms | {row['ttft_p99_ms']:.0f} ms |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", default="1,10,100", help="comma-separated levels")
    parser.add_argument(
        "--rounds", type=int, default=0, help="sends per client (default: max(3, 50 // clients))"
    )
    parser.add_argument("--answer-chars", type=int, default=4000)
    parser.add_argument("--chunk", type=int, default=4, help="characters per model delta")
    parser.add_argument("--serve-model", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.serve_model:
        serve_model(ns.answer_chars, ns.chunk)
    else:
        main(ns)
