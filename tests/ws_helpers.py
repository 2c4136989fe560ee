"""Helpers of the `/ws/chat/` tests: a JSON client of the real ASGI application and what
the tests read from its frames (the `connect` fixture is in conftest.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import override_settings

from chatcore.asgi import application
from sessions_app import services


def chat_cfg(**changes: Any) -> Any:
    return override_settings(CHAT={**settings.CHAT, **changes})


class WS:
    """A test client of `/ws/chat/`: JSON frames in, JSON frames out."""

    def __init__(self, comm: WebsocketCommunicator) -> None:
        self.comm = comm
        self.seen: list[dict[str, Any]] = []
        # The connect frames.
        self.sessions: dict[str, Any] = {}
        self.history: dict[str, Any] = {}

    async def send(self, frame: dict[str, Any] | str) -> None:
        await self.comm.send_to(text_data=frame if isinstance(frame, str) else json.dumps(frame))

    async def next(self, timeout: float = 10.0) -> dict[str, Any]:
        frame = json.loads(await self.comm.receive_from(timeout))
        self.seen.append(frame)
        return frame

    async def until(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 15.0
    ) -> list[dict[str, Any]]:
        """Frames up to and including the first that matches."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        out: list[dict[str, Any]] = []
        while True:
            try:
                frame = await self.next(max(0.05, deadline - loop.time()))
            except TimeoutError:
                raise AssertionError(f"no matching frame; received {out!r}") from None
            out.append(frame)
            if pred(frame):
                return out

    async def drain(self, quiet: float = 0.3) -> list[dict[str, Any]]:
        """Everything that arrives until the connection is quiet for `quiet` seconds."""
        out = []
        while not await self.comm.receive_nothing(timeout=quiet):
            out.append(await self.next())
        return out

    async def ask(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Send a frame and return the answer that carries its client_msg_id."""
        cmid = frame["client_msg_id"]
        await self.send(frame)
        frames = await self.until(lambda f: f.get("client_msg_id") == cmid)
        return frames[-1]

    async def close(self) -> None:
        await self.comm.disconnect()


async def open_ws(headers: list[tuple[bytes, bytes]], path: str = "/ws/chat/") -> tuple[WS, bool]:
    comm = WebsocketCommunicator(application, path, headers=headers)
    connected, _sub = await comm.connect(timeout=10)
    return WS(comm), connected


async def bearer(user: Any) -> list[tuple[bytes, bytes]]:
    _token, raw = await sync_to_async(services.api_token_issue)(user=user, name="ws")
    return [(b"authorization", f"Bearer {raw}".encode())]


async def assert_closed_unauthenticated(ws: WS) -> None:
    output = await ws.comm.receive_output(timeout=5)
    assert output == {"type": "websocket.close", "code": 4401}


async def count(model: Any, **filters: Any) -> int:
    return await sync_to_async(lambda: model.objects.filter(**filters).count())()


def text_of(frames: list[dict[str, Any]], turn_id: str, known: str = "") -> str:
    """Apply snapshot frames as a client does; every frame must apply contiguously."""
    for f in frames:
        if f["type"] == "turn_snapshot" and f["turn_id"] == turn_id:
            assert f["text_offset"] in (0, len(known)), (f["text_offset"], len(known))
            known = known[: f["text_offset"]] + f["text"]
    return known


def terminal(turn_id: str) -> Callable[[dict[str, Any]], bool]:
    return lambda f: f["type"] == "turn_updated" and f["turn_id"] == turn_id


async def assert_usable(ws: WS) -> None:
    answer = await ws.ask({"type": "sessions", "client_msg_id": "still-there"})
    assert answer["type"] == "sessions"
