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
    server, timeout, connection, bad_request, bad_response, content_filter."""

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
        max_tokens: int | None = None,
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


# E5: error codes and types that OpenAI-compatible servers and gateways put in an SSE `error`
# chunk, mapped to the HTTP status they stand for, so both paths classify alike.
_STREAM_ERROR_CODES: dict[str, int] = {
    "rate_limit_exceeded": 429,
    "rate_limit_error": 429,
    "ratelimiterror": 429,
    "insufficient_quota": 429,
    "too_many_requests": 429,
    "throttling_error": 429,
    "invalid_api_key": 401,
    "authentication_error": 401,
    "authenticationerror": 401,
    "permission_denied": 403,
    "permission_error": 403,
    "server_error": 500,
    "internal_server_error": 500,
    "internalservererror": 500,
    "api_error": 500,
    "apierror": 500,
    "service_unavailable": 503,
    "serviceunavailableerror": 503,
    "overloaded_error": 503,
    "overloaded": 503,
    "timeout": 504,
    "timeout_error": 504,
    "invalid_request_error": 400,
    "badrequesterror": 400,
    "not_found_error": 404,
}
_CONTENT_FILTER = re.compile(r"content[_ ]?(filter|policy|management)", re.IGNORECASE)


def classify_stream_error(chunk: dict[str, Any]) -> ProviderError:
    """Map an SSE `error` chunk (an error after the HTTP 200) to a typed error by its own
    code, like an HTTP error (E5). The chunk is logged scrubbed: it may echo credentials."""
    logger.warning("model server sent an error mid-stream: %s", scrub(json.dumps(chunk)[:1000]))
    err = chunk.get("error")
    if not isinstance(err, dict):
        err = {"message": str(err)}
    keys = [str(err.get(k) or "") for k in ("code", "type", "status")]
    if any(_CONTENT_FILTER.search(k) for k in keys):
        return ProviderError("content_filter", "the model server's content filter stopped it")
    status = 0
    for key in keys:
        if key.isdigit() and 400 <= int(key) <= 599:
            status = int(key)
            break
        mapped = _STREAM_ERROR_CODES.get(key.lower().replace(".", "_").replace("-", "_"))
        if mapped:
            status = mapped
            break
    if status == 504:
        return ProviderError("timeout", "the model server timed out", status=status)
    # An error without a known code is the server failing mid-answer.
    return classify_http_error(status or 500, json.dumps({"error": err}))


ANSWER_TOKEN_MARGIN = 16
MIN_ANSWER_TOKENS = 64


def answer_token_limit(*, context_window: int, input_tokens: int, configured: int = 0) -> int:
    """E5: the `max_tokens` of a turn request: what the window leaves after the input, capped
    by the configured limit (0 = the window alone), never below a small floor so an input
    near the window still gets a short answer (a cut one the user can see and continue)."""
    # The input is an estimate: keep a quarter of it spare, so an undercount does not make
    # input + limit exceed the window (servers such as vLLM refuse that).
    room = context_window - input_tokens - max(ANSWER_TOKEN_MARGIN, input_tokens // 4)
    limit = min(room, configured) if configured > 0 else room
    return max(limit, MIN_ANSWER_TOKENS)


_LIMIT_PARAMS = ("max_tokens", "max_completion_tokens")
_AT_MOST = re.compile(r"at most (\d+)(?: completion| output)? tokens", re.IGNORECASE)
# vLLM-style: "maximum context length is 4096 tokens. However, you requested 5000 tokens (1000
# in the messages, 4000 in the completion)": the input fits, the limit does not.
_WINDOW_SPLIT = re.compile(
    r"maximum context length is (\d+) tokens.*?(\d+) in the messages, (\d+) in the completion",
    re.IGNORECASE | re.DOTALL,
)


class AnswerLimitRejected(ProviderError):
    """E5: the server refused the answer token limit itself (too large for the model, or the
    other field name wanted); the provider adjusts it once and sends the request again."""

    def __init__(self, body: str, *, status: int, fits: int = 0) -> None:
        super().__init__(
            "bad_request", "the model server rejected the answer token limit", status=status
        )
        # For this request only: the limit that fits the window beside this input.
        self.fits = fits
        # What the error is when adjusting the limit did not help.
        self.plain = classify_http_error(status, body)
        found = _AT_MOST.search(body)
        self.ceiling = int(found.group(1)) if found else 0
        self.wants = next(
            (p for p in _LIMIT_PARAMS if f"use '{p}'" in body.lower() or f'use "{p}"' in body),
            "",
        )


def limit_rejection(status: int, body: str, param: str) -> AnswerLimitRejected | None:
    """E5: whether a 400 refuses the answer token limit rather than the input."""
    if status != 400 or not param:
        return None
    split = _WINDOW_SPLIT.search(body)
    if split:
        fits = int(split.group(1)) - int(split.group(2)) - ANSWER_TOKEN_MARGIN
        # A window too small for the input alone is a real overflow (C7).
        return AnswerLimitRejected(body, status=status, fits=fits) if fits > 0 else None
    if param in body and not _OVERFLOW.search(body):
        return AnswerLimitRejected(body, status=status)
    return None


def merge_usage(total: dict[str, Any], usage: dict[str, Any] | None) -> dict[str, Any]:
    """Add one response's usage into a running total, keeping nested details
    (`completion_tokens_details`, `prompt_tokens_details.cached_tokens`)."""
    for key, value in (usage or {}).items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            total[key] = total.get(key, 0) + value
        elif isinstance(value, dict):
            inner = total.get(key)
            total[key] = merge_usage(inner if isinstance(inner, dict) else {}, value)
    return total


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
        max_tokens_param: str = "max_tokens",
        max_keepalive_connections: int = 10,
        pool_timeout: float = 5.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_tokens_param = max_tokens_param
        # E5: what the server taught us about the answer token limit (its largest value; 0 =
        # the server accepts no limit field at all).
        self._limit_ceiling: int | None = None
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
            max_tokens_param=cfg["MAX_TOKENS_PARAM"],
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
        max_tokens: int | None = None,
    ) -> AsyncIterator[ProviderEvent]:
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if tools:
            payload["tools"] = tools
        if max_tokens:
            # E5: a runaway answer ends with a `length` stop the user sees.
            self._set_limit(payload, max_tokens)
        attempt = 0
        adjusted = False
        while True:
            started = False
            try:
                async for event in self._stream_once(payload):
                    started = True
                    yield event
                return
            except AnswerLimitRejected as exc:
                if adjusted:
                    raise exc.plain from exc
                adjusted = True
                self._learn_limit(payload, exc)
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

    def _set_limit(self, payload: dict[str, Any], max_tokens: int) -> None:
        for name in _LIMIT_PARAMS:
            payload.pop(name, None)
        if self._limit_ceiling == 0:
            return
        if self._limit_ceiling:
            max_tokens = min(max_tokens, self._limit_ceiling)
        payload[self.max_tokens_param] = max_tokens

    def _learn_limit(self, payload: dict[str, Any], exc: AnswerLimitRejected) -> None:
        """Adjust the limit the server refused and remember it for later requests."""
        sent = int(payload.get(self.max_tokens_param) or 0)
        if exc.fits:
            payload[self.max_tokens_param] = min(sent, exc.fits) if sent else exc.fits
            logger.warning("the answer token limit did not fit the window; sent %d", exc.fits)
            return
        if exc.wants and exc.wants != self.max_tokens_param:
            self.max_tokens_param = exc.wants
        elif exc.ceiling and exc.ceiling < sent:
            self._limit_ceiling = exc.ceiling
        else:
            self._limit_ceiling = 0
        logger.warning(
            "the model server refused the answer token limit; sending %s instead "
            "(set LLM_MAX_TOKENS / LLM_MAX_TOKENS_PARAM to match the model)",
            f"{self.max_tokens_param}={self._limit_ceiling or sent}"
            if self._limit_ceiling != 0
            else "no limit",
        )
        self._set_limit(payload, sent)

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
                    param = next((p for p in _LIMIT_PARAMS if p in payload), "")
                    rejected = limit_rejection(resp.status_code, body, param)
                    if rejected is not None:
                        raise rejected
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
                        raise classify_stream_error(chunk)
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
        max_tokens: int | None = None,
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
