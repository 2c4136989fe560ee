"""Where a send's time goes before its first token, inside one `serve` process.

    .venv/bin/python bench/send_timeline.py [--turns 60] [--scaled
        --database-url postgres://postgres@127.0.0.1:5432/test --redis-url redis://127.0.0.1:6379/9]
        [--loop-between START END] [--slowest N]

One `manage.py serve` process (embedded mode, or with `--scaled` PostgreSQL + Redis on a
throwaway database), the fake model of `compare_bench.py` in its own process, and one client
that sends `--turns` messages one after another, each as soon as the last answer ended, as
`compare_bench.py` does for its one-turn-at-a-time figures. The server runs with
`bench/timeline/sitecustomize.py` on its path, which wraps the steps of a send (the frame
received, the admission and its locked row, the input built beside it, the worker, the model
request, the snapshot, the socket's frames, every call on the database threads) and records
the time and the thread's CPU time at entry and exit. The first five sends are left out.

It prints, per step, the median time since the frame arrived (`>` when the step was entered,
`<` when it was left) and the median CPU its thread spent between the two: the hops between
threads show as gaps between one step's end and the next one's start on another thread, and
a step on a database thread whose wall time is much longer than its CPU waited (for a
server, or for the interpreter lock). A step on the event loop (a coroutine) counts the
loop's CPU while it was under way, the other tasks' included. The wrappers add a few
microseconds per step; read the figures beside each other, not as the platform's own latency
(`compare_bench.py` measures that).

`--loop-between START END` (two steps as printed, e.g. `"model socket read<"` and
`"socket: turn_snapshot>"`) also times every callback the event loop runs and prints, per
send, how long the loop spent on what between the two: a span much longer than the loop's
busy time waited for another thread or a server; a busy span shows whose work came first.

`--slowest N` also prints every step of the N sends whose first snapshot went out last.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.clients import run_clients  # noqa: E402
from bench.servers import Model, platform_env, scaled_env, start_platform  # noqa: E402


def main(args: argparse.Namespace) -> None:
    model = Model(argparse.Namespace(answer_chars=args.answer_chars, chunk=4, pace=0.02))
    tmp = Path(tempfile.mkdtemp(prefix="send-timeline-"))
    out = tmp / "timeline.txt"
    hooks = {
        "SEND_TIMELINE": str(out),
        "SEND_TIMELINE_LOOP": "|".join(args.loop_between or ()),
        "SEND_TIMELINE_SLOWEST": str(args.slowest),
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT / "bench" / "timeline"), os.environ.get("PYTHONPATH")) if p
        ),
    }
    if args.scaled:
        env, drop = scaled_env(model, tmp, args.database_url, args.redis_url)
    else:
        (tmp / "emb").mkdir()
        env, drop = platform_env(model, tmp / "emb"), None
    env.update(hooks)
    target = start_platform("platform", env, tmp, 1, 1)
    if drop is not None:
        target.cleanup.append(drop)
    try:
        first, _ = model.own_times(paced=False)
        serial = asyncio.run(run_clients(target, 1, args.turns + 5, "fast", model.text))
        added = [max(0.0, s.ttft - first) * 1000 for s in serial[5:]]
        os.kill(target.procs[0].pid, signal.SIGUSR2)
        for _ in range(100):
            if out.exists() and out.stat().st_size:
                break
            time.sleep(0.05)
        mode = "PostgreSQL + Redis" if args.scaled else "embedded"
        print(f"{mode}, {len(added)} sends one after another")
        print(f"added TTFT at the client, p50: {statistics.median(added):.2f} ms\n")
        print(out.read_text())
    finally:
        target.stop()
        model.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=60, help="sends measured (after 5 more)")
    parser.add_argument("--answer-chars", type=int, default=1000)
    parser.add_argument("--scaled", action="store_true", help="PostgreSQL + Redis")
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL", ""))
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""))
    parser.add_argument(
        "--loop-between",
        nargs=2,
        metavar=("START", "END"),
        help="also time the event loop's callbacks between these two steps, as printed "
        '(e.g. "model socket read<" "socket: turn_snapshot>")',
    )
    parser.add_argument(
        "--slowest",
        type=int,
        default=0,
        metavar="N",
        help="also print every step of the N sends whose first snapshot went out last",
    )
    main(parser.parse_args())
