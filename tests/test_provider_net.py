"""The model client's own network layer (issue 10 item 1, E5, F7): httpx and httpcore over
plain asyncio connections (`chatcore/engine/provider_net.py`) and the byte-level reading of
the event stream. Real sockets on loopback: a small HTTP/1.1 server here that can answer in
odd pieces, keep or drop the connection, stall, or speak TLS."""

from __future__ import annotations

import asyncio
import datetime
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from chatcore.engine.provider import OpenAIProvider
from chatcore.engine.provider_net import HIGH_WATER, ModelTransport, provider_transport
from chatcore.engine.provider_read import sse_payloads
from chatcore.engine.provider_types import Completion, ProviderError, TextDelta, complete_text
from tests.fakemodel import Reply
from tests.procs import free_port

Respond = Callable[[asyncio.StreamWriter, dict[str, Any]], Awaitable[bool]]


class Server:
    """Counts its connections; each request is answered by `respond`, which says whether the
    connection stays open for the next one."""

    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.connections = 0
        self.requests: list[dict[str, Any]] = []
        self._server: asyncio.Server | None = None

    async def start(self, tls: ssl.SSLContext | None = None) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=tls)
        port = self._server.sockets[0].getsockname()[1]
        return f"{'https' if tls else 'http'}://127.0.0.1:{port}/v1"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                length = next(
                    int(line.split(":", 1)[1])
                    for line in head.split("\r\n")
                    if line.lower().startswith("content-length:")
                )
                body = json.loads(await reader.readexactly(length))
                self.requests.append(body)
                if not await self.respond(writer, body):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def event_stream(pieces: list[str], *, newline: bytes = b"\n") -> bytes:
    lines = [
        {"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]} for p in pieces
    ]
    lines.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    lines.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    out = b"".join(b"data: " + json.dumps(x).encode() + newline + newline for x in lines)
    return out + b"data: [DONE]" + newline + newline


def head(length: int) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        + f"Content-Length: {length}\r\n\r\n".encode()
    )


def answer(pieces: list[str], *, keep: bool = True, step: int = 0, newline: bytes = b"\n"):
    """A responder: the stream of `pieces`, written `step` bytes at a time (0: at once)."""

    async def respond(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        data = event_stream(pieces, newline=newline)
        writer.write(head(len(data)))
        if not step:
            writer.write(data)
        else:
            for start in range(0, len(data), step):
                writer.write(data[start : start + step])
                await writer.drain()
                await asyncio.sleep(0.001)
        await writer.drain()
        return keep

    return respond


def writes_then_stalls(data: bytes, seconds: float) -> Respond:
    """A responder: `data`, then nothing for `seconds`, then the connection closes."""

    async def respond(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        writer.write(data)
        await writer.drain()
        await asyncio.sleep(seconds)
        return False

    return respond


async def collect(provider: OpenAIProvider) -> tuple[list[str], Completion]:
    deltas: list[str] = []
    async for event in provider.stream(messages=[{"role": "user", "content": "hi"}]):
        if isinstance(event, TextDelta):
            deltas.append(event.text)
        elif isinstance(event, Completion):
            return deltas, event
    raise AssertionError("no completion")


async def answers_on_one_connection(provider: OpenAIProvider, server: Server, text: str) -> None:
    """Two answers of `text`, streamed whole, on the one connection kept alive between them."""
    for _ in range(2):
        deltas, done = await collect(provider)
        assert "".join(deltas) == done.text == text
    assert server.connections == 1


async def failure_of(provider: OpenAIProvider) -> str:
    """The kind of the `ProviderError` an answer fails with."""
    with pytest.raises(ProviderError) as failed:
        await collect(provider)
    return failed.value.kind


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[tuple[Server, str]]]]:
    servers: list[Server] = []

    async def start(respond: Respond, tls: ssl.SSLContext | None = None) -> tuple[Server, str]:
        server = Server(respond)
        servers.append(server)
        return server, await server.start(tls)

    yield start
    for server in servers:
        await server.stop()


def provider_for(url: str, **kwargs: Any) -> OpenAIProvider:
    return OpenAIProvider(base_url=url, model="m", max_retries=0, **kwargs)


async def test_the_model_client_uses_its_own_connections_and_keeps_them_alive(serve) -> None:
    # covers: E5, F7, STYLE 6 (issue 10 item 1: streaming costs the loop as little as it can)
    server, url = await serve(answer(["Hel", "lo"]))
    provider = provider_for(url)
    assert isinstance(provider._transport, ModelTransport)
    for _ in range(3):
        deltas, done = await collect(provider)
        assert "".join(deltas) == done.text == "Hello"
        assert done.finish_reason == "stop"
        assert done.usage == {"prompt_tokens": 3, "completion_tokens": 2}
    # One connection for all three answers (kept alive between them).
    assert server.connections == 1
    await provider.aclose()


