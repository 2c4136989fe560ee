"""What `serve` puts in front of Django (F3, F8), for every path:

- `BodyCapFactory`: Daphne's HTTP factory whose requests refuse a body over
  CHAT["REQUEST_BODY_MAX_BYTES"] (an import's: CHAT["IMPORT_MAX_BYTES"], H2) with 413 as soon
  as it is known: a declared Content-Length over the cap before any of the body is read, a
  chunked body once it passes the cap. The connection is closed; nothing reaches Django
  (Daphne would otherwise buffer the whole body first, whoever sent it).
- `QuietSocket`: Daphne's WebSocket protocol, taking its options from its factory as
  autobahn does, without formatting them for a debug log nobody reads (below).
- `SecurityHeaders`: the headers every page gets from Django's middleware (the
  Content-Security-Policy, `nosniff`, no framing, the referrer policy) on the responses that
  do not pass through it: the static files `serve` answers itself.

Daphne's request is Twisted's `http.Request`; `gotLength` and `handleContentChunk` are
that documented interface (`IRequest`). A test through the real `serve` fails if Daphne
stops building its factory as `Server.http_factory` (tests/test_edges.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from autobahn.websocket.protocol import WebSocketServerProtocol
from daphne.http_protocol import HTTPFactory, WebRequest
from daphne.ws_protocol import WebSocketProtocol
from django.conf import settings
from django.utils import translation

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def body_cap() -> int:
    return int(settings.CHAT["REQUEST_BODY_MAX_BYTES"])


# H2: `POST /api/v1/sessions/import` takes a whole dialog, up to its own limit (the route
# itself refuses one over it with 413).
IMPORT_PATH = b"/api/v1/sessions/import"


def _cap_for(channel: Any, cap: int) -> int:
    """The cap of the request being received on `channel`: an import's own, when larger.
    Twisted's channel keeps the request line's path (`_path`) until the request is whole; the
    request gets it only then (`requestReceived`), after its body. I2: the import test of
    tests/test_serve_edges.py fails if that attribute goes."""
    path = getattr(channel, "_path", b"") or b""
    if path.split(b"?", 1)[0] == IMPORT_PATH:
        return max(cap, int(settings.CHAT["IMPORT_MAX_BYTES"]))
    return cap


def _language(accept: str) -> str:
    """The first supported language an `Accept-Language` value names (F5)."""
    for item in accept.split(","):
        code = item.split(";", 1)[0].strip()
        if code and code != "*":
            try:
                return translation.get_supported_language_variant(code)
            except LookupError:
                continue
    return str(settings.LANGUAGE_CODE)


def _too_large_response(accept: str) -> bytes:
    with translation.override(_language(accept)):
        message = translation.gettext("The request body is too large.")
    body = json.dumps({"code": "too_large", "message": message}, ensure_ascii=False).encode()
    return (
        b"HTTP/1.1 413 Content Too Large\r\n"
        b"Content-Type: application/json; charset=utf-8\r\n"
        b"Content-Length: %d\r\n"
        b"X-Content-Type-Options: nosniff\r\n"
        b"Connection: close\r\n\r\n" % len(body)
    ) + body


class BodyCapRequest(WebRequest):
    """Daphne's request, refusing a body over the cap before Django sees any of it."""

    cap = 0  # set per factory
    _received = 0
    _refused = False

    def gotLength(self, length: int | None) -> None:  # noqa: N802 - Twisted's interface
        self.cap = _cap_for(self.channel, self.cap)
        if length is not None and length > self.cap:
            self._refuse(f"declared {length} bytes")
            return
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:  # noqa: N802 - Twisted's interface
        if self._refused:
            return
        self._received += len(data)
        if self._received > self.cap:
            self._refuse(f"over {self.cap} bytes sent")
            return
        super().handleContentChunk(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:  # noqa: N802
        if self._refused:
            return
        super().requestReceived(command, path, version)

    def _refuse(self, what: str) -> None:
        self._refused = True
        logger.warning("request body refused (413): %s", what)
        transport = self.channel.transport
        if transport is not None:
            accept = self.requestHeaders.getRawHeaders(b"accept-language") or [b""]
            transport.write(_too_large_response(accept[0].decode("latin-1")))
            transport.loseConnection()


class BodyCapFactory(HTTPFactory):
    """Daphne's HTTP factory with `BodyCapRequest` as its requests."""

    def __init__(self, server: Any, cap: int) -> None:
        super().__init__(server)
        self.request_class = type("CappedRequest", (BodyCapRequest,), {"cap": cap})

    def buildProtocol(self, addr: Any) -> Any:  # noqa: N802 - Twisted's interface
        protocol = super().buildProtocol(addr)
        protocol.requestFactory = self.request_class
        return protocol


class QuietSocket(WebSocketProtocol):
    """Daphne's WebSocket protocol, its options copied from its factory before autobahn's
    `_connectionMade` runs, so that method finds none left to copy.

    Autobahn's `_connectionMade` copies each of `CONFIG_ATTRS` (29 options) from the factory
    and then hands all of them, `pprint.pformat`-ed, to a debug log call: the formatting is
    done whether or not anything logs at debug level. It took 170 us of every connect, a
    tenth of a bare Daphne handshake's CPU (issue 57). Here the same options are copied, to
    the same instance attributes, and autobahn's loop finds an empty `CONFIG_ATTRS`.
    `tests/test_serve_edges.py` checks that a socket still carries the factory's options."""

    CONFIG_ATTRS = ()
    OPTIONS = WebSocketServerProtocol.CONFIG_ATTRS

    def _connectionMade(self) -> None:
        factory = self.factory
        for name in self.OPTIONS:
            if not hasattr(self, name):
                setattr(self, name, getattr(factory, name))
        super()._connectionMade()


def page_headers() -> list[tuple[bytes, bytes]]:
    """The security headers of a page (chatcore.security and Django's SecurityMiddleware)."""
    policy = "; ".join(f"{k} {v}" for k, v in settings.CONTENT_SECURITY_POLICY.items())
    headers = [
        (b"content-security-policy", policy.encode()),
        (b"x-content-type-options", b"nosniff"),
        (b"x-frame-options", b"DENY"),
    ]
    if settings.SECURE_REFERRER_POLICY:
        headers.append((b"referrer-policy", str(settings.SECURE_REFERRER_POLICY).encode()))
    if settings.SECURE_CROSS_ORIGIN_OPENER_POLICY:
        headers.append(
            (
                b"cross-origin-opener-policy",
                str(settings.SECURE_CROSS_ORIGIN_OPENER_POLICY).encode(),
            )
        )
    return headers


class SecurityHeaders:
    """ASGI: adds the page security headers a static file's response lacks (F8). A socket
    goes straight to `websocket` (the app behind the static files' handler): these layers
    have nothing to do for it, and none of their coroutines waits for its whole life."""

    _asgi_single_callable = True

    def __init__(self, app: Any, *, websocket: Any = None) -> None:
        self.app = app
        self.websocket = websocket or app
        self.headers = page_headers()
        self.prefix = str(settings.STATIC_URL or "/static/")

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] == "websocket":
            return self.websocket(scope, receive, send)
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith(self.prefix):
            return self.app(scope, receive, send)
        return self._static(scope, receive, send)

    async def _static(self, scope: Scope, receive: Receive, send: Send) -> None:

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in self.headers if k not in present]
                if extra:
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_headers)
