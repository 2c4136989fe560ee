"""What `serve` puts in front of Django (issue 56 rows 9 and 13; SPEC F3, F8), through a real
`serve` process: a request body over CHAT_REQUEST_BODY_MAX_BYTES is refused with 413 before
it is read (declared or chunked, on any path, unauthenticated), other clients stay fast
meanwhile, and static files carry the same security headers as pages. Memory before and
after is measured in bench/hostile_bench.py."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from sessions_app.management.edge import QuietSocket
from tests.procs import ServeProcess, embedded_env, migrate_embedded

pytestmark = pytest.mark.slow

CAP = 256 * 1024
IMPORT_CAP = 2 * 1024 * 1024


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    var_dir = tmp_path_factory.mktemp("edges")
    env = embedded_env(
        var_dir, CHAT_REQUEST_BODY_MAX_BYTES=str(CAP), CHAT_IMPORT_MAX_BYTES=str(IMPORT_CAP)
    )
    migrate_embedded(env)
    with ServeProcess(var_dir, env) as server:
        yield server


def raw_request(server: ServeProcess, head: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(head)
    return sock


def read_status(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n" not in data:
        part = sock.recv(4096)
        if not part:
            break
        data += part
    return data.split(b"\r\n", 1)[0]


def fast_health(server: ServeProcess) -> float:
    started = time.monotonic()
    assert httpx.get(f"{server.base}/healthz", timeout=10).status_code == 200
    return time.monotonic() - started


@pytest.mark.parametrize("path", ["/accounts/login/", "/api/v1/sessions", "/no/such/path"])
def test_a_declared_huge_body_is_refused_before_it_is_sent(served: ServeProcess, path: str) -> None:
    # covers: F3 (issue 56 row 9: a 200 MB body was read whole before Django refused it)
    sock = raw_request(
        served,
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {200 * 1024 * 1024}\r\n\r\n".encode(),
    )
    try:
        assert read_status(sock) == b"HTTP/1.1 413 Content Too Large"
        assert fast_health(served) < 2.0
    finally:
        sock.close()


def test_the_refusal_speaks_the_client_s_language(served: ServeProcess) -> None:
    # covers: F3, F5 (the 413 is the REST error shape, in English or Chinese)
    for accept, message in (
        ("zh-CN,zh;q=0.9", "请求体过大。"),
        ("fr, en;q=0.5", "The request body is too large."),
    ):
        sock = raw_request(
            served,
            f"POST /api/v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept-Language: {accept}"
            f"\r\nContent-Length: {10 * CAP}\r\n\r\n".encode(),
        )
        try:
            data = b""
            while not data.endswith(b"}"):
                part = sock.recv(4096)
                if not part:
                    break
                data += part
        finally:
            sock.close()
        body = json.loads(data.split(b"\r\n\r\n", 1)[1])
        assert body == {"code": "too_large", "message": message}


def test_a_chunked_body_is_refused_once_it_passes_the_cap(served: ServeProcess) -> None:
    # covers: F3 (a body of no declared length is counted as it arrives)
    sock = raw_request(
        served,
        b"POST /accounts/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/x-www-form-urlencoded\r\nTransfer-Encoding: chunked\r\n\r\n",
    )
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b"a" * 64 * 1024)
    sent = 0
    try:
        try:
            while sent < 200 * 1024 * 1024:
                sock.sendall(chunk)
                sent += 64 * 1024
        except OSError:
            pass  # the server closed the connection after its answer
        assert read_status(sock) == b"HTTP/1.1 413 Content Too Large"
        assert sent < 64 * 1024 * 1024, sent
        assert fast_health(served) < 2.0
    finally:
        sock.close()


def test_a_body_under_the_cap_reaches_django(served: ServeProcess) -> None:
    # covers: F3 (the cap refuses only what is over it: here Django's CSRF check answers)
    response = httpx.post(
        f"{served.base}/accounts/login/", data={"username": "x", "password": "y" * 1000}
    )
    assert response.status_code == 403


def test_an_import_has_its_own_larger_cap(served: ServeProcess) -> None:
    # covers: H2, F3 (a dialog's import takes up to CHAT_IMPORT_MAX_BYTES; every other path
    # keeps the request cap)
    body = b'{"format": "chatcore.dialog.v1", "messages": []}'.ljust(1024 * 1024)
    response = httpx.post(
        f"{served.base}/api/v1/sessions/import",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 401  # reached Django: no login, not 413
    response = httpx.post(
        f"{served.base}/api/v1/sessions", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413
    sock = raw_request(
        served,
        b"POST /api/v1/sessions/import HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (IMPORT_CAP + 1),
    )
    try:
        assert read_status(sock) == b"HTTP/1.1 413 Content Too Large"
    finally:
        sock.close()


@pytest.mark.parametrize("path", ["/static/chat/app.js", "/static/chat/base.css"])
def test_static_files_carry_the_page_security_headers(served: ServeProcess, path: str) -> None:
    # covers: F8 (issue 56 row 13: static files came without nosniff and CSP)
    response = httpx.get(f"{served.base}{path}", timeout=10)
    page = httpx.get(f"{served.base}/accounts/login/", timeout=10)
    assert response.status_code == 200
    for name in (
        "content-security-policy",
        "x-content-type-options",
        "x-frame-options",
        "referrer-policy",
    ):
        assert response.headers[name] == page.headers[name], name
    assert response.headers["x-content-type-options"] == "nosniff"
    assert "script-src 'self'" in response.headers["content-security-policy"]


def test_the_page_headers_are_not_doubled(served: ServeProcess) -> None:
    # covers: F8 (Django's pages keep their own headers, once)
    page = httpx.get(f"{served.base}/accounts/login/", timeout=10)
    assert len(page.headers.get_list("content-security-policy")) == 1
    assert len(page.headers.get_list("x-content-type-options")) == 1


def test_a_socket_takes_its_factory_s_options_without_formatting_them(monkeypatch) -> None:
    # covers: F3 (issue 57: a connect's CPU). Autobahn formats its options for a debug log on
    # every connect; `QuietSocket` copies them first so that nothing is left to format. Fails if an
    # autobahn upgrade stops reading `CONFIG_ATTRS` there (SPEC I2).
    import autobahn.websocket.protocol as autobahn_protocol
    from daphne.ws_protocol import WebSocketFactory
    from twisted.internet.address import IPv4Address
    from twisted.internet.testing import StringTransport

    formatted: list[object] = []

    def pformat(value: object) -> str:
        formatted.append(value)
        return ""

    monkeypatch.setattr(autobahn_protocol, "pformat", pformat)
    factory = WebSocketFactory(object(), server="Daphne")
    factory.setProtocolOptions(autoPingTimeout=7, maxMessagePayloadSize=99, openHandshakeTimeout=0)
    factory.protocol = QuietSocket
    socket = factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 5000))
    socket.makeConnection(StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 5001)))
    assert (socket.autoPingTimeout, socket.maxMessagePayloadSize) == (7, 99)
    assert formatted == [[]]  # autobahn's loop found every option already copied
    for name in autobahn_protocol.WebSocketServerProtocol.CONFIG_ATTRS:
        assert getattr(socket, name) == getattr(factory, name), name