def test_the_model_client_streams_on_uvloop_too() -> None:
    # covers: E5 (the ASGI app served by a server that runs uvloop, as uvicorn does: its
    # transports are no subclasses of asyncio's, and the client only uses their methods)
    import uvloop

    async def main() -> None:
        server = Server(answer(["Hel", "lo ", "there"]))
        url = await server.start()
        provider = provider_for(url)
        await answers_on_one_connection(provider, server, "Hello there")
        await provider.aclose()
        await server.stop()

    uvloop.run(main())


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
async def test_an_answer_in_odd_pieces_arrives_whole(serve, newline: bytes) -> None:
    # covers: E5 (lines split across reads, a character split across reads, any line ending)
    pieces = ["Grüße ", "aus ", "Köln 🌷", " — ", "ok"]
    _server, url = await serve(answer(pieces, step=7, newline=newline))
    provider = provider_for(url)
    deltas, done = await collect(provider)
    assert "".join(deltas) == done.text == "".join(pieces)
    await provider.aclose()


def raw_answer(events: list[bytes]) -> Respond:
    """A responder: these event payloads as they are, then `[DONE]`."""

    async def respond(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        data = b"".join(b"data: " + e + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        writer.write(head(len(data)) + data)
        await writer.drain()
        return True

    return respond


async def test_events_only_the_json_module_reads_still_stream_whole(serve) -> None:
    # covers: E5 (events are parsed in C; what that parser refuses and Python's json module
    # reads, as servers write it, is read as before: NaN in a field the client does not use,
    # an integer past 64 bits, a surrogate pair written as escapes)
    def delta(content: str, extra: str = "") -> bytes:
        text = json.dumps(content)  # non-ASCII as \u escapes
        return (
            f'{{{extra}"choices":[{{"index":0,"delta":{{"content":{text}}},'
            '"finish_reason":null}]}'
        ).encode()

    events = [
        delta("caf\u00e9 "),
        delta("\U0001f600 ", extra='"logprobs":NaN,'),
        delta("fine", extra=f'"created":{2**70},'),
        b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
    ]
    assert b"\\ud83d\\ude00" in events[1]
    _server, url = await serve(raw_answer(events))
    provider = provider_for(url)
    deltas, done = await collect(provider)
    assert "".join(deltas) == done.text == "caf\u00e9 \U0001f600 fine"
    assert done.finish_reason == "stop"
    await provider.aclose()


@pytest.mark.parametrize("event", [b'{"choices": [', b"not json", b"[1, 2]", b"\xff\xfe{}"])
async def test_an_event_that_is_no_json_object_fails_the_answer_clearly(serve, event) -> None:
    # covers: E5, C10 (malformed data from the model server is never text)
    _server, url = await serve(raw_answer([event]))
    provider = provider_for(url)
    assert await failure_of(provider) == "bad_response"
    await provider.aclose()


async def test_a_connection_the_server_closed_is_not_reused(serve) -> None:
    # covers: E5, G5 (an idle kept-alive connection that the server ended is replaced)
    server, url = await serve(answer(["one"], keep=False))
    provider = provider_for(url)
    assert (await collect(provider))[1].text == "one"
    await asyncio.sleep(0.05)  # the server's close reaches the client
    assert (await collect(provider))[1].text == "one"
    assert server.connections == 2
    await provider.aclose()


async def test_an_answer_larger_than_the_read_buffer_arrives_whole(serve) -> None:
    # covers: E5 (reading pauses past the high-water mark and resumes; nothing is lost)
    pieces = [f"{i:06d}" + "x" * 994 for i in range(2 * HIGH_WATER // 1000)]
    _server, url = await serve(answer(pieces))
    provider = provider_for(url)
    deltas, done = await collect(provider)
    assert done.text == "".join(pieces)
    assert "".join(deltas) == done.text
    await provider.aclose()


async def test_a_server_that_stalls_mid_answer_times_out(serve) -> None:
    # covers: E5, C10 (the read timeout holds on this layer too: the turn fails `timeout`)
    data = event_stream(["never", "finished"])
    _server, url = await serve(writes_then_stalls(head(len(data)) + data[:40], 5))
    provider = provider_for(url, read_timeout=0.3)
    assert await failure_of(provider) == "timeout"
    await provider.aclose()


async def test_an_unreachable_server_is_a_connection_error() -> None:
    # covers: E5, C10
    provider = provider_for(f"http://127.0.0.1:{free_port()}/v1")
    assert await failure_of(provider) == "connection"
    await provider.aclose()


def _self_signed(folder: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a certificate for 127.0.0.1 and a client context trusting it."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert_file, key_file)
    client = ssl.create_default_context(cafile=str(cert_file))
    return server, client


async def test_answers_stream_over_tls(serve, tmp_path: Path) -> None:
    # covers: E5 (a model server behind https, as every hosted one is)
    server_tls, client_tls = _self_signed(tmp_path)
    server, url = await serve(answer(["sec", "ure"], step=5), tls=server_tls)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=2)
    provider = provider_for(url, transport=ModelTransport(limits=limits, verify=client_tls))
    await answers_on_one_connection(provider, server, "secure")
    await provider.aclose()


async def test_a_certificate_the_client_does_not_trust_is_refused(serve, tmp_path: Path) -> None:
    # covers: E5, F8 (no silent downgrade: an unknown certificate fails the connection)
    server_tls, _client_tls = _self_signed(tmp_path)
    _server, url = await serve(answer(["no"]), tls=server_tls)
    provider = provider_for(url)
    assert await failure_of(provider) == "connection"
    await provider.aclose()


def test_a_proxy_in_the_environment_keeps_httpx_s_own_transport(monkeypatch) -> None:
    # covers: E5 (HTTPS_PROXY and NO_PROXY are honoured as httpx honours them)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=2)
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    assert isinstance(
        provider_transport("https://api.example.com/v1", limits=limits), ModelTransport
    )
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example.com:3128")
    assert provider_transport("https://api.example.com/v1", limits=limits) is None
    monkeypatch.setenv("NO_PROXY", "api.example.com")
    assert isinstance(
        provider_transport("https://api.example.com/v1", limits=limits), ModelTransport
    )


async def test_a_model_request_goes_through_the_proxy_the_environment_names(
    fake_model, monkeypatch
) -> None:
    # covers: E5 (with a proxy in the environment the model request goes to it; without, to
    # the model server itself, on our own transport)
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    messages = [{"role": "user", "content": "hi"}]
    fake_model.script(Reply(text="straight"), Reply(text="by the proxy"))
    direct = OpenAIProvider(base_url=fake_model.url, model="m", api_key="sk-direct")
    assert await complete_text(direct, messages, purpose="turn") == "straight"
    await direct.aclose()
    monkeypatch.setenv("HTTP_PROXY", fake_model.url.removesuffix("/v1"))
    proxied = OpenAIProvider(base_url="http://model.invalid/v1", model="m", api_key="sk-proxy")
    assert await complete_text(proxied, messages, purpose="turn") == "by the proxy"
    await proxied.aclose()
    first, second = fake_model.requests
    assert first.target == "/v1/chat/completions"
    assert first.headers["authorization"] == "Bearer sk-direct"
    assert second.target == "http://model.invalid/v1/chat/completions"
    assert second.headers["host"] == "model.invalid"
    assert second.headers["authorization"] == "Bearer sk-proxy"
    assert first.body == second.body and first.body["stream"] is True


def test_event_lines_are_read_whatever_their_ending() -> None:
    # covers: E5 (server-sent events: CRLF, LF or CR; comments and other fields ignored)
    payloads, rest = sse_payloads(
        b'data: {"a":1}\r\n\r\n: ping\n\nevent: x\rdata:{"b":2}\r\rdata: {"c"'
    )
    assert payloads == [b'{"a":1}', b'{"b":2}']
    assert rest == b'data: {"c"'
    payloads, rest = sse_payloads(rest + b":3}\n\ndata: [DONE]\n\n")
    assert payloads == [b'{"c":3}']
    assert rest == b""


def chunked(data: bytes, *, size: int = 0, extension: bytes = b"") -> bytes:
    """`data` as a chunked body: one chunk per event (as model servers send them), or chunks
    of `size` bytes; then the last chunk and a trailer."""
    parts = data.split(b"\n\n")
    pieces = (
        [p + b"\n\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
        if not size
        else [data[i : i + size] for i in range(0, len(data), size)]
    )
    out = b"".join(b"%x%s\r\n%s\r\n" % (len(p), extension, p) for p in pieces)
    return out + b"0\r\nX-Trailer: ignored\r\n\r\n"


CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def answer_chunked(pieces: list[str], *, step: int = 0, size: int = 0, extension: bytes = b""):
    """A responder: the stream of `pieces` as a chunked body, `step` bytes a write."""

    async def respond(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        data = CHUNKED_HEAD + chunked(event_stream(pieces), size=size, extension=extension)
        for start in range(0, len(data), step or len(data)):
            writer.write(data[start : start + (step or len(data))])
            await writer.drain()
            if step:
                await asyncio.sleep(0)
        return True

    return respond


@pytest.mark.parametrize(("step", "size"), [(1, 0), (5, 0), (0, 0), (0, 3), (13, 7)])
async def test_a_chunked_answer_arrives_whole_however_its_bytes_are_split(
    serve, step: int, size: int
) -> None:
    # covers: E5 (the transport's own HTTP/1.1 reading: chunk sizes, data and ends split
    # across reads at any byte, chunk extensions and trailers skipped, the connection kept)
    pieces = ["Grüße ", "aus ", "Köln 🌷", " — ", "ok"]
    server, url = await serve(answer_chunked(pieces, step=step, size=size, extension=b";a=b"))
    provider = provider_for(url)
    for _ in range(2):
        deltas, done = await collect(provider)
        assert "".join(deltas) == done.text == "".join(pieces)
        assert done.usage == {"prompt_tokens": 3, "completion_tokens": 2}
    assert server.connections == 1
    await provider.aclose()


async def test_events_that_arrive_together_are_one_step_of_the_loop(serve) -> None:
    # covers: F7 (issue 10: a busy loop reads several events of a stream at once, and the
    # engine gets them as one delta, not one loop step per event)
    pieces = [f"w{i} " for i in range(200)]
    _server, url = await serve(answer_chunked(pieces))
    provider = provider_for(url)
    deltas, done = await collect(provider)
    assert "".join(deltas) == done.text == "".join(pieces)
    assert len(deltas) < 20, len(deltas)
    await provider.aclose()


@pytest.mark.parametrize(
    "broken",
    [
        b"zz\r\ndata: {}\r\n",  # not a chunk size
        b"4\r\ndata: {}\r\n",  # more data than the size said
        b"0x4\r\ndata\r\n",  # a size with a prefix
    ],
)
async def test_a_malformed_chunked_answer_is_a_clear_error(serve, broken: bytes) -> None:
    # covers: E5, C10, I3 (bad bytes from the model server fail the turn, they are never
    # text; a malformed answer is `bad_response`, which a retry would not fix)
    _server, url = await serve(writes_then_stalls(CHUNKED_HEAD + broken, 1))
    provider = provider_for(url, read_timeout=5)
    assert await failure_of(provider) == "bad_response"
    await provider.aclose()


async def test_an_answer_cut_off_mid_chunk_fails_and_its_connection_is_not_reused(serve) -> None:
    # covers: E5, G5 (the server went away mid-answer: an error, never a short answer)
    async def respond(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        data = CHUNKED_HEAD + chunked(event_stream(["half ", "an answer"]))
        writer.write(data[: len(data) // 2])
        await writer.drain()
        return False

    server, url = await serve(respond)
    provider = provider_for(url)
    for _ in range(2):
        assert await failure_of(provider) == "connection"
    assert server.connections == 2
    await provider.aclose()


async def test_an_error_status_with_a_chunked_body_is_read_and_the_connection_kept(serve) -> None:
    # covers: E5 (a 429's body is read whole and classified; the connection is reused)
    error = json.dumps({"error": {"message": "slow down", "type": "rate_limit"}}).encode()
    calls = 0

    async def respond(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            writer.write(
                b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + chunked(error, size=10)
            )
        else:
            data = event_stream(["fine"])
            writer.write(head(len(data)) + data)
        await writer.drain()
        return True

    server, url = await serve(respond)
    provider = provider_for(url)
    assert await failure_of(provider) == "rate_limited"
    assert (await collect(provider))[1].text == "fine"
    assert server.connections == 1
    await provider.aclose()


async def test_more_answers_stream_at_once_than_the_keep_alive_pool_holds(serve) -> None:
    # covers: F7, STYLE 6 (issue 10 item 1: no cap on connections below the engine's own
    # bound; the keep-alive pool stays small)
    width = 30
    everyone = asyncio.Event()

    async def respond(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        if len(server.requests) == width:
            everyone.set()
        await asyncio.wait_for(everyone.wait(), 10)  # each answer waits for all requests
        data = event_stream(["at ", "once"])
        writer.write(head(len(data)) + data)
        await writer.drain()
        return True

    server, url = await serve(respond)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=2)
    provider = provider_for(url, transport=ModelTransport(limits=limits))
    done = await asyncio.gather(*(collect(provider) for _ in range(width)))
    assert [c.text for _d, c in done] == ["at once"] * width
    assert server.connections == width
    # Two of them are kept for the next answers; the next answer reuses one.
    assert (await collect(provider))[1].text == "at once"
    assert server.connections == width
    await provider.aclose()
