"""The model client's network layer (E5, F7): httpcore's connections on plain asyncio.

httpx reads a streamed answer through httpcore, whose default network backend on asyncio is
anyio: every read of every stream enters a cancel scope for its timeout, asks sniffio which
event loop runs, and pauses and resumes the socket's reader. With a hundred answers streaming
at once that was the largest item on the event loop, which every socket, snapshot and lease
of the process shares. This backend keeps httpx and httpcore (HTTP/1.1 parsing, the pool,
TLS, timeouts, errors) and gives them a stream built on an `asyncio.Protocol`: bytes the
kernel delivered wait in a buffer, a read takes what is there without a scheduling round
trip, and the read timeout is one timer per connection, moved on lazily (not one timer per
read, made and cancelled thousands of times a second). Flow control holds: reading pauses
past `HIGH_WATER` bytes unread and resumes once the reader caught up; a write waits while the
kernel's buffer is full.

The pool is the transport's own (`ModelTransport`), with the limits it was given: no cap on
connections (F7: the engine bounds model calls where users see it), a small keep-alive pool.
A proxy from the environment (`HTTPS_PROXY` and the like) keeps httpx's default transport,
which knows how to use it (`provider_transport`).
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.request
from collections import deque
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx
from httpcore import AsyncNetworkBackend, AsyncNetworkStream

# Unread bytes past which the socket's reading pauses until the stream's reader catches up.
HIGH_WATER = 256 * 1024

SocketOption = Any  # httpcore's SOCKET_OPTION: (level, name, value) or (level, name, None, len)


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
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

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


class AsyncioStream(AsyncNetworkStream):
    """httpcore's view of one connection (`read`, `write`, `start_tls`, `aclose`)."""

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        protocol = self._protocol
        if not protocol.chunks:
            if protocol.error is not None:
                raise httpcore.ReadError(str(protocol.error) or "connection lost")
            if protocol.eof:
                return b""
            try:
                await protocol.wait_readable(timeout)
            except TimeoutError as exc:
                raise httpcore.ReadTimeout("timed out reading from the model server") from exc
            if not protocol.chunks:
                if protocol.error is not None:
                    raise httpcore.ReadError(str(protocol.error) or "connection lost")
                return b""
        return protocol.take(max_bytes)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        if self._transport.is_closing() or self._protocol.error is not None:
            raise httpcore.WriteError("the connection to the model server is closed")
        self._transport.write(buffer)
        try:
            await self._protocol.wait_writable(timeout)
        except TimeoutError as exc:
            raise httpcore.WriteTimeout("timed out writing to the model server") from exc
        if self._protocol.error is not None:
            raise httpcore.WriteError(str(self._protocol.error))

    async def aclose(self) -> None:
        self._protocol.cancel_timer()
        self._transport.close()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            transport = await asyncio.wait_for(
                loop.start_tls(
                    self._transport, self._protocol, ssl_context, server_hostname=server_hostname
                ),
                timeout,
            )
        except TimeoutError as exc:
            self._transport.close()
            raise httpcore.ConnectTimeout("timed out in the TLS handshake") from exc
        except (OSError, ssl.SSLError) as exc:
            self._transport.close()
            raise httpcore.ConnectError(str(exc)) from exc
        if transport is None:  # the server closed the connection during the handshake
            raise httpcore.ConnectError("the model server closed the connection")
        assert isinstance(transport, asyncio.Transport)
        self._protocol.transport = transport
        return AsyncioStream(transport, self._protocol)

    def get_extra_info(self, info: str) -> Any:
        transport = self._transport
        if info == "ssl_object":
            return transport.get_extra_info("ssl_object")
        if info == "client_addr":
            return transport.get_extra_info("sockname")
        if info == "server_addr":
            return transport.get_extra_info("peername")
        if info == "socket":
            return transport.get_extra_info("socket")
        if info == "is_readable":
            # An idle kept-alive connection that has something to read, or was closed, is
            # one the server ended: the pool drops it instead of sending on it.
            protocol = self._protocol
            return bool(protocol.chunks) or protocol.eof or transport.is_closing()
        return None


class AsyncioBackend(AsyncNetworkBackend):
    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        local = (local_address, 0) if local_address else None
        try:
            transport, protocol = await asyncio.wait_for(
                loop.create_connection(_Protocol, host, port, local_addr=local), timeout
            )
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout("timed out connecting to the model server") from exc
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        return _stream(transport, protocol, socket_options)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await asyncio.wait_for(
                loop.create_unix_connection(_Protocol, path), timeout
            )
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout("timed out connecting to the model server") from exc
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        return _stream(transport, protocol, socket_options)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _stream(
    transport: asyncio.BaseTransport,
    protocol: asyncio.BaseProtocol,
    socket_options: Iterable[SocketOption] | None,
) -> AsyncioStream:
    assert isinstance(transport, asyncio.Transport) and isinstance(protocol, _Protocol)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # asyncio sets TCP_NODELAY on TCP connections itself; these are the caller's.
        for option in socket_options or ():
            sock.setsockopt(*option)
    return AsyncioStream(transport, protocol)


class ModelTransport(httpx.AsyncHTTPTransport):
    """httpx's transport (request and response mapping, errors) over a pool of our own whose
    connections use `AsyncioBackend`."""

    def __init__(
        self, *, limits: httpx.Limits, verify: ssl.SSLContext | bool = True, retries: int = 0
    ) -> None:
        super().__init__(limits=limits, verify=verify, retries=retries)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            http1=True,
            http2=False,
            retries=retries,
            network_backend=AsyncioBackend(),
        )


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
