"""Helpers of the REST API tests: a JSON client of the real ASGI stack (AsyncClient), token
issuing, error-shape checks and Server-Sent Events parsing (the `api` fixture is in
conftest.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import AsyncClient, override_settings

from chatcore.engine import runtime
from sessions_app import services
from sessions_app.models import Turn

BASE = "/api/v1"
TERMINAL = ("completed", "cancelled", "failed")


def chat_cfg(**changes: Any) -> Any:
    return override_settings(CHAT={**settings.CHAT, **changes})


@asynccontextmanager
async def engine_with(make_engine: Any, **changes: Any) -> AsyncIterator[Any]:
    """Settings changed for the API and a process engine started under them (an engine
    reads its settings when it starts)."""
    with chat_cfg(**changes):
        previous = await runtime.get_engine()
        engine = await make_engine()
        runtime.set_engine(engine)
        try:
            yield engine
        finally:
            runtime.set_engine(previous)


async def issue_token(user: Any) -> str:
    _token, raw = await sync_to_async(services.api_token_issue)(user=user, name="test")
    return raw


class Api:
    """A client of the API: JSON in, (status, JSON) out. Headers go with every request
    (AsyncClient(headers=...) sends them under wrong names in this Django version)."""

    def __init__(self, client: AsyncClient, headers: dict[str, str] | None = None) -> None:
        self.client = client
        self.headers = headers or {}

    async def call(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any, Any]:
        url = path if path.startswith("/api/") else BASE + path
        headers = {**self.headers, **(headers or {})}
        if method in ("GET", "HEAD"):
            fn = getattr(self.client, method.lower())
            response = await fn(url, body or {}, headers=headers)
        elif body is None:  # no body at all, as curl or httpx send it
            response = await self.client.generic(method, url, b"", headers=headers)
        else:
            response = await self.client.generic(
                method, url, json.dumps(body), content_type="application/json", headers=headers
            )
        data = None
        if response.get("Content-Type", "").startswith("application/json") and response.content:
            data = json.loads(response.content)
        return response.status_code, data, response

    async def get(self, path: str, **params: Any) -> tuple[int, Any]:
        status, data, _ = await self.call("GET", path, params)
        return status, data

    async def post(self, path: str, body: Any = None) -> tuple[int, Any]:
        status, data, _ = await self.call("POST", path, body)
        return status, data

    async def patch(self, path: str, body: Any) -> tuple[int, Any]:
        status, data, _ = await self.call("PATCH", path, body)
        return status, data

    async def delete(self, path: str) -> tuple[int, Any]:
        status, data, _ = await self.call("DELETE", path)
        return status, data

    async def create(self, **body: Any) -> dict[str, Any]:
        status, data = await self.post("/sessions", body)
        assert status == 201, data
        return data

    async def send(self, session_id: str, content: str, **body: Any) -> dict[str, Any]:
        status, data = await self.post(
            f"/sessions/{session_id}/messages", {"content": content, **body}
        )
        assert status == 202, data
        return data

    async def turn_done(self, turn_id: str, timeout: float = 15.0) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            status, data = await self.get(f"/turns/{turn_id}")
            assert status == 200, data
            if data["status"] in TERMINAL:
                return data
            assert loop.time() < deadline, f"turn still {data['status']}"
            await asyncio.sleep(0.03)

    async def until(self, path: str, pred: Any, timeout: float = 10.0) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            status, data = await self.get(path)
            if status == 200 and pred(data):
                return data
            assert loop.time() < deadline, f"condition on {path} not met: {data}"
            await asyncio.sleep(0.03)


async def bearer_api(user: Any) -> Api:
    return Api(AsyncClient(), {"Authorization": f"Bearer {await issue_token(user)}"})


def error_of(status: int, data: Any, expected_status: int, code: str) -> None:
    assert status == expected_status, data
    assert data["code"] == code, data
    assert isinstance(data["message"], str) and data["message"]


async def wait_turn_row(turn_id: str, timeout: float = 15.0) -> Turn:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        turn = await sync_to_async(Turn.objects.get)(pk=turn_id)
        if turn.status in TERMINAL:
            return turn
        assert loop.time() < deadline
        await asyncio.sleep(0.03)


def parse_sse(raw: str) -> list[dict[str, Any]]:
    events = []
    for block in raw.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if line.startswith(":") or ":" not in line:
                continue
            key, _, value = line.partition(":")
            fields[key] = value.lstrip(" ")
        if "event" in fields:
            events.append(
                {"event": fields["event"], "id": int(fields["id"]), **json.loads(fields["data"])}
            )
    return events


async def read_stream(response: Any) -> list[dict[str, Any]]:
    chunks = []
    async for chunk in response.streaming_content:
        chunks.append(chunk.decode() if isinstance(chunk, bytes) else chunk)
    return parse_sse("".join(chunks))


async def stream_post(api: Api, path: str, body: dict[str, Any] | None = None) -> Any:
    response = await api.client.generic(
        "POST",
        f"{BASE}{path}",
        json.dumps(body) if body is not None else b"",
        content_type="application/json",
        headers={**api.headers, "Accept": "text/event-stream"},
    )
    assert response.status_code == 200, response.content
    return response
