"""Engine benchmark, embedded mode: turns per second and the engine's added latency to the
first token, against a zero-latency model (an in-process OpenAI-compatible stream served by
`httpx.MockTransport`, so no network and no model time is measured).

    .venv/bin/python bench/engine_bench.py [--turns 200] [--dialogs 10] [--sends 20]

It creates its own SQLite database in a temporary folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def sse_body(text: str) -> bytes:
    def event(delta: dict, finish: str | None = None) -> str:
        return (
            "data: "
            + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
            + "\n\n"
        )

    words = [w + " " for w in text.split()]
    body = "".join(event({"content": w}) for w in words) + event({}, "stop") + "data: [DONE]\n\n"
    return body.encode()


def mock_provider(body: bytes):
    """An OpenAI-compatible provider whose every answer is `body`, in process (no network)."""
    import httpx

    from chatcore.engine.provider import OpenAIProvider

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return OpenAIProvider(
        base_url="http://model.invalid/v1", model="bench", transport=httpx.MockTransport(handler)
    )


async def start_engine() -> tuple[Any, Any]:
    """A migrated database, a user, and a started engine on `mock_provider`: (user, engine)."""
    from asgiref.sync import sync_to_async
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from chatcore.engine.engine import Engine

    await sync_to_async(call_command)("migrate", verbosity=0)
    user = await sync_to_async(get_user_model().objects.create_user)("bench")
    body = sse_body("The quick brown fox jumps over the lazy dog " * 5)
    engine = Engine(provider=mock_provider(body), name="bench")
    await engine.start()
    return user, engine


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def main(args: argparse.Namespace) -> None:
    from asgiref.sync import sync_to_async
    from channels.layers import get_channel_layer

    from chatcore.common import publish
    from chatcore.engine.engine import Inbound
    from sessions_app import services

    user, engine = await start_engine()
    layer = get_channel_layer()

    async def dialog(name: str):
        return await sync_to_async(services.session_create)(
            owner=user, channel="api", chat_id=f"u{user.pk}", dialog_id=name
        )

    def inbound(text: str) -> Inbound:
        return Inbound(
            owner=user, channel="api", chat_id=f"u{user.pk}", content=text, sender_id=str(user.pk)
        )

    # 1. Added latency to first token: one turn at a time, submit -> first snapshot frame.
    session = await dialog("latency")
    channel = await layer.new_channel("bench.")
    await layer.group_add(publish.session_group(session.pk), channel)
    await layer.group_add(publish.chat_group(session.channel, session.chat_id), channel)
    latencies = []
    for i in range(args.turns):
        started = time.perf_counter()
        ack = await engine.submit(inbound(f"question {i}"), session)
        first = None
        ended = False
        while not ended:
            for one in publish.unfold(await layer.receive(channel)):
                frame = one["frame"]
                if frame.get("turn_id") != ack.turn_id:
                    continue
                if frame["type"] == "turn_snapshot" and first is None:
                    first = time.perf_counter() - started
                ended = ended or frame["type"] == "turn_updated"
        latencies.append((first or 0.0) * 1000)
    await engine.wait_idle()

    # 2. Throughput: several dialogs, each with a queue of sends.
    sessions = [await dialog(f"tp{i}") for i in range(args.dialogs)]
    total = args.dialogs * args.sends
    started = time.perf_counter()
    for i in range(args.sends):
        for s in sessions:
            await engine.submit(inbound(f"send {i}"), s)
    await engine.wait_idle(timeout=600)
    elapsed = time.perf_counter() - started
    await engine.shutdown(grace=5)

    print(f"engine added latency to first token over {args.turns} sequential turns (ms):")
    print(
        f"  p50 {statistics.median(latencies):.1f}  p99 {percentile(latencies, 99):.1f}"
        f"  max {max(latencies):.1f}"
    )
    print(
        f"throughput: {total} turns over {args.dialogs} dialogs in {elapsed:.2f}s"
        f" = {total / elapsed:.1f} turns/s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--dialogs", type=int, default=10)
    parser.add_argument("--sends", type=int, default=20)
    ns = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="chat-bench-")
    os.environ.update(
        {
            "CHAT_VAR_DIR": tmp,
            "DATABASE_URL": "",
            "REDIS_URL": "",
            "LOG_LEVEL": "WARNING",
            "CHAT_RATE_LIMIT_PER_MINUTE": "1000000",
            # One user drives every dialog here: measure the engine, not the F7 per-user cap.
            "CHAT_USER_RUNNING_TURNS": "1000000",
            "CHAT_QUEUE_CAPACITY": "1000",
            "DJANGO_SETTINGS_MODULE": "chatcore.settings",
        }
    )
    import django

    django.setup()
    asyncio.run(main(ns))
