"""Fake Telegram Bot API and Feishu Open API servers: real HTTP on loopback, each in its own
thread, keeping the chats' messages (with every edit) so tests see what a user would see.

Tests inject failures (a 429 with retry_after, failing edits) and read back the calls. Like
the real platforms, an edit that arrives while a 429's retry_after still runs is refused
again and counted in `early_calls`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

TELEGRAM_TOKEN = "123456:test-token"
BOT_ID = 999
BOT_USERNAME = "testbot"
FEISHU_APP_ID = "cli_test"
FEISHU_APP_SECRET = "feishu-secret"
FEISHU_BOT_OPEN_ID = "ou_bot"

Response = tuple[int, dict[str, str], dict[str, Any] | bytes]


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: dict[str, Any]
    at: float = field(default_factory=time.monotonic)


@dataclass
class PlatformMessage:
    chat_id: str
    message_id: str
    text: str
    reply_to: str | None
    parse_mode: str | None = None
    msg_type: str = "text"
    edits: list[str] = field(default_factory=list)


@dataclass
class Failure:
    """Answer `times` matching calls (-1: all) with `response` instead of handling them."""

    method: str
    response: Response
    times: int = 1
    when: Callable[[Call], bool] | None = None
    # After answering a 429, refuse the method until this moment (monotonic).
    block_seconds: float = 0.0


class FakeServer(ABC):
    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.messages: list[PlatformMessage] = []
        self.failures: list[Failure] = []
        # Files users sent (H3), by file id / key, for the download methods.
        self.files: dict[str, bytes] = {}
        self.early_calls = 0
        self.blocked_until: dict[str, float] = {}
        self._ids = itertools.count(1001)
        self.lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Any:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- reading what users see -------------------------------------------------------------
    def next_id(self) -> str:
        return str(next(self._ids))

    def add_file(self, data: bytes) -> str:
        """Keep `data` as a file users sent; its id/key for an update or event (H3)."""
        key = f"file-{self.next_id()}"
        with self.lock:
            self.files[key] = data
        return key

    def bot_messages(self, chat_id: str | None = None) -> list[PlatformMessage]:
        with self.lock:
            return [m for m in self.messages if chat_id is None or m.chat_id == chat_id]

    def calls_of(self, method: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.method == method]

    async def wait_for(self, predicate: Callable[[], Any], timeout: float = 15.0) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if loop.time() > deadline:
                raise AssertionError("the fake platform never saw what the test waited for")
            await asyncio.sleep(0.02)

    def fail(self, failure: Failure) -> None:
        with self.lock:
            self.failures.append(failure)

    # --- HTTP ------------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                verb, target, _version = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length", "0"))
                raw = await reader.readexactly(length) if length else b""
                parts = urlsplit(target)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                body = json.loads(raw) if raw else {}
                status, extra, payload = await self.dispatch(verb, parts.path, query, headers, body)
                # A file download (H3) answers its bytes; everything else JSON.
                raw_file = isinstance(payload, bytes)
                data = payload if raw_file else json.dumps(payload, ensure_ascii=False).encode()
                content_type = "application/octet-stream" if raw_file else "application/json"
                head_out = (
                    f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(data)}\r\n"
                    + "".join(f"{k}: {v}\r\n" for k, v in extra.items())
                    + "\r\n"
                )
                writer.write(head_out.encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def dispatch(
        self, verb: str, path: str, query: dict[str, str], headers: dict[str, str], body: Any
    ) -> Response:
        method = self.method_of(verb, path)
        call = Call(method, path, query, headers, body)
        with self.lock:
            self.calls.append(call)
            if time.monotonic() < self.blocked_until.get(method, 0):
                self.early_calls += 1
                return self.rate_limited(1)
            for failure in self.failures:
                if failure.method != method or failure.times == 0:
                    continue
                if failure.when is not None and not failure.when(call):
                    continue
                if failure.times > 0:
                    failure.times -= 1
                if failure.block_seconds:
                    self.blocked_until[method] = time.monotonic() + failure.block_seconds
                return failure.response
        return await self.route(method, call)

    @abstractmethod
    def method_of(self, verb: str, path: str) -> str: ...

    @abstractmethod
    def rate_limited(self, seconds: int) -> Response: ...

    @abstractmethod
    async def route(self, method: str, call: Call) -> Response: ...


class FakeTelegram(FakeServer):
    """The Bot API methods the adapter uses, with getUpdates long polling."""

    def __init__(self) -> None:
        super().__init__()
        self.updates: list[dict[str, Any]] = []
        self.commands: list[dict[str, Any]] = []
        self._update_ids = itertools.count(5000)

    def method_of(self, verb: str, path: str) -> str:
        return path.rsplit("/", 1)[-1]

    def rate_limited(self, seconds: int) -> Response:
        return (
            429,
            {},
            {
                "ok": False,
                "error_code": 429,
                "description": f"Too Many Requests: retry after {seconds}",
                "parameters": {"retry_after": seconds},
            },
        )

    @staticmethod
    def error(code: int, description: str) -> Response:
        return code, {}, {"ok": False, "error_code": code, "description": description}

    @staticmethod
    def ok(result: Any) -> Response:
        return 200, {}, {"ok": True, "result": result}

    async def route(self, method: str, call: Call) -> Response:
        if call.path.startswith(f"/file/bot{TELEGRAM_TOKEN}/"):
            # H3: a file's bytes, at the path getFile gave.
            data = self.files.get(call.path.rsplit("/", 1)[-1])
            return (200, {}, data) if data is not None else self.error(404, "Not Found")
        if not call.path.startswith(f"/bot{TELEGRAM_TOKEN}/"):
            return self.error(401, "Unauthorized")
        body = call.body
        if method == "getFile":
            data = self.files.get(str(body.get("file_id")))
            if data is None:
                return self.error(400, "Bad Request: invalid file_id")
            return self.ok(
                {
                    "file_id": body["file_id"],
                    "file_unique_id": "u" + body["file_id"],
                    "file_size": len(data),
                    "file_path": f"documents/{body['file_id']}",
                }
            )
        if method == "getMe":
            return self.ok({"id": BOT_ID, "is_bot": True, "username": BOT_USERNAME})
        if method == "setMyCommands":
            with self.lock:
                self.commands = list(body["commands"])
            return self.ok(True)
        if method == "sendMessage":
            reply = (body.get("reply_parameters") or {}).get("message_id")
            message = PlatformMessage(
                chat_id=str(body["chat_id"]),
                message_id=self.next_id(),
                text=body["text"],
                reply_to=str(reply) if reply is not None else None,
                parse_mode=body.get("parse_mode"),
            )
            if len(message.text) > 4096:
                return self.error(400, "Bad Request: message is too long")
            with self.lock:
                self.messages.append(message)
            return self.ok({"message_id": int(message.message_id), "text": message.text})
        if method == "editMessageText":
            with self.lock:
                found = [
                    m
                    for m in self.messages
                    if m.chat_id == str(body["chat_id"]) and m.message_id == str(body["message_id"])
                ]
                if not found:
                    return self.error(400, "Bad Request: message to edit not found")
                message = found[0]
                if len(body["text"]) > 4096:
                    return self.error(400, "Bad Request: message is too long")
                if body["text"] == message.text:
                    return self.error(400, "Bad Request: message is not modified")
                message.text = body["text"]
                message.parse_mode = body.get("parse_mode")
                message.edits.append(body["text"])
            return self.ok({"message_id": int(message.message_id)})
        if method == "getUpdates":
            offset = int(body.get("offset") or 0)
            deadline = time.monotonic() + min(float(body.get("timeout") or 0), 2.0)
            while True:
                with self.lock:
                    if offset:
                        # Telegram forgets updates below the offset (they are confirmed).
                        self.updates = [u for u in self.updates if u["update_id"] >= offset]
                    ready = list(self.updates)
                if ready or time.monotonic() >= deadline:
                    return self.ok(ready)
                await asyncio.sleep(0.02)
        return self.error(404, "Not Found: method not found")

    # --- building updates like Telegram's ---------------------------------------------------
    def update(
        self,
        text: str,
        *,
        chat_id: int = 42,
        user_id: int = 7,
        first_name: str = "Ann",
        group: bool = False,
        reply_to: str | None = None,
        reply_to_bot: bool = True,
        update_id: int | None = None,
        language_code: str = "en",
        photo: bytes | None = None,
        document: tuple[str, bytes] | None = None,
    ) -> dict[str, Any]:
        """`photo` / `document` (name, bytes): a message with that file and `text` as its
        caption, as Telegram sends them (H3)."""
        message: dict[str, Any] = {
            "message_id": int(self.next_id()),
            "date": int(time.time()),
            "chat": {"id": chat_id, "type": "supergroup" if group else "private"}
            | ({"title": "Team"} if group else {}),
            "from": {
                "id": user_id,
                "is_bot": False,
                "first_name": first_name,
                "language_code": language_code,
            },
            "text": text,
        }
        if photo is not None or document is not None:
            message["caption"] = message.pop("text")
        if photo is not None:
            key = self.add_file(photo)
            # Telegram lists the sizes it made, the largest last.
            message["photo"] = [
                {"file_id": "thumb-" + key, "width": 90, "height": 90, "file_size": 100},
                {"file_id": key, "width": 800, "height": 600, "file_size": len(photo)},
            ]
        if document is not None:
            name, data = document
            key = self.add_file(data)
            message["document"] = {"file_id": key, "file_name": name, "file_size": len(data)}
        if reply_to is not None:
            sender = {"id": BOT_ID, "is_bot": True} if reply_to_bot else {"id": 1, "is_bot": False}
            message["reply_to_message"] = {"message_id": int(reply_to), "from": sender}
        return {
            "update_id": update_id if update_id is not None else next(self._update_ids),
            "message": message,
        }

    def queue_update(self, update: dict[str, Any]) -> None:
        with self.lock:
            self.updates.append(update)


class FakeFeishu(FakeServer):
    """The Open API calls the adapter uses: tenant token, bot info, message create, reply and
    card update."""

    TOKEN = "t-tenant-token"

    def __init__(self) -> None:
        super().__init__()
        self.token_requests = 0

    def method_of(self, verb: str, path: str) -> str:
        if path.endswith("/tenant_access_token/internal"):
            return "token"
        if path.endswith("/bot/v3/info"):
            return "bot_info"
        if path.endswith("/reply"):
            return "reply"
        if "/resources/" in path:
            return "resource"
        if verb == "PATCH":
            return "update"
        return "create"

    def rate_limited(self, seconds: int) -> Response:
        return (
            429,
            {"x-ogw-ratelimit-reset": str(seconds)},
            {
                "code": 99991400,
                "msg": "request trigger frequency limit",
            },
        )

    @staticmethod
    def error(code: int, msg: str, status: int = 400) -> Response:
        return status, {}, {"code": code, "msg": msg}

    def _content(self, body: dict[str, Any]) -> str:
        content = json.loads(body["content"])
        if "text" in content:
            return str(content["text"])
        return str(content["elements"][0]["content"])

    async def route(self, method: str, call: Call) -> Response:
        body = call.body
        if method == "token":
            self.token_requests += 1
            if body.get("app_id") != FEISHU_APP_ID or body.get("app_secret") != FEISHU_APP_SECRET:
                return self.error(10014, "app secret invalid")
            return 200, {}, {"code": 0, "tenant_access_token": self.TOKEN, "expire": 7200}
        if call.headers.get("authorization") != f"Bearer {self.TOKEN}":
            return self.error(99991663, "invalid access token", status=401)
        if method == "bot_info":
            return 200, {}, {"code": 0, "msg": "ok", "bot": {"open_id": FEISHU_BOT_OPEN_ID}}
        if method == "resource":
            # H3: GET im/v1/messages/{message_id}/resources/{key}?type=image|file
            data = self.files.get(call.path.rsplit("/", 1)[-1])
            if data is None or call.query.get("type") not in ("image", "file"):
                return self.error(234003, "file not found", status=400)
            return 200, {}, data
        if method in ("create", "reply"):
            if method == "reply":
                parent_id = call.path.split("/")[-2]
                chat_id = self.chat_of.get(parent_id, "")
                if not chat_id:
                    return self.error(230011, "message not found")
                reply_to: str | None = parent_id
            else:
                chat_id, reply_to = body["receive_id"], None
            message = PlatformMessage(
                chat_id=chat_id,
                message_id="om_" + self.next_id(),
                text=self._content(body),
                reply_to=reply_to,
                msg_type=body["msg_type"],
            )
            with self.lock:
                self.messages.append(message)
                self.chat_of[message.message_id] = chat_id
            return 200, {}, {"code": 0, "data": {"message_id": message.message_id}}
        if method == "update":
            message_id = call.path.rsplit("/", 1)[-1]
            with self.lock:
                found = [m for m in self.messages if m.message_id == message_id]
                if not found:
                    return self.error(230011, "message not found")
                found[0].text = self._content(body)
                found[0].edits.append(found[0].text)
            return 200, {}, {"code": 0, "data": {}}
        return self.error(404, "not found", status=404)

    @property
    def chat_of(self) -> dict[str, str]:
        if not hasattr(self, "_chat_of"):
            self._chat_of: dict[str, str] = {}
        return self._chat_of

    def user_message(self, chat_id: str) -> str:
        """A message id for a user's message, known to the fake (replies may target it)."""
        message_id = "om_u" + self.next_id()
        with self.lock:
            self.chat_of[message_id] = chat_id
        return message_id
