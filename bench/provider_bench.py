"""The model client alone: event-loop CPU per streamed event (issue 10).

    .venv/bin/python bench/provider_bench.py [--streams 40] [--at-once 10] [--pace 0.002]

`OpenAIProvider` (its own transport, `chatcore/engine/provider_net.py`) reads `--streams`
answers of 250 events each from `tests.fakemodel.FakeModelServer` in its own process (the
model of `compare_bench.py`),
`--at-once` at a time; the model waits `--pace` seconds after each event (0: the whole answer
at once). Printed: the loop thread's CPU time (`time.thread_time`) per event and per answer,
so the figure holds up on a busy machine better than a wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.servers import Model  # noqa: E402


async def measure(model: Model, content: str, streams: int, at_once: int) -> tuple[float, int]:
    from chatcore.engine.provider import OpenAIProvider
    from chatcore.engine.provider_types import Completion

    provider = OpenAIProvider(base_url=model.url, api_key="", model="m")

    async def one() -> int:
        events = 0
        async for event in provider.stream(messages=[{"role": "user", "content": content}]):
            events += 1
            if isinstance(event, Completion):
                assert event.text == model.text, "the answer did not arrive whole"
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
    # compare_bench's model: 1,000 characters in 4-character events, paced when asked.
    model = Model(argparse.Namespace(answer_chars=1000, chunk=4, pace=args.pace))
    try:
        content = "paced" if args.pace else "fast"
        cpu, events = asyncio.run(measure(model, content, args.streams, args.at_once))
    finally:
        model.stop()
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
    main(parser.parse_args())
