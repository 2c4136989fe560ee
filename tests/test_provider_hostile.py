"""A hostile or broken model server (issue 56 rows 1-4, 11, 12; SPEC F3, I3): every answer
it sends is read within bounds and refused clearly (`bad_response`, `server`, `too_large`),
a retry only for what a retry can fix, and another stream on the same loop stays fast
meanwhile. Real sockets on loopback (the scripted server of `test_provider_net`). Memory is
measured in `bench/hostile_bench.py`, not asserted here."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from chatcore.engine.provider import OpenAIProvider, ReadBounds
from chatcore.engine.provider_read import DECODE_STEP, RATIO_FLOOR, BodyDecoder, EventLines
from chatcore.engine.provider_types import ProviderError, TextDelta
from tests.engine_helpers import chat_group_of, history, make_dialog, send
from tests.fakemodel import Reply
from tests.test_provider_fidelity import finish
from tests.test_provider_net import (
    Respond,
    Server,
    answer,
    collect,
    event_stream,
    failure_of,
)

MiB = 1024 * 1024


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Respond], Awaitable[tuple[Server, str]]]]:
    """Starts scripted model servers on loopback (`test_provider_net.Server`)."""
    servers: list[Server] = []

    async def start(respond: Respond) -> tuple[Server, str]:
        server = Server(respond)
        servers.append(server)
        return server, await server.start()

    yield start
    for server in servers:
        await server.stop()


def provider_for(url: str, **kwargs: Any) -> OpenAIProvider:
    return OpenAIProvider(base_url=url, model="m", **{"max_retries": 0, **kwargs})


CLOSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


async def send_for(writer: asyncio.StreamWriter, data: bytes, total: int, step: int) -> int:
    """Writes `data` repeatedly up to `total` bytes, `step` at a time, until the client hangs
    up; returns what was written."""
    sent = 0
    piece = (data * (step // len(data) + 1))[:step]
    try:
        while sent < total:
            writer.write(piece)
            await writer.drain()
            sent += len(piece)
    except (ConnectionError, OSError):
        pass
    return sent


async def meanwhile_fast(other: OpenAIProvider, hostile: Any) -> tuple[Any, list[float]]:
    """Runs `hostile` and, beside it, round trips of `other` one after another; returns the
    hostile outcome and the round trips' durations."""
    durations: list[float] = []
    task = asyncio.ensure_future(hostile)
    while not task.done() or not durations:
        started = time.monotonic()
        await collect(other)
        durations.append(time.monotonic() - started)
        await asyncio.sleep(0.01)
    return await task, durations


def assert_fast(durations: list[float]) -> None:
    # The other user's round trips stay quick while the hostile answer is read (normally a
    # few milliseconds; a quadratic parse took seconds).
    assert max(durations) < 2.0, durations


async def test_an_endless_event_line_is_refused_and_others_stay_fast(serve) -> None:
    # covers: F3, I3 (issue 56 row 1: a 50 MB line without a newline stalled the process)
    sent: list[int] = []

    async def respond(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        writer.write(CLOSE_HEAD + b"data: ")
        sent.append(await send_for(writer, b"x", 50 * MiB, 64 * 1024))
        return False

    server, url = await serve(respond)
    _good, good_url = await serve(answer(["fine"]))
    hostile = provider_for(url, max_retries=2, bounds=ReadBounds(event_bytes=MiB))
    other = provider_for(good_url)
    started = time.monotonic()
    kind, durations = await meanwhile_fast(other, failure_of(hostile))
    assert kind == "bad_response"
    assert time.monotonic() - started < 5
    assert_fast(durations)
    assert len(server.requests) == 1  # not retried
    # The server saw the client hang up long before the line's end.
    for _ in range(100):
        if sent:
            break
        await asyncio.sleep(0.05)
    assert sent and sent[0] < 50 * MiB, sent
    await hostile.aclose()
    await other.aclose()


def test_event_lines_are_read_linearly_and_bounded() -> None:
    # covers: F3, F7 (a line split into many reads is joined once; one past the bound fails)
    lines = EventLines(max_line=64)
    assert lines.feed(b"data: {") == []
    assert lines.feed(b'"a":1') == []
    assert lines.feed(b'}\r\n\r\ndata: {"b"') == [b'{"a":1}']
    assert lines.feed(b":2}\n\n: ping\rdata: [DONE]\n") == [b'{"b":2}']
    assert lines.finish() == []
    with pytest.raises(ProviderError) as refused:
        for _ in range(10):
            lines.feed(b"data: 0123456789")
    assert refused.value.kind == "bad_response"
    whole = EventLines(max_line=64)
    with pytest.raises(ProviderError):
        whole.feed(b"data: " + b"y" * 100 + b"\n")


def gzip_stream(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=6)


async def test_a_compressed_answer_within_bounds_arrives_whole(serve) -> None:
    # covers: E5 (gzip and deflate answers are decoded, in bounded steps)
    pieces = ["zipped ", "answer"]
    for coding, pack in (
        (b"gzip", gzip_stream),
        (b"deflate", zlib.compress),
    ):
        data = pack(event_stream(pieces))

        async def respond(writer: asyncio.StreamWriter, body: dict[str, Any], data=data, c=coding):
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: "
                + c
                + b"\r\nContent-Length: %d\r\n\r\n" % len(data)
                + data
            )
            await writer.drain()
            return True

        _server, url = await serve(respond)
        provider = provider_for(url)
        deltas, done = await collect(provider)
        assert "".join(deltas) == done.text == "".join(pieces)
        await provider.aclose()


