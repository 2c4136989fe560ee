"""The model client's transport (E5, F7, I1): HTTP/1.1 on plain asyncio connections, under
httpx's client (requests, responses, timeouts, errors, event hooks and auth stay httpx's).

It stays by what it measured beside the libraries that would replace it, in the same runs
(`bench/notes/http-transport.md`): httpx's default transport (httpcore, h11) costs 70% more
first-token time and 80% more CPU per turn and misses the guardrail; beside httpx-aiohttp
this one is 26-39% lower on a figure of each run, and that one does not keep httpx's errors.
`MEASURED_AGAINST` names the versions; a test fails when a new release line of one comes,
to measure again. The framing rules (h11's, stricter where RFC 9112 asks) are in
`provider_http`. What it does its own way:

- a connection is an `asyncio.Protocol`: a read takes what arrived, and the read timeout is
  one timer per connection, moved on lazily; reading pauses past `HIGH_WATER` unread bytes;
- what arrived is parsed in one pass per read: the events of one read go up as one piece;
- no cap on connections (F7), a small keep-alive pool; a connection that the server ended,
  or that was not read to its end, is never reused.

A proxy from the environment keeps httpx's default transport (`provider_transport`).
"""

from __future__ import annotations

import asyncio
import ssl
import time
import urllib.request
from collections import deque
from collections.abc import AsyncIterator
from typing import cast

import httpx

from .provider_http import (
    MAX_HEAD,
    ChunkedDecoder,
    MalformedResponse,
    body_framing,
    parse_head,
    request_body,
    request_head,
)

# The versions of the libraries this transport was measured beside (I1).
MEASURED_AGAINST = {"httpx": "0.29.0", "httpcore": "1.0.9", "h11": "0.16.0"}
# The most one read hands on: what one loop step parses at most (F7), as httpcore read.
READ_BYTES = 64 * 1024
# Unread bytes past which the socket's reading pauses until the stream's reader catches up.
HIGH_WATER = 256 * 1024


