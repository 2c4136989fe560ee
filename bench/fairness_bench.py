"""Fairness benchmark (SPEC F7): how long another user's `sessions` read waits, and how long
the event loop stalls, while one user's very long dialog is built for a send.

    .venv/bin/python bench/fairness_bench.py [--messages 20000] [--big 20]

One user has a dialog of `--messages` stored messages (~300 characters each) plus `--big`
injects of 60,000 characters; they send once. Until the model receives that turn's request,
a second user reads their `sessions` frame over and over (the same call the WebSocket makes,
on the ORM thread), and a ticker measures the event loop's longest stall. The model is a
zero-latency stream served in-process by `httpx.MockTransport`. It creates its own SQLite
database in a temporary folder.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BODY = (
    b'data: {"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":null}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)


async def main(args: argparse.Namespace) -> None:
    import httpx
    from asgiref.sync import sync_to_async
    from channels.db import database_sync_to_async
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from chatcore.engine.clientstate import sessions_frame
    from chatcore.engine.engine import Engine, Inbound
    from chatcore.engine.provider import OpenAIProvider
    from sessions_app import services
    from sessions_app.models import Message, MessageKind, Session

    await sync_to_async(call_command)("migrate", verbosity=0)
    make = get_user_model().objects.create_user
    alice = await sync_to_async(make)("alice")
    bob = await sync_to_async(make)("bob")
    requested = asyncio.Event()
    loop = asyncio.get_running_loop()

    def handler(request: httpx.Request) -> httpx.Response:
        loop.call_soon_threadsafe(requested.set)
        return httpx.Response(200, content=BODY, headers={"content-type": "text/event-stream"})

    provider = OpenAIProvider(
        base_url="http://model.invalid/v1", model="bench", transport=httpx.MockTransport(handler)
    )
    engine = Engine(provider=provider, name="bench")
    await engine.start()

    def long_dialog() -> Session:
        session = services.session_create(
            owner=alice, channel="web", chat_id=f"u{alice.pk}", dialog_id="long"
        )
        start = session.last_seq
        every = max(1, args.messages // max(1, args.big)) if args.big else 0
        rows = []
        for i in range(1, args.messages + 1):
            big = bool(every) and i % every == 0
            rows.append(
                Message(
                    session=session,
                    seq=start + i,
                    role="user" if big or i % 2 else "assistant",
                    content="inject " * 8570 if big else f"message {i} " + "lorem ipsum " * 25,
                    source={"kind": MessageKind.INJECT if big else MessageKind.USER_INPUT},
                )
            )
        Message.objects.bulk_create(rows, batch_size=2000)
        Session.objects.filter(pk=session.pk).update(last_seq=start + args.messages)
        return Session.objects.get(pk=session.pk)

    session = await sync_to_async(long_dialog)()
    await sync_to_async(services.session_create)(
        owner=bob, channel="web", chat_id=f"u{bob.pk}", dialog_id="short"
    )

    stall = 0.0

    async def ticker() -> None:
        nonlocal stall
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            stall = max(stall, now - last - 0.005)
            last = now

    ticking = asyncio.create_task(ticker())
    started = time.perf_counter()
    await engine.submit(
        Inbound(
            owner=alice,
            channel="web",
            chat_id=f"u{alice.pk}",
            content="one more question",
            sender_id=str(alice.pk),
        ),
        session,
    )
    rtts: list[float] = []
    while not requested.is_set():
        sent = time.perf_counter()
        await database_sync_to_async(sessions_frame)(
            owner_id=bob.pk, channel="web", chat_id=f"u{bob.pk}", current=None
        )
        rtts.append((time.perf_counter() - sent) * 1000)
        await asyncio.sleep(0.01)
    build = time.perf_counter() - started
    ticking.cancel()
    await engine.wait_idle(timeout=120)
    await engine.shutdown(grace=5)

    print(
        f"dialog of {args.messages} messages + {args.big} injects of 60,000 characters: "
        f"send to first model request {build * 1000:.0f} ms"
    )
    if rtts:
        print(
            f"other user's sessions reads meanwhile: {len(rtts)}, p50 "
            f"{statistics.median(rtts):.1f} ms, max {max(rtts):.1f} ms"
        )
    print(f"longest event loop stall: {stall * 1000:.1f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--big", type=int, default=20)
    ns = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="chat-bench-")
    os.environ.update(
        {
            "CHAT_VAR_DIR": tmp,
            "DATABASE_URL": "",
            "REDIS_URL": "",
            "LOG_LEVEL": "WARNING",
            "DJANGO_SETTINGS_MODULE": "chatcore.settings",
        }
    )
    import django

    django.setup()
    asyncio.run(main(ns))
