"""HTTP/1.1 framing of the model client's transport (`provider_net`): the request's head and
body as bytes, a response's head parsed and its body's framing decided, a chunked body decoded
incrementally. Whatever a server sends that breaks the framing is a `MalformedResponse`: the
client reports it as a bad answer (`bad_response`), not as a connection to retry (E5, I3).
The rules are h11's (what httpx's default transport reads with), stricter where RFC 9112
says a message "ought to be handled as an error": a request header with CR, LF or NUL is
never sent; only `Transfer-Encoding: chunked` is read, never beside a Content-Length.
"""

from __future__ import annotations

import re

import httpx


class MalformedResponse(httpx.RemoteProtocolError):
    """The model server's bytes are not HTTP/1.1 (a retry would not fix them)."""


# The most head bytes of one response (its status lines and header blocks, the informational
# ones before it included), the longest chunk-size or trailer line, and the most trailer bytes.
MAX_HEAD = 64 * 1024
MAX_LINE = 4 * 1024
MAX_TRAILER = 64 * 1024
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
NO_BODY_STATUSES = frozenset({204, 304})
# RFC 9110 5.1 and 5.5: a field name is a token; a value never holds CR, LF or NUL (h11's
# rule: what a header injection needs).
_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_FORBIDDEN_IN_VALUE = re.compile(rb"[\x00\r\n]")


class ChunkedDecoder:
    """`Transfer-Encoding: chunked`, incrementally: `feed` takes what arrived and returns the
    data of every chunk in it at once, however many chunks one read holds (a server sends one
    per event). Lines may end with CRLF or LF; extensions and trailers are skipped."""

    SIZE, DATA, DATA_END, TRAILER, DONE = range(5)

    def __init__(self) -> None:
        self.state = self.SIZE
        self._left = 0
        self._buffer = b""
        self._trailer = 0

    @property
    def done(self) -> bool:
        return self.state == self.DONE

    @property
    def leftover(self) -> bytes:
        """Bytes after the last chunk's trailer (a server that sent more than its answer)."""
        return self._buffer if self.done else b""

    def feed(self, data: bytes) -> bytes:
        buffer = self._buffer + data if self._buffer else data
        size = len(buffer)
        pos = 0
        out: list[bytes] = []
        while pos < size and self.state != self.DONE:
            if self.state == self.DATA:
                take = min(self._left, size - pos)
                out.append(buffer[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self.state = self.DATA_END
                continue
            end = buffer.find(b"\n", pos)
            if end < 0:
                if size - pos > MAX_LINE:
                    raise MalformedResponse("a chunk line of the model server is too long")
                break
            if end - pos > MAX_LINE:
                raise MalformedResponse("a chunk line of the model server is too long")
            line = buffer[pos:end].rstrip(b"\r")
            pos = end + 1
            if self.state == self.DATA_END:
                if line:
                    raise MalformedResponse("a chunk of the model server overran its size")
                self.state = self.SIZE
            elif self.state == self.SIZE:
                digits = line.split(b";", 1)[0].strip()
                if not _HEX.fullmatch(digits):
                    raise MalformedResponse("the model server sent a malformed chunk size")
                self._left = int(digits, 16)
                self.state = self.DATA if self._left else self.TRAILER
            elif not line:  # TRAILER: its empty line ends the body
                self.state = self.DONE
            else:  # a trailer field, skipped; their bytes are bounded
                self._trailer += len(line)
                if self._trailer > MAX_TRAILER:
                    raise MalformedResponse("the model server's trailer is too long")
        self._buffer = buffer[pos:]
        return out[0] if len(out) == 1 else b"".join(out)


def request_head(request: httpx.Request) -> bytes:
    """The request line and headers. A header that would change the framing (CR, LF or NUL
    in its value: an injected header or request) is refused, as h11 refuses it."""
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    for name, value in request.headers.raw:
        if not _TOKEN.fullmatch(name) or _FORBIDDEN_IN_VALUE.search(value):
            raise httpx.LocalProtocolError(
                f"refused to send a malformed request header ({name[:64]!r})", request=request
            )
        lines.append(name + b": " + value)
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def request_body(request: httpx.Request) -> bytes:
    body = b"".join([part async for part in request.stream])  # type: ignore[union-attr]
    if request.headers.get("transfer-encoding", "").lower() == "chunked":
        return (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    return body


def parse_head(
    head: bytes, request: httpx.Request
) -> tuple[bytes, int, bytes, list[tuple[bytes, bytes]]]:
    lines = head.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    status, _, reason = rest.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(status) != 3 or not status.isdigit():
        raise MalformedResponse("the model server sent a malformed status line", request=request)
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            raise MalformedResponse("the model server sent a malformed header", request=request)
        headers.append((name, value.strip()))
    return version, int(status), reason, headers


def body_framing(
    method: str, status: int, version: bytes, headers: list[tuple[bytes, bytes]]
) -> tuple[int | None, bool, bool]:
    """How a response's body ends, from its head: (its length, or None for chunked or up to
    the close; chunked; whether the connection may serve the next request). RFC 9112 6.3:
    no body for a HEAD, a 1xx, 204 or 304; chunked when `Transfer-Encoding` says so (only
    `chunked` is read, as h11 reads it: a body in another coding is refused); else the one
    Content-Length; else up to the close. A 101 switched the connection to another protocol:
    it is never reused (I3)."""
    fields: dict[bytes, list[bytes]] = {}
    for name, value in headers:
        fields.setdefault(name.lower(), []).append(value.lower())
    connection = b",".join(fields.get(b"connection", []))
    keep = b"close" not in connection and (version == b"HTTP/1.1" or b"keep-alive" in connection)
    if method == "HEAD" or status in NO_BODY_STATUSES or status < 200:
        return 0, False, keep and status >= 200
    codings = [c.strip() for c in b",".join(fields.get(b"transfer-encoding", [])).split(b",")]
    if codings != [b""]:
        if codings != [b"chunked"]:
            raise MalformedResponse("the model server sent a Transfer-Encoding other than chunked")
        if b"content-length" in fields:
            # RFC 9112 6.3: both at once may be a smuggled response; never read as either.
            raise MalformedResponse("the model server sent Transfer-Encoding and Content-Length")
        return None, True, keep
    if b"content-length" not in fields:
        return None, False, False  # up to the close
    values = {v.strip() for v in b",".join(fields[b"content-length"]).split(b",")}
    if len(values) != 1 or not next(iter(values)).isdigit():
        raise MalformedResponse("the model server sent a malformed Content-Length")
    return int(next(iter(values))), False, keep
