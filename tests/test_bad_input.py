"""Bad input is the client's fault, never a server fault (SPEC F8, F3): a WebSocket frame of
deep nesting answers `bad_request` (no `internal_error`, no traceback logged); a REST body of
deep nesting answers 400 `bad_request`; a chunked REST body over Django's upload limit answers
the JSON 413 `too_large` rather than Django's HTML 400. Through the real ASGI application."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import ApplicationCommunicator, WebsocketCommunicator
from django.test import override_settings

from chatcore.asgi import application
from sessions_app import services
from sessions_app.frames import MAX_NESTING, too_deep
from sessions_app.models import Message, Turn

pytestmark = [pytest.mark.django_db(transaction=True)]


async def open_socket(user: Any) -> WebsocketCommunicator:
    _token, raw = await sync_to_async(services.api_token_issue)(user=user, name="t")
    comm = WebsocketCommunicator(
        application, "/ws/chat/", headers=[(b"authorization", f"Bearer {raw}".encode())]
    )
    connected, _ = await comm.connect(timeout=10)
    assert connected
    for expected in ("sessions", "session_history"):
        assert json.loads(await comm.receive_from(10))["type"] == expected
    return comm


@pytest.mark.parametrize(
    "frame",
    [
        "[" * 50_000,
        "[" * 50_000 + "]" * 50_000,
        '{"type": "send", "content": "x", "extra": ' + "[" * 50_000 + "]" * 50_000 + "}",
        '{"type": "send", "content": "x", "extra": ' + '{"a":' * 5_000 + "1" + "}" * 5_000 + "}",
        '{"type": ' + "[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1) + "}",
    ],
    ids=["open-brackets", "balanced-brackets", "deep-field", "deep-objects", "just-too-deep"],
)
async def test_deeply_nested_frame_is_bad_request(
    engine: Any, user: Any, frame: str, caplog: pytest.LogCaptureFixture
) -> None:
    # covers: F8 (bad frames answer bad_request, never internal_error), F3
    comm = await open_socket(user)
    try:
        with caplog.at_level(logging.WARNING):
            await comm.send_to(text_data=frame)
            answer = json.loads(await comm.receive_from(10))
        assert answer["type"] == "error" and answer["code"] == "bad_request", answer
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        # The socket still works and nothing was written.
        await comm.send_json_to({"type": "sessions", "client_msg_id": "after"})
        assert json.loads(await comm.receive_from(10))["client_msg_id"] == "after"
        assert await sync_to_async(Turn.objects.count)() == 0
    finally:
        await comm.disconnect()


def test_brackets_inside_strings_do_not_count() -> None:
    # covers: F8 (a message about code full of brackets is an ordinary frame)
    content = "[" * 10_000 + "{" * 10_000
    frame = json.dumps({"type": "send", "content": content})
    assert not too_deep(frame)
    assert too_deep('{"a": ' + "[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1) + "}")
    assert not too_deep('{"a": ' + "[" * (MAX_NESTING - 1) + "]" * (MAX_NESTING - 1) + "}")


async def test_a_frame_full_of_brackets_in_its_content_is_sent(
    engine: Any, user: Any, fake_model: Any
) -> None:
    # covers: F8, F3 (the nesting check does not refuse legitimate text)
    comm = await open_socket(user)
    try:
        content = "[[{{" * 100
        await comm.send_json_to({"type": "send", "content": content, "client_msg_id": "ok"})
        answer = json.loads(await comm.receive_from(10))
        assert answer["type"] == "queued" and answer["client_msg_id"] == "ok", answer
    finally:
        await comm.disconnect()


async def http(
    path: str, chunks: list[bytes], headers: list[tuple[bytes, bytes]]
) -> tuple[int, dict[str, str], bytes]:
    """One request through the ASGI app, its body sent in `chunks` without a Content-Length
    (a chunked upload, as Daphne hands it over)."""
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "scheme": "http",
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 5000),
        "headers": [(b"host", b"testserver"), (b"transfer-encoding", b"chunked"), *headers],
    }
    comm = ApplicationCommunicator(application, scope)
    for i, chunk in enumerate(chunks):
        await comm.send_input(
            {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        )
    start = await comm.receive_output(timeout=30)
    assert start["type"] == "http.response.start"
    body = b""
    while True:
        message = await comm.receive_output(timeout=30)
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await comm.wait(timeout=10)
    response_headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], response_headers, body


@pytest.mark.parametrize("upload_limit", [None, 100_000])
async def test_chunked_body_over_the_limit_is_a_json_413(
    engine: Any, user: Any, upload_limit: int | None
) -> None:
    # covers: F8 (oversize chunked REST bodies answer a JSON 413), F3
    session = await sync_to_async(services.session_create)(
        owner=user, channel="api", chat_id=f"u{user.pk}", dialog_id="big"
    )
    _token, raw = await sync_to_async(services.api_token_issue)(user=user, name="t")
    body = json.dumps({"content": "a" * 3_000_000}).encode()
    chunks = [body[i : i + 65_536] for i in range(0, len(body), 65_536)]
    headers = [
        (b"authorization", f"Bearer {raw}".encode()),
        (b"content-type", b"application/json"),
    ]
    changes = {} if upload_limit is None else {"DATA_UPLOAD_MAX_MEMORY_SIZE": upload_limit}
    with override_settings(**changes):
        status, response_headers, content = await http(
            f"/api/v1/sessions/{session.session_id}/messages", chunks, headers
        )
    assert status == 413, content[:300]
    assert response_headers["content-type"].startswith("application/json")
    assert json.loads(content)["code"] == "too_large"
    assert await sync_to_async(Turn.objects.count)() == 0
    assert await sync_to_async(Message.objects.filter(session=session).count)() == 1  # welcome


async def test_deeply_nested_rest_body_is_bad_request(
    engine: Any, user: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # covers: F8, F3
    session = await sync_to_async(services.session_create)(
        owner=user, channel="api", chat_id=f"u{user.pk}", dialog_id="deep"
    )
    _token, raw = await sync_to_async(services.api_token_issue)(user=user, name="t")
    body = b'{"content": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    headers = [
        (b"authorization", f"Bearer {raw}".encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    with caplog.at_level(logging.WARNING):
        status, _headers, content = await http(
            f"/api/v1/sessions/{session.session_id}/messages", [body], headers
        )
    assert status == 400, content[:300]
    assert json.loads(content)["code"] == "bad_request"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
