"""Model providers (E5): an OpenAI-compatible streaming client over httpx, and a demo
provider for machines with no model server configured.

A provider yields `TextDelta`s as tokens arrive and ends with one `Completion` (assembled
tool calls, usage, finish reason). Errors are `ProviderError`s with a typed kind and a safe
message; raw bodies, URLs and keys go to the log only, scrubbed (C10).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import httpx
from django.conf import settings

from chatcore.logging import scrub

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class TextDelta:
    text: str


@dataclass(slots=True)
class Completion:
    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    finish_reason: str = ""


ProviderEvent = TextDelta | Completion


class ProviderError(Exception):
    """A typed provider failure. `kind` is one of: context_overflow, auth, rate_limited,
    server, timeout, connection, bad_request, bad_response."""

    def __init__(self, kind: str, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status

    @property
    def retryable(self) -> bool:
        return self.kind in {"rate_limited", "server", "timeout", "connection"}


class ChatProvider(Protocol):
    name: str

    def stream(
        self,
        *,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        purpose: str = "turn",
    ) -> AsyncIterator[ProviderEvent]: ...

    async def aclose(self) -> None: ...


async def complete_text(
    provider: ChatProvider, messages: list[dict[str, Any]], *, purpose: str
) -> str:
    """Run a tool-less request to its end and return the text (titles, summaries)."""
    text = ""
    async for event in provider.stream(messages=messages, tools=None, purpose=purpose):
        if isinstance(event, Completion):
            text = event.text
    return text


_OVERFLOW = re.compile(
    r"context[_ ]length|maximum context|context window|too many tokens|prompt is too long"
    r"|reduce the length|exceeds the context",
    re.IGNORECASE,
)


def classify_http_error(status: int, body: str) -> ProviderError:
    """Map an HTTP error from the model server to a typed error (E5)."""
    code = ""
    detail = ""
    try:
        data = json.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else {}
        if isinstance(err, dict):
            code = str(err.get("code") or err.get("type") or "")
            detail = str(err.get("message") or "")
        elif isinstance(err, str):
            detail = err
    except (ValueError, AttributeError):
        detail = body[:500]
    if _OVERFLOW.search(code) or _OVERFLOW.search(detail):
        return ProviderError(
            "context_overflow", "the conversation is too long for the model", status=status
        )
    if status in (401, 403):
        return ProviderError("auth", "the model server refused the credentials", status=status)
    if status == 429:
        return ProviderError("rate_limited", "the model server is rate limiting", status=status)
    if status >= 500:
        return ProviderError("server", f"the model server failed (HTTP {status})", status=status)
    return ProviderError(
        "bad_request", f"the model server rejected the request (HTTP {status})", status=status
    )


class OpenAIProvider:
    """`POST {base_url}/chat/completions` with `stream: true` (PROTOCOL "Environment")."""

    name = "openai"

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str = "",
        model: str,
        transport: httpx.AsyncBaseTransport | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
        max_retries: int = 3,
        retry_base_delay: float = 0.5,
        max_keepalive_connections: int = 10,
        pool_timeout: float = 5.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._api_key = api_key
        self.max_retries = max_retries
        self.retry_base_delay = retry_base_delay
        # STYLE 6, F7: never cap concurrent connections (a streamed answer holds its
        # connection for its whole length; the engine bounds model calls where it is visible),
        # keep the keep-alive pool small (httpcore scans it linearly under bursts), and wait
        # only briefly for a pooled connection.
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout, pool=pool_timeout),
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=max_keepalive_connections
            ),
        )

    @classmethod
    def from_settings(cls, transport: httpx.AsyncBaseTransport | None = None) -> OpenAIProvider:
        cfg = settings.LLM
        return cls(
            base_url=cfg["BASE_URL"],
            api_key=cfg["API_KEY"],
            model=cfg["MODEL"],
            transport=transport,
            connect_timeout=cfg["CONNECT_TIMEOUT"],
            read_timeout=cfg["READ_TIMEOUT"],
            max_retries=cfg["MAX_RETRIES"],
            retry_base_delay=cfg["RETRY_BASE_DELAY"],
            max_keepalive_connections=cfg["MAX_KEEPALIVE_CONNECTIONS"],
            pool_timeout=cfg["POOL_TIMEOUT"],
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    async def stream(
        self,
        *,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        purpose: str = "turn",
    ) -> AsyncIterator[ProviderEvent]:
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if tools:
            payload["tools"] = tools
        attempt = 0
        while True:
            started = False
            try:
                async for event in self._stream_once(payload):
                    started = True
                    yield event
                return
            except ProviderError as exc:
                # E5: retry 429/5xx and transport errors, but only before the first token.
                if started or not exc.retryable or attempt >= self.max_retries:
                    raise
                attempt += 1
                delay = self.retry_base_delay * (2 ** (attempt - 1)) * (1 + random.random() / 4)  # noqa: S311
                logger.warning(
                    "model request failed (%s), retry %d in %.2fs", exc.kind, attempt, delay
                )
                await asyncio.sleep(delay)

    async def _stream_once(self, payload: dict[str, Any]) -> AsyncIterator[ProviderEvent]:
        url = f"{self.base_url}/chat/completions"
        text_parts: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        usage: dict[str, Any] = {}
        finish_reason = ""
        try:
            async with self._client.stream(
                "POST", url, json=payload, headers=self._headers()
            ) as resp:
                if resp.status_code >= 400:
                    body = (await resp.aread()).decode("utf-8", "replace")
                    logger.warning("model server HTTP %s: %s", resp.status_code, scrub(body[:500]))
                    raise classify_http_error(resp.status_code, body)
                # Read the stream to its end, also past [DONE] (STYLE 6).
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if not data or data == "[DONE]":
                        continue
                    try:
                        chunk = json.loads(data)
                    except ValueError as exc:
                        raise ProviderError(
                            "bad_response", "the model server sent malformed data"
                        ) from exc
                    if chunk.get("error"):
                        raise classify_http_error(500, json.dumps(chunk))
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") or {}
                        piece = delta.get("content")
                        if piece:
                            text_parts.append(piece)
                            yield TextDelta(piece)
                        for tc in delta.get("tool_calls") or []:
                            slot = calls.setdefault(
                                int(tc.get("index", 0)), {"id": "", "name": "", "arguments": ""}
                            )
                            if tc.get("id"):
                                slot["id"] = tc["id"]
                            fn = tc.get("function") or {}
                            if fn.get("name"):
                                slot["name"] += fn["name"]
                            if fn.get("arguments"):
                                slot["arguments"] += fn["arguments"]
                        if choice.get("finish_reason"):
                            finish_reason = choice["finish_reason"]
        except httpx.TimeoutException as exc:
            raise ProviderError("timeout", "the model server timed out") from exc
        except httpx.TransportError as exc:
            logger.warning("model server connection failed: %s", scrub(str(exc)))
            raise ProviderError("connection", "could not reach the model server") from exc
        tool_calls = [
            ToolCall(
                id=slot["id"] or f"call_{i}", name=slot["name"], arguments=slot["arguments"] or "{}"
            )
            for i, slot in sorted(calls.items())
            if slot["name"]
        ]
        yield Completion(
            text="".join(text_parts),
            tool_calls=tool_calls,
            usage=usage,
            finish_reason=finish_reason,
        )


class DemoProvider:
    """Answers without a model server so a newcomer sees the whole flow: it calls the
    `current_time` tool once per turn, then streams a reply that says it is a demo."""

    name = "demo"

    def __init__(self, *, word_delay: float = 0.03) -> None:
        self.word_delay = word_delay

    async def aclose(self) -> None:
        return None

    async def stream(
        self,
        *,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        purpose: str = "turn",
    ) -> AsyncIterator[ProviderEvent]:
        users = [m for m in messages if m.get("role") == "user"]
        last_user = _strip_runtime(str(users[-1]["content"])) if users else ""
        if purpose == "title":
            words = _strip_runtime(_transcript_first_user(messages)).split()
            yield Completion(text=" ".join(words[:5]) or "Demo dialog")
            return
        if purpose == "summary":
            yield Completion(text="[demo summary] " + last_user[:400])
            return
        tool_names = {t["function"]["name"] for t in tools or []}
        last = messages[-1] if messages else {}
        if "current_time" in tool_names and last.get("role") == "user":
            yield Completion(
                text="",
                tool_calls=[ToolCall("demo_call_1", "current_time", "{}")],
                finish_reason="tool_calls",
            )
            return
        now = next((m["content"] for m in reversed(messages) if m.get("role") == "tool"), "")
        reply = (
            "[demo provider] No model server is configured (set LLM_BASE_URL to use a real model). "
            f"You said: \u201c{last_user[:500]}\u201d. "
            + (
                f"I asked the current_time tool: {now}."
                if now
                else f"It is {datetime.now(UTC):%H:%M} UTC."
            )
        )
        parts = re.findall(r"\S+\s*", reply)
        for part in parts:
            await asyncio.sleep(self.word_delay)
            yield TextDelta(part)
        yield Completion(text=reply, finish_reason="stop")


def _strip_runtime(text: str) -> str:
    return text.split("\n\n[runtime context]", 1)[0]


def _transcript_first_user(messages: list[dict[str, Any]]) -> str:
    for m in messages:
        if m.get("role") == "user":
            content = str(m["content"])
            for line in content.splitlines():
                if line.lower().startswith("user:"):
                    return line[5:].strip()
            return content
    return ""


def provider_from_settings() -> ChatProvider:
    if settings.LLM["BASE_URL"]:
        return OpenAIProvider.from_settings()
    return DemoProvider()
