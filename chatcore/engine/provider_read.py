"""Reading a model server's answer within bounds (E5, F3, I3).

A hostile or broken model server must not stall the loop every user shares nor grow the
process without limit. What arrives is read here, each byte once:

- `EventLines`: the `data:` payloads of server-sent events, read line by line as the bytes
  arrive. An unfinished line waits as a list of its pieces (joined once, when its end
  arrives), so the work stays linear in what arrived; a line longer than `max_line` bytes
  is refused (`bad_response`) as soon as it is.
- `BodyDecoder`: the `Content-Encoding` (gzip or deflate), decompressed a bounded step at a
  time, refused past a total size or a ratio to what arrived (a decompression bomb).
- `read_error_body`: the first bytes of an error answer; the rest is never read (its
  connection is closed instead of drained).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

import orjson

from .provider_errors import classify_stream_error
from .provider_types import ProviderError

# The most one decompression step makes: a bomb grows the buffer by at most this much before
# its size or ratio is checked.
DECODE_STEP = 64 * 1024
# Below this much decoded, the ratio is not checked (small bodies compress well).
RATIO_FLOOR = 1024 * 1024
# Tool calls of one answer (each a slot kept until the answer ends, whatever its bytes).
MAX_TOOL_CALLS = 128


def bad_response(message: str) -> ProviderError:
    return ProviderError("bad_response", message)


def sse_payloads(data: bytes) -> tuple[list[bytes], bytes]:
    """The `data:` payloads of the complete lines in `data` (server-sent events; lines end
    with CRLF, LF or CR), and the incomplete last line to prepend to the next read."""
    lines = data.splitlines()
    rest = b""
    if lines and not data.endswith((b"\n", b"\r")):
        rest = lines.pop()
    out = []
    for line in lines:
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload and payload != b"[DONE]":
                out.append(payload)
    return out, rest


class EventLines:
    """The `data:` payloads of an event stream as its bytes arrive, one line at most
    `max_line` bytes. `feed` scans only the new bytes for a line's end; the pieces of an
    unfinished line are kept apart and joined once."""

    def __init__(self, max_line: int) -> None:
        self.max_line = max_line
        self._parts: list[bytes] = []
        self._pending = 0

    def feed(self, data: bytes) -> list[bytes]:
        cut = max(data.rfind(b"\n"), data.rfind(b"\r"))
        if cut < 0:
            self._hold(data)
            return []
        whole = data if cut == len(data) - 1 else data[: cut + 1]
        if self._parts:
            self._parts.append(whole)
            whole = b"".join(self._parts)
            self._parts, self._pending = [], 0
        if cut < len(data) - 1:
            self._hold(data[cut + 1 :])
        if len(whole) > self.max_line:
            self._check_lines(whole)
        return sse_payloads(whole)[0]

    def finish(self) -> list[bytes]:
        """The payload of a last line the stream did not end."""
        if not self._parts:
            return []
        rest = b"".join(self._parts)
        self._parts, self._pending = [], 0
        return sse_payloads(rest + b"\n")[0]

    def _hold(self, piece: bytes) -> None:
        self._pending += len(piece)
        if self._pending > self.max_line:
            raise bad_response(f"the model server sent an event line over {self.max_line} bytes")
        self._parts.append(piece)

    def _check_lines(self, whole: bytes) -> None:
        for line in whole.splitlines():
            if len(line) > self.max_line:
                raise bad_response(
                    f"the model server sent an event line over {self.max_line} bytes"
                )


class _Inflater(Protocol):
    """What `BodyDecoder` uses of a `zlib.decompressobj`."""

    @property
    def unconsumed_tail(self) -> bytes: ...

    def decompress(self, data: bytes, max_length: int = ..., /) -> bytes: ...


class BodyDecoder:
    """A body's `Content-Encoding` undone in bounded steps: at most `max_bytes` decoded in
    all, and (past the first MiB) at most `max_ratio` times the compressed bytes it came
    from. A body that is not compressed is passed on as it is."""

    def __init__(self, encoding: str, *, max_bytes: int, max_ratio: int) -> None:
        codings = [c.strip().lower() for c in encoding.split(",")]
        codings = [c for c in codings if c and c != "identity"]
        if len(codings) > 1:
            raise bad_response("the model server stacked content encodings")
        self.max_bytes = max_bytes
        self.max_ratio = max_ratio
        self.received = 0
        self.decoded = 0
        self._raw_deflate = False
        self._zlib: _Inflater | None = None
        if not codings:
            return
        coding = codings[0]
        if coding in ("gzip", "x-gzip"):
            self._zlib = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif coding == "deflate":
            self._zlib = zlib.decompressobj()
            self._raw_deflate = True  # some servers send raw deflate: tried on the first error
        else:
            raise bad_response(f"the model server used an unsupported content encoding: {coding}")

    def decode(self, data: bytes) -> Iterator[bytes]:
        if self._zlib is None:
            # Not compressed: bounded by what the caller reads of it (a line, an answer).
            if data:
                yield data
            return
        pending = data
        while True:
            try:
                piece = self._zlib.decompress(pending, DECODE_STEP)
            except zlib.error as exc:
                if self._raw_deflate and self.decoded == 0:
                    self._raw_deflate = False
                    self._zlib = zlib.decompressobj(-zlib.MAX_WBITS)
                    continue
                raise bad_response("the model server sent a body that does not decompress") from exc
            self._raw_deflate = False
            # The ratio is to what was decompressed so far, not to what arrived: a bomb that
            # arrived whole is refused after its first MiB, not after ratio × its size.
            self.received += len(pending) - len(self._zlib.unconsumed_tail)
            pending = self._zlib.unconsumed_tail
            self._count(len(piece))
            if piece:
                yield piece
            if not pending and len(piece) < DECODE_STEP:
                return

    def _count(self, size: int) -> None:
        self.decoded += size
        if self.decoded > self.max_bytes:
            raise bad_response(f"the model server's answer decodes to over {self.max_bytes} bytes")
        if self.decoded > RATIO_FLOOR and self.decoded > self.received * self.max_ratio:
            raise bad_response(
                f"the model server's answer decompresses over {self.max_ratio} times its size"
            )


async def read_error_body(raw: AsyncIterator[bytes], decoder: BodyDecoder, limit: int) -> bytes:
    """At most `limit` bytes of an error answer's body, decoded; reading stops there (the
    caller closes the response, and with it the connection, unread)."""
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in raw:
            for data in decoder.decode(chunk):
                parts.append(data[: limit - size])
                size += len(parts[-1])
                if size >= limit:
                    return b"".join(parts)
    except ProviderError:
        pass  # what decoded so far is the body to classify
    return b"".join(parts)


def read_chunk(
    data: bytes, calls: dict[int, dict[str, Any]], usage: dict[str, Any], finish_reason: str
) -> tuple[str, dict[str, Any], str, int]:
    """One streamed chunk: its text (if any), the usage and finish reason so far, and the
    bytes it added to the answer (text and tool call arguments); tool call parts are added to
    `calls` by index."""
    try:
        # In C: a stream's every event passes here, on the event loop.
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        # What the json module reads and orjson refuses (NaN, a lone surrogate's escape, an
        # integer past 64 bits, a byte order mark) is read as before.
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise bad_response("the model server sent malformed data") from exc
    if not isinstance(chunk, dict):
        raise bad_response("the model server sent malformed data")
    if chunk.get("error"):
        raise classify_stream_error(chunk)
    try:
        return _read_fields(chunk, calls, usage, finish_reason)
    except (AttributeError, TypeError, ValueError) as exc:
        # A field of the wrong type (a string where an object belongs): malformed (I3).
        raise bad_response("the model server sent malformed data") from exc


def _read_fields(
    chunk: dict[str, Any],
    calls: dict[int, dict[str, Any]],
    usage: dict[str, Any],
    finish_reason: str,
) -> tuple[str, dict[str, Any], str, int]:
    if chunk.get("usage"):
        usage = dict(chunk["usage"])
    text = ""
    size = 0
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        piece = delta.get("content")
        if piece:
            text += piece
        for tc in delta.get("tool_calls") or []:
            index = int(tc.get("index", 0))
            if index not in calls and len(calls) >= MAX_TOOL_CALLS:
                raise bad_response(f"the model server sent over {MAX_TOOL_CALLS} tool calls")
            slot = calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
            if tc.get("id"):
                slot["id"] = str(tc["id"])
            fn = tc.get("function") or {}
            if fn.get("name"):
                slot["name"] += fn["name"]
                size += len(fn["name"])
            if fn.get("arguments"):
                slot["arguments"] += fn["arguments"]
                size += _utf8_len(fn["arguments"])
        if choice.get("finish_reason"):
            finish_reason = str(choice["finish_reason"])
    return text, usage, finish_reason, size + _utf8_len(text)


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def fitting(text: str, room: int) -> str:
    """The longest start of `text` whose UTF-8 takes at most `room` bytes."""
    if room <= 0:
        return ""
    return text.encode("utf-8", "surrogatepass")[:room].decode("utf-8", "ignore")


def too_large(limit: int) -> ProviderError:
    return ProviderError("too_large", f"the model's answer grew past {limit} bytes")
