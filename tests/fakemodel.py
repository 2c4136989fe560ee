"""A fake OpenAI-compatible model server: a real HTTP server on loopback, in its own thread.

Tests script its replies (text streamed in chunks, tool calls, HTTP errors, slow or endless
streams) and read back the requests it received and whether clients hung up mid-stream. It
is the only fake in the suite: the engine under test is always the real one.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reply:
    text: str = ""
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    status: int = 200
    error: dict[str, Any] | None = None
    chunk: int = 4
    delay: float = 0.0
    # Keep streaming filler slowly until the client disconnects (for stop tests).
    endless: bool = False
    # Wait for this event (set from the test) before finishing the stream.
    gate: threading.Event | None = None
    # Wait for this event after the response's headers, before the first chunk (a model slow
    # to its first token).
    first_token_gate: threading.Event | None = None
    usage: dict[str, Any] | None = None
    # The finish reason of the last chunk (default: tool_calls when there are calls, else
    # stop), e.g. "length" or "content_filter".
    finish_reason: str | None = None
    # An SSE `error` chunk sent after the text (a failure after the HTTP 200).
    stream_error: dict[str, Any] | None = None


def strip_runtime(text: str) -> str:
    return text.split("\n\n[runtime context]", 1)[0]


def echo_reply(request: dict[str, Any]) -> Reply:
    users = [m for m in request["messages"] if m["role"] == "user"]
    last = strip_runtime(users[-1]["content"]) if users else ""
    return Reply(text=f"echo: {last}")


@dataclass
class RecordedRequest:
    body: dict[str, Any]
    headers: dict[str, str]
    # The request line's target: a path, or an absolute URL when it came through as a proxy.
    target: str = ""
    aborted: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.body["messages"]

    @property
    def purpose_system(self) -> str:
        return self.messages[0]["content"] if self.messages else ""


class FakeModelServer:
    def __init__(self, *, record: bool = True) -> None:
        """`record`: keep every request in `requests` (tests read them). A long-running
        benchmark's model does not: thousands of parsed bodies kept alive made its collector's
        full passes take tens of milliseconds, inside whichever turn was being served."""
        self.record = record
        self.replies: list[Reply | Callable[[dict[str, Any]], Reply]] = []
        self.default: Callable[[dict[str, Any]], Reply] = echo_reply
        self.requests: list[RecordedRequest] = []
        self.active = 0
        self.max_active = 0
        # Concurrency per key (e.g. per user): `key_of(body)` names the key of a request.
        self.key_of: Callable[[dict[str, Any]], str] | None = None
        self.active_by_key: dict[str, int] = {}
        self.max_active_by_key: dict[str, int] = {}
        # `GET /models` (H4): the ids it lists, the status it answers with, and how many
        # times it was asked (never recorded in `requests`).
        self.models: list[str] = ["fake"]
        self.models_status = 200
        self.models_calls = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.port = 0

    # --- control -------------------------------------------------------------------------
    def start(self) -> FakeModelServer:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        fut.result(timeout=10)
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            current = asyncio.current_task()
            handlers = [t for t in asyncio.all_tasks() if t is not current]
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def script(self, *replies: Reply | Callable[[dict[str, Any]], Reply]) -> None:
        with self._lock:
            self.replies.extend(replies)

    def turn_requests(self) -> list[RecordedRequest]:
        """Requests made for turns (they offer tools), not titles or summaries."""
        return [r for r in self.requests if r.body.get("tools")]

    def wait_requests(self, n: int, timeout: float = 10.0) -> list[RecordedRequest]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.requests) >= n:
                return self.requests
            time.sleep(0.01)
        raise AssertionError(f"expected {n} requests, got {len(self.requests)}")

    async def requests_made(self, n: int, timeout: float = 10.0) -> list[RecordedRequest]:
        """Async wait (never block the test's event loop) for n requests."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.requests) < n:
            if loop.time() > deadline:
                raise AssertionError(f"expected {n} requests, got {len(self.requests)}")
            await asyncio.sleep(0.01)
        return self.requests

    # --- HTTP ----------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length", "0"))
                body = json.loads(await reader.readexactly(length)) if length else {}
                target = lines[0].split(" ")[1] if " " in lines[0] else ""
                if lines[0].startswith("GET ") and target.rstrip("/").endswith("/models"):
                    await self._list_models(writer)
                    continue
                record = RecordedRequest(body=body, headers=headers, target=target)
                with self._lock:
                    if self.record:
                        self.requests.append(record)
                    reply_src = self.replies.pop(0) if self.replies else self.default
                reply = reply_src(body) if callable(reply_src) else reply_src
                key = self.key_of(body) if self.key_of is not None else ""
                with self._lock:
                    self.active += 1
                    self.max_active = max(self.max_active, self.active)
                    self.active_by_key[key] = self.active_by_key.get(key, 0) + 1
                    self.max_active_by_key[key] = max(
                        self.max_active_by_key.get(key, 0), self.active_by_key[key]
                    )
                try:
                    keep = await self._respond(reply, record, reader, writer)
                finally:
                    with self._lock:
                        self.active -= 1
                        self.active_by_key[key] -= 1
                record.finished.set()
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _list_models(self, writer: asyncio.StreamWriter) -> None:
        with self._lock:
            self.models_calls += 1
            status, ids = self.models_status, list(self.models)
        if status == 200:
            payload = json.dumps(
                {"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}
            ).encode()
        else:
            payload = json.dumps({"error": {"message": "fake failure"}}).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await writer.drain()

    async def _respond(
        self,
        reply: Reply,
        record: RecordedRequest,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        if reply.gate is not None and reply.status != 200:
            while not reply.gate.is_set():
                await asyncio.sleep(0.01)
        if reply.status != 200:
            payload = json.dumps(reply.error or {"error": {"message": "fake failure"}}).encode()
            writer.write(
                f"HTTP/1.1 {reply.status} Error\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
            return True
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )

        async def send_event(data: str) -> None:
            raw = f"data: {data}\n\n".encode()
            writer.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
            await writer.drain()

        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            return json.dumps(
                {
                    "id": "x",
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                }
            )

        try:
            if reply.first_token_gate is not None:
                while not reply.first_token_gate.is_set():
                    await asyncio.sleep(0.01)
            text = reply.text
            for i in range(0, len(text), max(1, reply.chunk)):
                await send_event(chunk({"content": text[i : i + reply.chunk]}))
                if reply.delay:
                    await asyncio.sleep(reply.delay)
            if reply.endless:
                eof = asyncio.ensure_future(reader.read(1))
                while not eof.done():
                    await send_event(chunk({"content": "."}))
                    await asyncio.sleep(0.02)
                record.aborted.set()
                return False
            if reply.gate is not None:
                while not reply.gate.is_set():
                    await asyncio.sleep(0.01)
            for index, (name, args) in enumerate(reply.tool_calls):
                call_id = f"call_{len(self.requests)}_{index}"
                await send_event(
                    chunk(
                        {
                            "tool_calls": [
                                {
                                    "index": index,
                                    "id": call_id,
                                    "type": "function",
                                    "function": {"name": name, "arguments": ""},
                                }
                            ]
                        }
                    )
                )
                arg_text = json.dumps(args)
                mid = len(arg_text) // 2
                for part in (arg_text[:mid], arg_text[mid:]):
                    await send_event(
                        chunk({"tool_calls": [{"index": index, "function": {"arguments": part}}]})
                    )
            if reply.stream_error is not None:
                await send_event(json.dumps({"error": reply.stream_error}))
                await send_event("[DONE]")
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                return True
            finish = reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")
            await send_event(chunk({}, finish))
            usage = reply.usage or {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
            await send_event(json.dumps({"id": "x", "choices": [], "usage": usage}))
            await send_event("[DONE]")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        except (ConnectionError, RuntimeError):
            record.aborted.set()
            return False


def user_texts(request: RecordedRequest) -> list[str]:
    return [strip_runtime(m["content"]) for m in request.messages if m["role"] == "user"]


RUNTIME_RE = re.compile(r"\[runtime context\]")