class _Protocol(asyncio.Protocol):
    """One connection's receiving end: a buffer of what arrived, one reader at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.eof = False
        self.error: BaseException | None = None
        self.paused_reading = False
        self._reader: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        # The waiting read's deadline (loop time), and the one timer that enforces it: when it
        # fires early (the deadline moved on since it was set) it sets itself again.
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport: asyncio's, or another loop's with the same methods (uvloop's
        # subclass nothing of asyncio's).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > HIGH_WATER and not self.paused_reading and self.transport is not None:
            self.paused_reading = True
            self.transport.pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake_reader()
        return False  # close the transport: the server is done sending

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        if exc is not None:
            self.error = exc
        self._wake_reader()
        self._wake_writer()
        self.cancel_timer()

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        self._wake_writer()

    # -- for the stream ------------------------------------------------------------------------

    def take(self, max_bytes: int) -> bytes:
        """Up to `max_bytes` of what arrived (at least one byte: the caller checked)."""
        data = self.chunks.popleft()
        if len(data) > max_bytes:
            self.chunks.appendleft(data[max_bytes:])
            data = data[:max_bytes]
        elif self.chunks and len(data) < max_bytes:
            parts = [data]
            size = len(data)
            while self.chunks and size + len(self.chunks[0]) <= max_bytes:
                part = self.chunks.popleft()
                parts.append(part)
                size += len(part)
            data = b"".join(parts)
        self.buffered -= len(data)
        if self.paused_reading and self.buffered <= HIGH_WATER // 4 and self.transport is not None:
            self.paused_reading = False
            self.transport.resume_reading()
        return data

    async def wait_readable(self, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        waiter = self._reader = loop.create_future()
        if timeout is None:
            self._deadline = float("inf")
        else:
            self._deadline = loop.time() + timeout
            if self._timer is None:
                self._timer = loop.call_at(self._deadline, self._check_deadline)
        try:
            await waiter
        finally:
            self._reader = None

    def _check_deadline(self) -> None:
        self._timer = None
        waiter = self._reader
        if waiter is None or waiter.done():
            return  # no read waiting: the next one sets a timer again
        loop = waiter.get_loop()
        if loop.time() >= self._deadline:
            waiter.set_exception(TimeoutError())
        elif self._deadline != float("inf"):
            self._timer = loop.call_at(self._deadline, self._check_deadline)

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def wait_writable(self, timeout: float | None) -> None:
        waiter = self._writable
        if waiter is None or waiter.done():
            return
        loop = asyncio.get_running_loop()
        timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
        try:
            # Shielded: several writers may wait on the one future; a cancelled writer must
            # not cancel it for the others.
            await asyncio.shield(waiter)
        finally:
            if timer is not None:
                timer.cancel()

    def _wake_reader(self) -> None:
        waiter = self._reader
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_writer(self) -> None:
        waiter = self._writable
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


Origin = tuple[str, str, int]  # scheme, host, port


class _Connection:
    """One HTTP/1.1 connection to the model server: what arrived waits in its `_Protocol`."""

    def __init__(self, origin: Origin, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self.origin = origin
        self.transport = transport
        self.protocol = protocol
        self.idle_since = 0.0

    def usable(self) -> bool:
        """An idle kept-alive connection the server has not ended (nothing to read, not
        closed): one it did end is dropped instead of sent on."""
        protocol = self.protocol
        return not (
            protocol.chunks or protocol.eof or protocol.error or self.transport.is_closing()
        )

    async def read(self, timeout: float | None, request: httpx.Request) -> bytes:
        """What arrived (waiting up to `timeout` for something), or b"" at the end."""
        protocol = self.protocol
        if not protocol.chunks:
            if protocol.error is not None:
                raise httpx.ReadError(str(protocol.error) or "connection lost", request=request)
            if protocol.eof:
                return b""
            try:
                await protocol.wait_readable(timeout)
            except TimeoutError as exc:
                raise httpx.ReadTimeout(
                    "timed out reading from the model server", request=request
                ) from exc
            if not protocol.chunks:
                if protocol.error is not None:
                    raise httpx.ReadError(str(protocol.error) or "connection lost", request=request)
                return b""
        return protocol.take(READ_BYTES)

    async def write(self, data: bytes, timeout: float | None, request: httpx.Request) -> None:
        if self.transport.is_closing() or self.protocol.error is not None:
            raise httpx.WriteError("the connection to the model server is closed", request=request)
        self.transport.write(data)
        try:
            await self.protocol.wait_writable(timeout)
        except TimeoutError as exc:
            raise httpx.WriteTimeout(
                "timed out writing to the model server", request=request
            ) from exc
        if self.protocol.error is not None:
            raise httpx.WriteError(str(self.protocol.error), request=request)

    def close(self) -> None:
        self.protocol.cancel_timer()
        self.transport.close()


class _Body(httpx.AsyncByteStream):
    """A response's body as it arrives: by Content-Length, chunked, or up to the close. The
    connection goes back to the pool once the body was read whole and the server keeps it."""

    def __init__(
        self,
        owner: ModelTransport,
        conn: _Connection,
        request: httpx.Request,
        *,
        first: bytes,
        length: int | None,
        chunked: bool,
        keep: bool,
        timeout: float | None,
    ) -> None:
        self._owner = owner
        self._conn: _Connection | None = conn
        self._request = request
        self._first = first
        self._length = length
        self._decoder = ChunkedDecoder() if chunked else None
        self._keep = keep and (chunked or length is not None)
        self._timeout = timeout
        self._whole = length == 0 and not chunked

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None or self._whole:
            return
        decoder, left = self._decoder, self._length
        data, self._first = self._first, b""
        while True:
            if not data:
                data = await conn.read(self._timeout, self._request)
                if not data:
                    if decoder is None and left is None:
                        self._whole = True  # a body delimited by the close: this is its end
                        return
                    raise httpx.RemoteProtocolError(
                        "the model server closed the connection before the answer's end",
                        request=self._request,
                    )
            if decoder is not None:
                out = decoder.feed(data)
                if decoder.done:
                    self._whole = True
                    self._keep = self._keep and not decoder.leftover
                if out:
                    yield out
                if self._whole:
                    return
            elif left is not None:
                if len(data) > left:
                    self._keep = False  # more than the server said it would send
                    data = data[:left]
                left -= len(data)
                self._whole = left == 0
                yield data
                if self._whole:
                    return
            else:
                yield data
            data = b""

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._whole and self._keep:
            self._owner._release(conn)
        else:
            conn.close()


class ModelTransport(httpx.AsyncBaseTransport):
    """httpx's transport for the model server: HTTP/1.1 on plain asyncio connections, with a
    small keep-alive pool and no cap on connections (F7). A response's bytes are parsed here
    in one pass per read, not event by event: under load several of a stream's events wait
    in one read, and one loop step carries them all."""

    def __init__(self, *, limits: httpx.Limits, verify: ssl.SSLContext | bool = True) -> None:
        self._ssl = httpx.create_ssl_context(verify=verify)
        self._max_idle = (
            limits.max_keepalive_connections
            if limits.max_keepalive_connections is not None
            else 1 << 30
        )
        self._expiry = limits.keepalive_expiry if limits.keepalive_expiry is not None else 5.0
        self._idle: dict[Origin, deque[_Connection]] = {}
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        url = request.url
        origin = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        conn = self._take_idle(origin) or await self._connect(
            origin, timeouts.get("connect"), request
        )
        try:
            await conn.write(
                request_head(request) + await request_body(request),
                timeouts.get("write"),
                request,
            )
            return await self._response(conn, request, timeouts.get("read"))
        except BaseException:
            conn.close()
            raise

    async def _response(
        self, conn: _Connection, request: httpx.Request, timeout: float | None
    ) -> httpx.Response:
        buffer = bytearray()  # grown in place: a head that trickles in is copied once
        searched = 0  # the head's end is looked for in each byte once, not once per read
        consumed = 0  # head bytes of this response, the informational ones before it included
        while True:
            end = buffer.find(b"\r\n\r\n", max(0, searched - 3))
            if end < 0 or consumed + end > MAX_HEAD:
                if consumed + len(buffer) > MAX_HEAD:
                    raise MalformedResponse(
                        "the model server's response head is too long", request=request
                    )
                searched = len(buffer)
                data = await conn.read(timeout, request)
                if not data:
                    raise httpx.RemoteProtocolError(
                        "the model server closed the connection without a response",
                        request=request,
                    )
                buffer += data
                continue
            version, status, reason, headers = parse_head(bytes(buffer[:end]), request)
            consumed += end + 4
            del buffer[: end + 4]
            searched = 0
            if 100 <= status < 200 and status != 101:
                continue  # an informational response: the real one follows
            break
        length, chunked, keep = body_framing(request.method, status, version, headers)
        body = _Body(
            self,
            conn,
            request,
            first=bytes(buffer),
            length=length,
            chunked=chunked,
            keep=keep,
            timeout=timeout,
        )
        return httpx.Response(
            status,
            headers=headers,
            stream=body,
            extensions={"http_version": version, "reason_phrase": reason},
        )

    def _take_idle(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable() and now - conn.idle_since < self._expiry:
                return conn
            conn.close()
        return None

    def _release(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.origin, deque())
        if self._closed or len(idle) >= self._max_idle or not conn.usable():
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _connect(
        self, origin: Origin, timeout: float | None, request: httpx.Request
    ) -> _Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = self._ssl if scheme == "https" else None
        try:
            transport, protocol = await asyncio.wait_for(
                loop.create_connection(
                    _Protocol, host, port, ssl=tls, server_hostname=host if tls else None
                ),
                timeout,
            )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(
                "timed out connecting to the model server", request=request
            ) from exc
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        return _Connection(origin, cast(asyncio.Transport, transport), protocol)

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()


def environment_proxy(url: str) -> bool:
    """Whether the environment routes `url` through a proxy (then httpx's default transport,
    which reads and honours it, is used)."""
    proxies = urllib.request.getproxies()
    if not proxies:
        return False
    host = httpx.URL(url).host
    if urllib.request.proxy_bypass(host):
        return False
    scheme = httpx.URL(url).scheme
    return bool(proxies.get(scheme) or proxies.get("all"))


def provider_transport(
    base_url: str, *, limits: httpx.Limits, verify: ssl.SSLContext | bool = True
) -> httpx.AsyncBaseTransport | None:
    """The transport for the model client: ours, unless a proxy is configured (None: httpx's
    default transport with its proxy mounts)."""
    if environment_proxy(base_url):
        return None
    return ModelTransport(limits=limits, verify=verify)
