"""The model client alone: event-loop CPU per streamed event (issue 10).

    .venv/bin/python bench/provider_bench.py [--streams 40] [--at-once 10] [--pace 0.002]

`OpenAIProvider` (its own transport, `chatcore/engine/provider_net.py`) reads `--streams`
answers of 250 events each from `tests.fakemodel.FakeModelServer` in its own process,
`--at-once` at a time; the model waits `--pace` seconds after each event (0: the whole answer
at once). Printed: the loop thread's CPU time (`time.thread_time`) per event and per answer,
so the figure holds up on a busy machine better than a wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXT = "abcd" * 250  # 250 events of 4 characters


def serve_model(pace: float) -> None:
    from tests.fakemodel import FakeModelServer, Reply

    server = FakeModelServer()
    reply = Reply(text=TEXT, chunk=4, delay=pace)
    server.default = lambda request: reply
    server.start()
    print(server.url, flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()


async def measure(url: str, streams: int, at_once: int) -> tuple[float, int]:
    from chatcore.engine.provider import OpenAIProvider
    from chatcore.engine.provider_types import Completion

    provider = OpenAIProvider(base_url=url, api_key="", model="m")

    async def one() -> int:
        events = 0
        async for event in provider.stream(messages=[{"role": "user", "content": "hi"}]):
            events += 1
            if isinstance(event, Completion):
                assert event.text == TEXT, "the answer did not arrive whole"
        return events

    await asyncio.gather(*(one() for _ in range(2)))  # warm up: imports, connections
    started = time.thread_time()
    events = 0
    for _ in range(streams // at_once):
        events += sum(await asyncio.gather(*(one() for _ in range(at_once))))
    cpu = time.thread_time() - started
    await provider.aclose()
    return cpu, events


def main(args: argparse.Namespace) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatcore.settings")
    os.environ.setdefault("CHAT_VAR_DIR", tempfile.mkdtemp(prefix="provider-bench-"))
    import django

    django.setup()
    model = subprocess.Popen(
        [sys.executable, __file__, "--serve-model", "--pace", str(args.pace)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert model.stdout is not None
        url = model.stdout.readline().strip()
        cpu, events = asyncio.run(measure(url, args.streams, args.at_once))
    finally:
        assert model.stdin is not None
        model.stdin.close()
        model.wait()
    answers = args.streams // args.at_once * args.at_once
    print(
        f"{answers} answers of 250 events, {args.at_once} at a time, model pace "
        f"{args.pace * 1000:g} ms/event: {events} deltas reached the caller; loop CPU "
        f"{cpu / (answers * 250) * 1e6:.1f} us per event, {cpu / answers * 1000:.2f} ms per answer"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--at-once", type=int, default=10)
    parser.add_argument("--pace", type=float, default=0.002, help="seconds after each event")
    parser.add_argument("--serve-model", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.serve_model:
        serve_model(ns.pace)
    else:
        main(ns)