async def test_a_decompression_bomb_is_refused_and_others_stay_fast(serve) -> None:
    # covers: F3, I3 (issue 56 row 2: 200 KB of gzip that decodes to 200 MB)
    packer = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    bomb = packer.compress(b"data: ") + b"".join(packer.compress(b"\n" * MiB) for _ in range(200))
    bomb += packer.flush()
    assert len(bomb) < 300 * 1024

    async def respond(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
            b"Content-Length: %d\r\n\r\n" % len(bomb) + bomb
        )
        await writer.drain()
        return True

    _server, url = await serve(respond)
    _good, good_url = await serve(answer(["fine"]))
    hostile = provider_for(url)
    other = provider_for(good_url)
    kind, durations = await meanwhile_fast(other, failure_of(hostile))
    assert kind == "bad_response"
    assert_fast(durations)
    await hostile.aclose()
    await other.aclose()


async def test_a_huge_error_body_is_read_only_in_part_and_never_twice(serve) -> None:
    # covers: F3, I3 (issue 56 row 3: a 5xx with a 200 MB body was read whole, 4 times)
    sent: list[int] = []

    async def respond(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        writer.write(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/html\r\n"
            b"Content-Length: %d\r\n\r\n" % (200 * MiB)
        )
        sent.append(await send_for(writer, b"<p>down</p>", 200 * MiB, 256 * 1024))
        return False

    server, url = await serve(respond)
    _good, good_url = await serve(answer(["fine"]))
    hostile = provider_for(url, max_retries=1, retry_base_delay=0.01)
    other = provider_for(good_url)
    kind, durations = await meanwhile_fast(other, failure_of(hostile))
    assert kind == "server"  # classified from the start of its body, retried once
    assert_fast(durations)
    await asyncio.sleep(0.2)
    assert server.connections == 2  # each refusal's connection was closed, not drained
    assert all(size < 50 * MiB for size in sent), sent
    await hostile.aclose()
    await other.aclose()


async def test_an_answer_past_its_byte_bound_keeps_what_fit(serve) -> None:
    # covers: F3 (issue 56 row 4: one answer's bytes are bounded, what fit is kept)
    _server, url = await serve(answer(["é" * 40, "b" * 60, "c" * 100]))
    provider = provider_for(url, bounds=ReadBounds(answer_bytes=101))
    deltas: list[str] = []
    with pytest.raises(ProviderError) as refused:
        async for event in provider.stream(messages=[{"role": "user", "content": "hi"}]):
            if isinstance(event, TextDelta):
                deltas.append(event.text)
    assert refused.value.kind == "too_large"
    assert "".join(deltas) == "é" * 40 + "b" * 21  # 80 + 21 bytes
    await provider.aclose()


@pytest.mark.django_db(transaction=True)
@pytest.mark.both_dbs
async def test_a_turn_whose_answer_is_too_large_fails_and_keeps_the_part(
    make_engine, fake_model, recorder, user, other_user
) -> None:
    # covers: F3 (issue 56 row 4: the turn ends failed/too_large, the part that fit kept; a
    # 50 MB answer was stored whole and made a 52 MB history page)
    provider = OpenAIProvider(
        base_url=fake_model.url,
        model="fake",
        retry_base_delay=0.01,
        bounds=ReadBounds(answer_bytes=1000),
    )
    engine = await make_engine(provider=provider)
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="word " * 2000, chunk=400))
    ack = await send(engine, session, "write a lot")
    done = await finish(rec, ack.turn_id)
    assert done["status"] == "failed"
    assert done["error"]["kind"] == "too_large"
    kept = [m for m in await history(session) if m.role == "assistant"]
    assert [len(m.content) for m in kept] == [1000]
    assert kept[0].content == ("word " * 200)
    assert kept[0].status == "interrupted"
    # Another user's turn on the same engine answers as usual.
    theirs = await make_dialog(other_user)
    other_rec = await recorder(chat_group_of(theirs))
    other_ack = await send(engine, theirs, "hello")
    assert (await finish(other_rec, other_ack.turn_id))["status"] == "completed"


