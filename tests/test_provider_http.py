"""Failure modes of the model client's own HTTP/1.1 (`chatcore/engine/provider_http.py` and
`provider_net.py`; SPEC I1, I3): what h11 refuses is refused here too, every head, line and
trailer is bounded, a body is framed one way only, a stall mid-chunk ends in the read timeout,
and requests go through httpx's client (its hooks apply). Real sockets on loopback (the
scripted server of `test_provider_net`)."""

from __future__ import annotations

import asyncio
from importlib.metadata import version
from typing import Any

import httpx
import pytest

from chatcore.engine.provider_http import MAX_HEAD, MAX_LINE, MAX_TRAILER
from chatcore.engine.provider_net import MEASURED_AGAINST
from tests import test_provider_net
from tests.test_provider_hostile import provider_for
from tests.test_provider_net import (
    CHUNKED_HEAD,
    Respond,
    answers_on_one_connection,
    chunked,
    collect,
    event_stream,
    failure_of,
    head,
    writes_then_stalls,
)

serve = test_provider_net.serve  # the scripted servers' fixture


def sends(*parts: bytes, keep: bool = True) -> Respond:
    """A responder: `parts`, each its own write, then the connection stays (or closes)."""

    async def respond(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.01)
        return keep

    return respond


def test_the_transport_names_the_library_versions_it_was_measured_against() -> None:
    # covers: I1 (the figures that keep this transport were measured beside these versions:
    # a new release line of any of them (a patch release is not one) measures again, as
    # bench/notes/http-transport.md says, and then updates MEASURED_AGAINST)
    def line(text: str) -> list[str]:
        return text.split(".")[:2]

    installed = {name: line(version(name)) for name in MEASURED_AGAINST}
    assert installed == {name: line(v) for name, v in MEASURED_AGAINST.items()}


@pytest.mark.parametrize(
    "api_key",
    ["sk-1\r\nX-Injected: 1", "sk-1\nX-Injected: 1", "sk-1\rX", "sk-1\x00"],
)
async def test_a_header_value_with_cr_or_lf_is_never_sent(serve, api_key: str) -> None:
    # covers: I1, F8 (as h11 refuses it: a header value that would add a header or a request
    # is refused before a byte is written; not retried, it would be refused again)
    server, url = await serve(sends(b""))
    provider = provider_for(url, api_key=api_key, max_retries=3)
    assert await failure_of(provider) == "bad_request"
    await asyncio.sleep(0.05)
    assert server.requests == []
    await provider.aclose()


@pytest.mark.parametrize(
    "response",
    [
        # Both framings: never read as either (a smuggled response, RFC 9112 6.3).
        CHUNKED_HEAD.replace(b"\r\n\r\n", b"\r\nContent-Length: 5\r\n\r\n") + b"5\r\nhello\r\n",
        # A coding other than chunked (h11 reads none either).
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nContent-Length: 5\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
        # Two lengths.
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n",
        # A head that ends, but past the bound.
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * MAX_HEAD + b"\r\nContent-Length: 0\r\n\r\n",
        # Informational responses that never end: together they are one head.
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" * (MAX_HEAD // 30),
        # A chunk-size line past its bound, and a trailer past its bound.
        CHUNKED_HEAD + b"5;" + b"x" * MAX_LINE + b"\r\n",
        CHUNKED_HEAD + b"0\r\n" + (b"X-T: " + b"t" * 1000 + b"\r\n") * (MAX_TRAILER // 1000 + 2),
        # Header names that are no tokens.
        b"HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n: x\r\n\r\n",
    ],
    ids=[
        "te-and-cl",
        "te-not-chunked",
        "te-gzip-with-cl",
        "te-twice",
        "two-lengths",
        "negative-length",
        "long-head",
        "endless-1xx",
        "long-chunk-line",
        "long-trailer",
        "name-with-space",
        "empty-name",
    ],
)
async def test_framing_h11_refuses_is_refused(serve, response: bytes) -> None:
    # covers: I1, I3 (issue 49: TE+CL, heads and lines bounded; a malformed answer is
    # `bad_response`, never retried and never text)
    server, url = await serve(writes_then_stalls(response, 1))
    provider = provider_for(url, max_retries=3, retry_base_delay=0.01, read_timeout=5)
    assert await failure_of(provider) == "bad_response"
    assert len(server.requests) == 1
    await provider.aclose()


async def test_many_trailer_lines_within_bounds_end_the_answer(serve) -> None:
    # covers: E5 (trailers are skipped, whatever their number within MAX_TRAILER)
    data = chunked(event_stream(["tail"]))
    data = data.replace(
        b"0\r\nX-Trailer: ignored", b"0\r\n" + b"X-Trailer: t\r\n" * 100 + b"X-T: 1"
    )
    server, url = await serve(sends(CHUNKED_HEAD + data))
    provider = provider_for(url)
    for _ in range(2):
        assert (await collect(provider))[1].text == "tail"
    assert server.connections == 1
    await provider.aclose()


async def test_informational_responses_are_skipped_and_the_connection_kept(serve) -> None:
    # covers: E5, I1 (100 Continue and 103 Early Hints precede the answer; it is read and its
    # connection serves the next request)
    data = event_stream(["after ", "hints"])
    early = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n"
    )
    server, url = await serve(sends(early, head(len(data)) + data))
    provider = provider_for(url)
    await answers_on_one_connection(provider, server, "after hints")
    await provider.aclose()


async def test_a_head_that_trickles_in_is_read(serve) -> None:
    # covers: E5 (a head split at every byte, its end across two reads)
    data = event_stream(["slow head"])
    whole = head(len(data))
    server, url = await serve(sends(*[whole[i : i + 1] for i in range(len(whole))], data))
    provider = provider_for(url)
    assert (await collect(provider))[1].text == "slow head"
    await provider.aclose()


async def test_a_server_that_stalls_mid_chunk_times_out(serve) -> None:
    # covers: I3, E5 (the read timeout holds inside a chunk: a chunk that promised 0x40 bytes
    # and sent 10 ends the answer `timeout` once the server is silent for read_timeout)
    _server, url = await serve(writes_then_stalls(CHUNKED_HEAD + b'40\r\ndata: {"ch', 5))
    provider = provider_for(url, read_timeout=0.3)
    started = asyncio.get_running_loop().time()
    assert await failure_of(provider) == "timeout"
    assert asyncio.get_running_loop().time() - started < 3
    await provider.aclose()


async def test_requests_go_through_the_client_s_send_and_its_event_hooks(serve) -> None:
    # covers: I2 (issue 49: httpx's documented event hooks and auth apply to the model
    # request; nothing bypasses `AsyncClient.send`)
    data = event_stream(["hooked"])
    server, url = await serve(sends(head(len(data)) + data))
    provider = provider_for(url)
    seen: list[str] = []

    async def on_request(request: httpx.Request) -> None:
        seen.append(f"request {request.url.path}")

    async def on_response(response: httpx.Response) -> None:
        seen.append(f"response {response.status_code}")

    provider._client.event_hooks = {"request": [on_request], "response": [on_response]}
    assert (await collect(provider))[1].text == "hooked"
    assert seen == ["request /v1/chat/completions", "response 200"]
    await provider.aclose()
