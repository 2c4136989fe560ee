"""HTTP/1.1 framing of the model client's transport (`provider_net`): the request's head and
body as bytes, a response's head parsed, a chunked body decoded incrementally. Whatever a
server sends that breaks the framing is a `MalformedResponse`: the client reports it as a
bad answer (`bad_response`), not as a connection to retry (E5, I3).
"""

from __future__ import annotations

import re

import httpx


class MalformedResponse(httpx.RemoteProtocolError):
    """The model server's bytes are not HTTP/1.1 (a retry would not fix them)."""


# The longest status line, header block or chunk-size line a model server may send.
MAX_HEAD = 64 * 1024
MAX_LINE = 4 * 1024
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
NO_BODY_STATUSES = frozenset({204, 304})


class ChunkedDecoder:
    """`Transfer-Encoding: chunked`, incrementally: `feed` takes what arrived and returns the
    data of every chunk in it at once, however many chunks one read holds (a server sends one
    per event). Lines may end with CRLF or LF; extensions and trailers are skipped."""

    SIZE, DATA, DATA_END, TRAILER, DONE = range(5)

    def __init__(self) -> None:
        self.state = self.SIZE
        self._left = 0
        self._buffer = b""

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
        self._buffer = buffer[pos:]
        return out[0] if len(out) == 1 else b"".join(out)


def request_head(request: httpx.Request) -> bytes:
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    lines += [name + b": " + value for name, value in request.headers.raw]
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
        if not colon or not name or name != name.strip():
            raise MalformedResponse("the model server sent a malformed header", request=request)
        headers.append((name, value.strip()))
    return version, int(status), reason, headers
