"""The model provider (E5): an OpenAI-compatible streaming client over httpx, and the choice
of provider from settings (the demo provider, `demo_provider`, when no server is set).

Types are in `provider_types`, the meaning of server errors and limits in `provider_errors`;
raw bodies, URLs and keys go to the log only, scrubbed (C10).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from django.conf import settings

from chatcore.logging import scrub

from .demo_provider import DemoProvider
from .provider_errors import (
    LIMIT_PARAMS,
    AnswerLimitRejected,
    classify_http_error,
    limit_rejection,
)
from .provider_http import MalformedResponse
from .provider_net import provider_transport
from .provider_read import (
    BodyDecoder,
    EventLines,
    fitting,
    read_chunk,
    read_error_body,
    too_large,
)
from .provider_types import (
    ChatProvider,
    Completion,
    ProviderError,
    ProviderEvent,
    TextDelta,
    ToolCall,
    encode_body,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReadBounds:
    """How much of a model server's answer is read (F3, I3): one event line, the decoded
    stream, the start of an error body, and one answer's text and tool call bytes."""

    event_bytes: int = 1024 * 1024
    decoded_bytes: int = 64 * 1024 * 1024
    decode_ratio: int = 200
    error_body_bytes: int = 64 * 1024
    answer_bytes: int = 2 * 1024 * 1024

    @classmethod
    def from_settings(cls) -> ReadBounds:
        cfg = settings.LLM
        return cls(
            event_bytes=cfg["MAX_EVENT_BYTES"],
            decoded_bytes=cfg["MAX_DECODED_BYTES"],
            decode_ratio=cfg["MAX_DECODE_RATIO"],
            error_body_bytes=cfg["MAX_ERROR_BODY_BYTES"],
            answer_bytes=settings.CHAT["ANSWER_MAX_BYTES"],
        )


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A chat completion request made ahead (`OpenAIProvider.prepare_request`), with the
    payload it encodes and the answer limit's form it was made under."""

    request: httpx.Request
    payload: dict[str, Any]
    limits: tuple[str, int | None]


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
        bounds: ReadBounds | None = None,
    ) -> None:
        self.bounds = bounds or ReadBounds()
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
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=max_keepalive_connections
        )
        # F7: HTTP/1.1 over plain asyncio connections (`provider_net`), unless a test's
        # transport is given or the environment names a proxy.
        self._transport = transport or provider_transport(self.base_url, limits=limits)
        self._client = httpx.AsyncClient(
            transport=self._transport,
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout, pool=pool_timeout),
            limits=limits,
        )
        # The request's URL, headers and timeouts as the client makes them, made once
        # (`_post`): only the body changes from one request to the next.
        template = self._client.build_request(
            "POST", f"{self.base_url}/chat/completions", headers=self._headers()
        )
        del template.headers["Content-Length"]
        self._url, self._request_headers = template.url, template.headers
        self._extensions = template.extensions

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
            bounds=ReadBounds.from_settings(),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    def _headers(self) -> dict[str, str]:
        # Only the encodings `BodyDecoder` undoes within its bounds.
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "Accept-Encoding": "gzip, deflate",
        }
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def prepare_request(
        self,
        *,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        max_tokens: int | None = None,
        model: str | None = None,
    ) -> PreparedRequest:
        """The request `stream` would send for this input, made now, on any thread (a turn's
        first request is made where its input is built, off the event loop, F7); `stream`
        given it sends it as it is. `model`: the dialog's (H4), else this provider's."""
        payload = self._payload(messages, tools, max_tokens, model)
        return PreparedRequest(self._request(encode_body(payload)), payload, self._limits())

    async def stream(
        self,
        *,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        purpose: str = "turn",
        max_tokens: int | None = None,
        prepared: PreparedRequest | None = None,
        model: str | None = None,
    ) -> AsyncIterator[ProviderEvent]:
        """`prepared`: this input's request from `prepare_request`, sent as it is unless
        what the server taught this provider about the answer limit changed since.
        `model`: the dialog's (H4), else this provider's."""
        request = None
        if prepared is not None and prepared.limits == self._limits():
            payload, request = prepared.payload, prepared.request
        else:
            payload = self._payload(messages, tools, max_tokens, model)
        attempt = 0
        adjusted = False
        while True:
            started = False
            try:
                async for event in self._stream_once(payload, request):
                    started = True
                    yield event
                return
            except AnswerLimitRejected as exc:
                if adjusted:
                    raise exc.plain from exc
                adjusted = True
                self._learn_limit(payload, exc)
                request = None  # the payload changed
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

    def _payload(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        max_tokens: int | None,
        model: str | None = None,
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": model or self.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if tools:
            payload["tools"] = tools
        if max_tokens:
            # E5: a runaway answer ends with a `length` stop the user sees.
            self._set_limit(payload, max_tokens)
        return payload

    def _limits(self) -> tuple[str, int | None]:
        """What `_set_limit` goes by, as the server taught it (`_learn_limit`)."""
        return self.max_tokens_param, self._limit_ceiling

    def _set_limit(self, payload: dict[str, Any], max_tokens: int) -> None:
        for name in LIMIT_PARAMS:
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

    def _request(self, body: bytes) -> httpx.Request:
        """The chat completion request with `body`: what the client's `build_request` makes,
        without what it does not need on the way to every first token (the URL parsed and
        the headers merged anew: none changes from one request to the next)."""
        return httpx.Request(
            "POST",
            self._url,
            headers=self._request_headers,
            content=body,
            extensions=self._extensions,
        )

    @contextlib.asynccontextmanager
    async def _post(self, request: httpx.Request) -> AsyncIterator[httpx.Response]:
        """`request` sent by the client's own `send` (its auth, event hooks and, with a proxy
        from the environment, its proxy mount apply, I2), its response streamed."""
        response = await self._client.send(request, stream=True)
        try:
            yield response
        finally:
            await response.aclose()

    async def _refusal(
        self, resp: httpx.Response, decoder: BodyDecoder, payload: dict[str, Any]
    ) -> ProviderError:
        """What a response that is not a 2xx stream means. Only the start of its body is read
        (I3: the rest is discarded with its connection)."""
        raw = await read_error_body(resp.aiter_raw(), decoder, self.bounds.error_body_bytes)
        body = raw.decode("utf-8", "replace")
        status = resp.status_code
        logger.warning("model server HTTP %s: %s", status, scrub(body[:500]))
        if status < 200 or 300 <= status < 400:
            # A 101 or a redirect: no answer, and nothing a retry would change.
            return ProviderError(
                "bad_response", f"the model server answered HTTP {status}", status=status
            )
        param = next((p for p in LIMIT_PARAMS if p in payload), "")
        rejected = limit_rejection(status, body, param)
        return rejected if rejected is not None else classify_http_error(status, body)

    async def _stream_once(
        self, payload: dict[str, Any], request: httpx.Request | None = None
    ) -> AsyncIterator[ProviderEvent]:
        """One request of `payload` (made ahead: `request`), its answer as events."""
        text_parts: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        usage: dict[str, Any] = {}
        finish_reason = ""
        if request is None:
            request = self._request(encode_body(payload))
        bounds = self.bounds
        answer_bytes = 0
        try:
            async with self._post(request) as resp:
                decoder = BodyDecoder(
                    resp.headers.get("content-encoding", ""),
                    max_bytes=bounds.decoded_bytes,
                    max_ratio=bounds.decode_ratio,
                )
                if not 200 <= resp.status_code < 300:
                    raise await self._refusal(resp, decoder, payload)
                # Read the stream to its end, also past [DONE] (STYLE 6). The bytes are
                # split into lines here (`EventLines`, each byte once, one line bounded), not
                # by httpx's text and line decoders: this runs for every delta of every
                # answer, on the loop all sockets share (F7). The text deltas of one read go
                # out as one (the snapshot is the same, one hop less).
                lines = EventLines(bounds.event_bytes)
                first = True
                async for raw in resp.aiter_raw():
                    for data in decoder.decode(raw):
                        pieces: list[str] = []
                        error: ProviderError | None = None
                        for event in lines.feed(data):
                            piece = ""
                            try:
                                piece, usage, finish_reason, size = read_chunk(
                                    event, calls, usage, finish_reason
                                )
                                if answer_bytes + size > bounds.answer_bytes:
                                    # F3: the answer keeps what fits, and the turn ends.
                                    piece = fitting(piece, bounds.answer_bytes - answer_bytes)
                                    error = too_large(bounds.answer_bytes)
                                answer_bytes += size
                            except ProviderError as exc:
                                error = exc
                            if piece and first:
                                # D1: the answer's first piece goes out alone, as soon as it
                                # is parsed: not after the rest of its read (a model server
                                # that sends its answer in one burst), and its first frame is
                                # its first token.
                                first = False
                                text_parts.append(piece)
                                yield TextDelta(piece)
                            elif piece:
                                pieces.append(piece)
                            if error is not None:
                                break
                        if pieces:
                            text = pieces[0] if len(pieces) == 1 else "".join(pieces)
                            text_parts.append(text)
                            # Also before an error of the same read: the partial keeps it.
                            yield TextDelta(text)
                        if error is not None:
                            raise error
                for event in lines.finish():
                    piece, usage, finish_reason, size = read_chunk(
                        event, calls, usage, finish_reason
                    )
                    if answer_bytes + size > bounds.answer_bytes:
                        piece = fitting(piece, bounds.answer_bytes - answer_bytes)
                        if piece:
                            text_parts.append(piece)
                            yield TextDelta(piece)
                        raise too_large(bounds.answer_bytes)
                    answer_bytes += size
                    if piece:
                        text_parts.append(piece)
                        yield TextDelta(piece)
        except httpx.TimeoutException as exc:
            raise ProviderError("timeout", "the model server timed out") from exc
        except httpx.LocalProtocolError as exc:
            # A request the transport refused to send (a header with CR or LF, from the
            # settings): a retry would send the same.
            logger.warning("model request refused: %s", scrub(str(exc)))
            raise ProviderError("bad_request", "the model request is malformed") from exc
        except MalformedResponse as exc:
            # I3: bytes that are not HTTP/1.1 would be the same on a retry.
            logger.warning("model server sent a malformed response: %s", scrub(str(exc)))
            raise ProviderError("bad_response", "the model server sent a malformed answer") from exc
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


def provider_from_settings() -> ChatProvider:
    if settings.LLM["BASE_URL"]:
        return OpenAIProvider.from_settings()
    return DemoProvider()
