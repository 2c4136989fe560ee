"""Uploads against a real `serve` process (H3, F3): an upload declared over the limit is
answered 413 by the ASGI guard, and a real multipart upload round-trips."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.fakemodel import FakeModelServer
from tests.file_helpers import png_bytes
from tests.test_api_sse import LiveApi, serve_api

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApi]:
    model = FakeModelServer().start()
    try:
        with serve_api(
            tmp_path_factory.mktemp("files-live"), model.url, CHAT_UPLOAD_MAX_BYTES="100000"
        ) as server:
            yield server
    finally:
        model.stop()


def test_an_upload_declared_too_large_is_refused_unparsed(live: LiveApi) -> None:
    # covers: H3, F3 (Daphne's Twisted takes the body in before the application is called;
    # the guard then answers without Django reading or parsing it)
    address = urlsplit(live.base)
    body = b"--xyz\r\n" + b"a" * 200_000
    with socket.create_connection((address.hostname, address.port), timeout=10) as conn:
        conn.sendall(
            (
                "POST /api/v1/files HTTP/1.1\r\n"
                f"Host: {address.netloc}\r\n"
                f"Authorization: Bearer {live.token}\r\n"
                "Content-Type: multipart/form-data; boundary=xyz\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        answer = b""
        while not answer.rstrip().endswith(b"}"):
            chunk = conn.recv(4096)
            if not chunk:
                break
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert json.loads(payload)["code"] == "too_large"


def test_a_multipart_upload_round_trips(live: LiveApi, tmp_path: Path) -> None:
    # covers: H3
    data = png_bytes((32, 32), "teal")
    with live.client() as http:
        created = http.post("/files", files={"file": ("teal.png", data, "image/png")})
        assert created.status_code == 201, created.text
        file_id = created.json()["file_id"]
        fetched = http.get(f"/files/{file_id}")
        assert fetched.status_code == 200 and fetched.content == data
        too_big = http.post("/files", files={"file": ("big.txt", b"a" * 100_001, "text/plain")})
        assert too_big.status_code == 413
    assert "Traceback" not in live.log.read_text()
