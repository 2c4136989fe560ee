"""The bench's WebSocket clients (`compare_bench.py`, `send_timeline.py`): each sends on a
connection of its own and rebuilds every answer from its snapshot tails, checked against the
model's text (`one_client`); many start together once all are connected (`run_clients`).
Each send gives a `Stream`: its time to first token, to `queued` and to its first
`history_delta`, and whether its answer came whole."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.servers import Target  # noqa: E402


@dataclass
class Stream:
    ttft: float
    sent_at: float
    done_at: float
    chars: int
    ok: bool
    # Why not ok: a gap in the snapshots, the turn's end, or the rebuilt text's difference.
    why: str = ""
    # Send to `queued` and to the turn's first `history_delta` (the platform only).
    queued: float = 0.0
    started: float = 0.0


async def one_client(
    url: str,
    token: str | None,
    sends: int,
    content: str,
    expected: str,
    start: asyncio.Event,
    ready: list[int],
    pause: float = 0.0,
    warmup: int = 0,
    warmed: Any = None,
) -> list[Stream]:
    """`pause`: seconds to wait before each send. `warmup`: sends made first on the same
    connection and left out of what is returned; `warmed()` is called after them."""
    from websockets.asyncio.client import connect

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    out = []
    async with connect(url, additional_headers=headers, max_size=None) as ws:
        if token:
            for expected_type in ("sessions", "session_history"):
                frame = json.loads(await ws.recv())
                assert frame["type"] == expected_type, frame
        ready.append(1)
        await start.wait()
        for sent in range(warmup + sends):
            if sent == warmup and warmed is not None:
                warmed()
            if pause:
                await asyncio.sleep(pause)
            sent_at = time.perf_counter()
            await ws.send(json.dumps({"type": "send", "content": content}))
            first = None
            queued = started = 0.0
            text = ""
            why: list[str] = []
            while True:
                frame = json.loads(await ws.recv())
                kind = frame["type"]
                if kind == "queued":
                    queued = queued or time.perf_counter() - sent_at
                elif kind == "history_delta":
                    started = started or time.perf_counter() - sent_at
                elif kind == "turn_snapshot":
                    first = first or time.perf_counter()
                    if frame["text_offset"] > len(text):
                        why.append(f"gap: offset {frame['text_offset']} after {len(text)} chars")
                    text = text[: frame["text_offset"]] + frame["text"]
                elif kind == "turn_updated":
                    if frame["status"] != "completed":
                        why.append(f"ended {frame['status']} {frame.get('reason') or ''}")
                        why.append(json.dumps(frame.get("error")))
                    break
                elif kind == "error":
                    raise RuntimeError(frame)
            if text != expected:
                same = next(
                    (i for i, (a, b) in enumerate(zip(text, expected, strict=False)) if a != b),
                    min(len(text), len(expected)),
                )
                why.append(f"text: {len(text)} of {len(expected)} chars, same up to {same}")
            now = time.perf_counter()
            out.append(
                Stream(
                    (first or now) - sent_at,
                    sent_at,
                    now,
                    len(text),
                    not why,
                    "; ".join(why),
                    queued,
                    started,
                )
            )
    return out[warmup:]


async def run_clients(
    target: Target,
    clients: int,
    sends: int,
    content: str,
    expected: str,
    *,
    pause: float = 0.0,
    warmup: int = 0,
    warmed: Any = None,
) -> list[Stream]:
    start = asyncio.Event()
    ready: list[int] = []
    tasks = []
    for i in range(clients):
        url = target.urls[i % len(target.urls)]
        token = target.tokens[i] if target.platform else None
        tasks.append(
            asyncio.create_task(
                one_client(
                    url, token, sends, content, expected, start, ready, pause, warmup, warmed
                )
            )
        )
    while len(ready) < clients:
        for task in tasks:
            if task.done() and task.exception():
                raise task.exception()  # type: ignore[misc]
        await asyncio.sleep(0.01)
    start.set()
    return [s for result in await asyncio.gather(*tasks) for s in result]