async def test_switching_protocols_is_an_error_and_its_connection_is_not_reused(
    serve,
) -> None:
    # covers: I3 (issue 56 row 11: a 101 counted as an empty answer and its connection pooled)
    calls = 0

    async def respond(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n")
        else:
            data = event_stream(["next"])
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        await writer.drain()
        return True

    server, url = await serve(respond)
    provider = provider_for(url, max_retries=3)
    assert await failure_of(provider) == "bad_response"
    assert calls == 1  # not retried
    started = time.monotonic()
    assert (await collect(provider))[1].text == "next"
    assert time.monotonic() - started < 2
    assert server.connections == 2
    await provider.aclose()


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # chunk size
        b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * (80 * 1024),  # an over-long head
        b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\n",  # framing
        b"HTTP/9 200 OK\r\n\r\n",  # a status line
        b"HTTP/1.1 200 OK\r\n bad header\r\n\r\n",
        b"HTTP/1.1 302 Found\r\nLocation: http://elsewhere/\r\nContent-Length: 0\r\n\r\n",
    ],
)
async def test_a_malformed_response_is_bad_response_and_not_retried(serve, response) -> None:
    # covers: I3 (issue 56 row 12: broken framing was retried 3 times as `connection`)
    def respond_with(data: bytes) -> Respond:
        async def respond(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(0.5)
            return False

        return respond

    server, url = await serve(respond_with(response))
    provider = provider_for(url, max_retries=3, retry_base_delay=0.01, read_timeout=5)
    assert await failure_of(provider) == "bad_response"
    assert len(server.requests) == 1
    await provider.aclose()


@pytest.mark.parametrize(
    "event",
    [
        {"choices": "x"},
        {"choices": [{"delta": "text"}]},
        {"choices": [{"delta": {"content": 5}}]},
        {"choices": [{"delta": {"tool_calls": [{"function": {"arguments": 1}}]}}]},
        {"usage": "lots"},
        {"choices": [{"delta": {"tool_calls": [{"index": "x"}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": i} for i in range(129)]}}]},
    ],
)
async def test_an_event_with_fields_of_the_wrong_shape_is_bad_response(serve, event) -> None:
    # covers: I3 (a malformed event fails the answer clearly, never as an internal error)
    data = b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"

    async def respond(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        await writer.drain()
        return True

    _server, url = await serve(respond)
    provider = provider_for(url)
    assert await failure_of(provider) == "bad_response"
    await provider.aclose()


def test_a_bomb_that_arrived_whole_is_refused_after_its_first_mib() -> None:
    # covers: F3, I3 (the ratio is to what was decompressed so far, so a bomb read in one
    # piece is not decompressed ratio × its size first)
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    bomb = b"".join(packer.compress(b"\n" * MiB) for _ in range(64)) + packer.flush()
    decoder = BodyDecoder("gzip", max_bytes=64 * MiB, max_ratio=200)
    with pytest.raises(ProviderError) as refused:
        for _piece in decoder.decode(bomb):
            pass
    assert refused.value.kind == "bad_response"
    assert decoder.decoded <= RATIO_FLOOR + DECODE_STEP
    # An honest compressed stream of the same size is decoded whole.
    honest = os.urandom(MiB // 2).hex().encode()
    packed = gzip_stream(honest)
    decoder = BodyDecoder("gzip", max_bytes=64 * MiB, max_ratio=200)
    assert b"".join(decoder.decode(packed)) == honest
