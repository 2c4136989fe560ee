"""The floor: a bare Channels relay of the same fake model, on Daphne.

No database, no auth, no queue, no coalescing: a connect is answered with an empty
`session_history`, a `sessions` frame with an empty list; each `send` frame opens one streamed
`/chat/completions` request with httpx and relays every model delta as a `turn_snapshot` tail,
then a `turn_updated`. It is what any Channels app must at least spend to open a socket and to
stream a model to it, so `bench/compare_bench.py` and `bench/reconnect_bench.py` print the
platform's figures as ratios to it, measured in the same run on the same machine.

    FLOOR_MODEL_URL=http://127.0.0.1:PORT/v1 .venv/bin/daphne -p 9000 bench.floor_relay:application
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from typing import Any

import django
from django.conf import settings

if not settings.configured:
    settings.configure(DEBUG=False, DATABASES={}, INSTALLED_APPS=[], CHANNEL_LAYERS={})
    django.setup()

import httpx  # noqa: E402
from channels.generic.websocket import AsyncWebsocketConsumer  # noqa: E402
from channels.routing import URLRouter  # noqa: E402
from django.urls import path  # noqa: E402

MODEL_URL = os.environ.get("FLOOR_MODEL_URL", "http://127.0.0.1:8001/v1")
# The same pool shape as the platform's provider: no cap on connections, a small keep-alive.
_client = httpx.AsyncClient(
    timeout=httpx.Timeout(60.0, connect=5.0),
    limits=httpx.Limits(max_connections=None, max_keepalive_connections=20),
)


# What a connect is answered with: a dialog with no message, no turn and no queue.
EMPTY_HISTORY = json.dumps(
    {
        "type": "session_history",
        "session_id": "floor:floor:default",
        "dialog_id": "default",
        "title": "",
        "history_revision": 0,
        "messages": [],
        "has_more": False,
        "active_turn": None,
        "queue": [],
    }
)
EMPTY_SESSIONS = json.dumps({"type": "sessions", "current": "default", "items": []})


class RelayConsumer(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        await self.accept()
        await self.send(EMPTY_HISTORY)

    async def disconnect(self, code: int) -> None:
        for task in self.tasks:
            task.cancel()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        frame = json.loads(text_data or "{}")
        if frame.get("type") == "sessions":
            await self.send(EMPTY_SESSIONS)
            return
        if frame.get("type") != "send":
            return
        task = asyncio.get_running_loop().create_task(self._stream(str(frame["content"])))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _stream(self, content: str) -> None:
        turn_id = uuid.uuid4().hex
        await self.send(json.dumps({"type": "queued", "turn_id": turn_id, "position": 0}))
        body = {
            "model": "floor",
            "stream": True,
            "messages": [{"role": "user", "content": content}],
            "tools": [{"type": "function", "function": {"name": "noop", "parameters": {}}}],
        }
        text_len = 0
        async with _client.stream("POST", f"{MODEL_URL}/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        await self.send(
                            json.dumps(
                                {
                                    "type": "turn_snapshot",
                                    "turn_id": turn_id,
                                    "status": "running",
                                    "text_offset": text_len,
                                    "text": delta,
                                }
                            )
                        )
                        text_len += len(delta)
        await self.send(
            json.dumps({"type": "turn_updated", "turn_id": turn_id, "status": "completed"})
        )


application = URLRouter([path("ws/chat/", RelayConsumer.as_asgi())])
