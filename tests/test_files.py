"""Files and images (SPEC H3, PROTOCOL "Files and images"): upload through the real API,
kinds decided by bytes, owner-only download, attachments on a send (REST and WebSocket) and
in the model request, the model server refusing images, purge and the sweep of unused
uploads. Storage is a temporary folder through Django's storage API."""

from __future__ import annotations

import base64
import io
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient
from django.utils import timezone

from sessions_app import files, services
from sessions_app.models import File, Message, Session
from sessions_app.upload_guard import UploadGuard
from tests.api_helpers import Api, bearer_api, chat_cfg, engine_with, error_of
from tests.fakemodel import Reply
from tests.file_helpers import (
    encrypted_pdf,
    png_bytes,
    stored_files,
    text_pdf,
    upload,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


@pytest.fixture(autouse=True)
def storage_dir(settings: Any, tmp_path: Path) -> Path:
    folder = tmp_path / "files"
    settings.STORAGES = {
        **settings.STORAGES,
        "default": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(folder)},
        },
    }
    return folder


async def _session(session_id: str) -> Session:
    channel, chat_id, dialog_id = session_id.split(":")
    return await Session.objects.aget(channel=channel, chat_id=chat_id, dialog_id=dialog_id)


def _user_message(request: Any) -> dict[str, Any]:
    return [m for m in request.messages if m["role"] == "user"][-1]


# --- Upload: kinds by bytes -------------------------------------------------------------------


async def test_upload_an_image_measures_it_and_makes_a_thumbnail(
    api: Api, storage_dir: Path
) -> None:
    # covers: H3
    data = png_bytes((64, 48))
    status, body = await upload(api, "photo.png", data)
    assert status == 201, body
    assert body["kind"] == "image" and body["content_type"] == "image/png"
    assert body["name"] == "photo.png" and body["size"] == len(data)
    row = await File.objects.aget(pk=body["file_id"])
    assert (row.width, row.height) == (64, 48)
    assert row.checksum == __import__("hashlib").sha256(data).hexdigest()
    assert len(stored_files(storage_dir)) == 2  # the bytes and the thumbnail

    _, _, response = await api.call("GET", f"/files/{body['file_id']}")
    assert response.status_code == 200
    assert b"".join([c async for c in response.streaming_content]) == data
    assert response["Content-Type"] == "image/png"
    assert response["Content-Disposition"].startswith("inline")

    _, _, thumb = await api.call("GET", f"/files/{body['file_id']}", {"thumbnail": "1"})
    assert thumb["Content-Type"] == "image/jpeg"
    from PIL import Image

    image = Image.open(io.BytesIO(b"".join([c async for c in thumb.streaming_content])))
    assert image.format == "JPEG" and max(image.size) <= 320


@pytest.mark.parametrize(
    ("fmt", "content_type"),
    [("JPEG", "image/jpeg"), ("GIF", "image/gif"), ("WEBP", "image/webp")],
)
async def test_every_image_format_is_known_by_its_bytes(
    api: Api, fmt: str, content_type: str
) -> None:
    # covers: H3 (the name says PNG; the bytes decide)
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (24, 16), "white").save(out, format=fmt)
    status, body = await upload(api, "misnamed.png", out.getvalue())
    assert status == 201, body
    assert (body["kind"], body["content_type"]) == ("image", content_type)


async def test_text_and_pdf_uploads_keep_their_text(api: Api) -> None:
    # covers: H3
    status, code = await upload(api, "main.py", "print('héllo')\n".encode())
    assert status == 201 and code["kind"] == "text", code
    assert (await File.objects.aget(pk=code["file_id"])).text == "print('héllo')\n"
    _, _, response = await api.call("GET", f"/files/{code['file_id']}")
    # Text is only ever a download of plain text, never a page of this origin.
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    assert response["Content-Disposition"].startswith("attachment")

    status, pdf = await upload(api, "report.pdf", text_pdf("Quarterly figures"))
    assert status == 201 and pdf["kind"] == "document", pdf
    assert pdf["content_type"] == "application/pdf"
    assert "Quarterly figures" in (await File.objects.aget(pk=pdf["file_id"])).text


async def test_an_executable_named_png_is_415_and_nothing_is_stored(
    api: Api, storage_dir: Path
) -> None:
    # covers: H3
    status, body = await upload(api, "cat.png", b"\x7fELF\x02\x01\x01\x00" + bytes(200))
    error_of(status, body, 415, "unsupported_type")
    status, body = await upload(api, "notes.txt", "caf\u00e9".encode("latin-1"))
    error_of(status, body, 415, "unsupported_type")
    assert "UTF-8" in body["message"]
    assert await File.objects.acount() == 0
    assert stored_files(storage_dir) == []


@pytest.mark.parametrize(
    ("name", "data", "words"),
    [
        ("broken.png", png_bytes((50, 50))[:60], "damaged"),
        ("locked.pdf", encrypted_pdf(), "encrypted"),
        ("broken.pdf", b"%PDF-1.4\n1 0 obj << /Type /Catalog", "damaged"),
    ],
)
async def test_damaged_images_and_encrypted_or_broken_pdfs_are_refused_clearly(
    api: Api, storage_dir: Path, name: str, data: bytes, words: str
) -> None:
    # covers: H3
    status, body = await upload(api, name, data)
    error_of(status, body, 422, "bad_request")
    assert words in body["message"]
    assert await File.objects.acount() == 0
    assert stored_files(storage_dir) == []


async def test_a_decompression_bomb_is_refused(api: Api) -> None:
    # covers: H3
    from PIL import Image

    out = io.BytesIO()
    Image.new("1", (8000, 8000)).save(out, format="PNG")  # 64 million pixels, a few KB
    status, body = await upload(api, "bomb.png", out.getvalue())
    error_of(status, body, 422, "bad_request")
    assert "too large to open" in body["message"]


async def test_over_the_limit_is_413(api: Api, make_engine: Any) -> None:
    # covers: H3, F3
    with chat_cfg(UPLOAD_MAX_BYTES=1000):
        status, body = await upload(api, "big.txt", b"a" * 70_000)
        error_of(status, body, 413, "too_large")
        # Under the multipart room but over the file limit: refused by the file's size.
        status, body = await upload(api, "big.txt", b"a" * 1500)
        error_of(status, body, 413, "too_large")
    assert await File.objects.acount() == 0


async def test_the_asgi_guard_refuses_a_declared_oversized_upload_unread() -> None:
    # covers: H3 (413 before the body is read)
    reached, received, sent = [], [], []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope)

    async def receive() -> dict[str, Any]:
        received.append(1)
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/api/v1/files",
        "headers": [(b"content-length", b"999999999")],
    }
    await UploadGuard(app)(scope, receive, send)
    assert not reached and not received
    assert sent[0]["status"] == 413 and b"too_large" in sent[1]["body"]
    await UploadGuard(app)({**scope, "headers": [(b"content-length", b"10")]}, receive, send)
    assert len(reached) == 1


async def test_download_is_for_the_owner_only(api: Api, other_user: Any) -> None:
    # covers: H3, F2
    _, body = await upload(api, "a.txt", b"mine")
    other = await bearer_api(other_user)
    status, data, _ = await other.call("GET", f"/files/{body['file_id']}")
    error_of(status, data, 404, "not_found")
    status, data, _ = await other.call("GET", "/files/not-a-uuid")
    error_of(status, data, 404, "not_found")
    anonymous = Api(AsyncClient())
    status, data, _ = await anonymous.call("GET", f"/files/{body['file_id']}")
    error_of(status, data, 401, "unauthorized")
    status, data = await upload(anonymous, "b.txt", b"theirs")
    error_of(status, data, 401, "unauthorized")


# --- Attachments on a send --------------------------------------------------------------------


async def test_a_send_gives_the_model_the_image_and_the_files_text(
    api: Api, fake_model: Any
) -> None:
    # covers: H3
    image = png_bytes((20, 20), "blue")
    _, img = await upload(api, "blue.png", image)
    _, code = await upload(api, "util.py", b"def add(a, b):\n    return a + b\n")
    _, pdf = await upload(api, "memo.pdf", text_pdf("Meeting at noon"))
    s = await api.create(dialog_id="files")
    fake_model.script(Reply(text="I see a blue square."))
    ack = await api.send(
        s["session_id"],
        "What is in these?",
        attachments=[img["file_id"], code["file_id"], pdf["file_id"]],
    )
    turn = await api.turn_done(ack["turn_id"])
    assert turn["status"] == "completed", turn

    parts = _user_message(fake_model.turn_requests()[-1])["content"]
    assert parts[0]["type"] == "text" and parts[0]["text"].startswith("What is in these?")
    url = parts[1]["image_url"]["url"]
    assert parts[1]["type"] == "image_url" and url.startswith("data:image/png;base64,")
    assert base64.b64decode(url.split(",", 1)[1]) == image
    assert parts[2] == {
        "type": "text",
        "text": "File: util.py\n\ndef add(a, b):\n    return a + b\n",
    }
    assert parts[3]["text"].startswith("File: memo.pdf") and "Meeting at noon" in parts[3]["text"]

    user_message = turn["messages"][0]
    assert user_message["content"] == "What is in these?"
    assert [a["file_id"] for a in user_message["attachments"]] == [
        img["file_id"],
        code["file_id"],
        pdf["file_id"],
    ]
    assert user_message["attachments"][0] == {
        "file_id": img["file_id"],
        "name": "blue.png",
        "size": len(image),
        "content_type": "image/png",
        "kind": "image",
    }
    assert "attachments" not in user_message.get("source", {})
    _, page = await api.get(f"/sessions/{s['session_id']}/messages")
    assert page["messages"][1]["attachments"] == user_message["attachments"]


async def test_a_later_turn_read_from_the_database_still_sends_the_parts(
    api: Api, fake_model: Any, make_engine: Any
) -> None:
    # covers: H3, A5 (a process that never held the dialog reads its attachments back)
    image = png_bytes((12, 12), "navy")
    _, img = await upload(api, "navy.png", image)
    s = await api.create(dialog_id="cold")
    fake_model.script(Reply(text="navy"))
    ack = await api.send(s["session_id"], "colour?", attachments=[img["file_id"]])
    await api.turn_done(ack["turn_id"])
    async with engine_with(make_engine):
        fake_model.script(Reply(text="still navy"))
        ack = await api.send(s["session_id"], "and now?")
        assert (await api.turn_done(ack["turn_id"]))["status"] == "completed"
    users = [m for m in fake_model.turn_requests()[-1].messages if m["role"] == "user"]
    first = users[0]["content"]
    assert first[0] == {"type": "text", "text": "colour?"}
    assert base64.b64decode(first[1]["image_url"]["url"].split(",", 1)[1]) == image
    assert users[1]["content"].startswith("and now?")


async def test_an_image_alone_may_be_sent_without_text(
    api: Api, connect: Any, fake_model: Any, user: Any
) -> None:
    # covers: H3
    _, img = await upload(api, "x.png", png_bytes())
    ws = await connect(user)
    fake_model.script(Reply(text="A red rectangle."))
    await ws.send({"type": "send", "content": "", "attachments": [img["file_id"]]})
    frames = await ws.until(lambda f: f["type"] == "turn_updated")
    assert frames[-1]["status"] == "completed"
    parts = _user_message(fake_model.turn_requests()[-1])["content"]
    # The runtime context block still goes on the message, as a text part of its own.
    assert parts[0]["type"] == "text" and parts[1]["type"] == "image_url"
    # Without attachments an empty message is refused, as ever.
    await ws.send({"type": "send", "content": ""})
    error = await ws.until(lambda f: f["type"] == "error")
    assert error[-1]["code"] == "bad_request"
    s = await api.create(dialog_id="img-only")
    status, body = await api.post(f"/sessions/{s['session_id']}/messages", {"content": ""})
    error_of(status, body, 422, "bad_request")


async def test_a_long_file_is_trimmed_to_the_budget_and_the_file_is_unchanged(
    api: Api, fake_model: Any, settings: Any
) -> None:
    # covers: H3, C7
    settings.LLM = {**settings.LLM, "CONTEXT_WINDOW": 4000}
    long_text = "line of text\n" * 5000
    _, doc = await upload(api, "long.txt", long_text.encode())
    s = await api.create(dialog_id="long")
    fake_model.script(Reply(text="ok"))
    ack = await api.send(s["session_id"], "summarise", attachments=[doc["file_id"]])
    assert (await api.turn_done(ack["turn_id"]))["status"] == "completed"
    parts = _user_message(fake_model.turn_requests()[-1])["content"]
    assert len(parts[1]["text"]) < 6000 and "left out" in parts[1]["text"]
    assert (await File.objects.aget(pk=doc["file_id"])).text == long_text


async def test_another_users_file_refuses_the_send_and_stores_nothing(
    api: Api, other_user: Any
) -> None:
    # covers: H3, F2
    other = await bearer_api(other_user)
    _, theirs = await upload(other, "theirs.txt", b"secret")
    s = await api.create(dialog_id="refused")
    path = f"/sessions/{s['session_id']}/messages"
    status, body = await api.post(path, {"content": "hi", "attachments": [theirs["file_id"]]})
    error_of(status, body, 422, "bad_request")
    status, body = await api.post(path, {"content": "hi", "attachments": ["x"] * 11})
    error_of(status, body, 422, "bad_request")
    status, body = await api.post(
        path, {"content": "hi", "mode": "inject", "attachments": [theirs["file_id"]]}
    )
    error_of(status, body, 422, "bad_request")
    assert await Message.objects.filter(role="user").acount() == 0


async def test_a_model_server_refusing_images_gives_a_clear_provider_error(
    api: Api, fake_model: Any
) -> None:
    # covers: H3, E5
    _, img = await upload(api, "x.png", png_bytes())
    s = await api.create(dialog_id="no-vision")
    fake_model.script(
        Reply(
            status=400,
            error={
                "error": {
                    "message": "Invalid content type. image_url is only supported by certain "
                    "models.",
                    "type": "invalid_request_error",
                }
            },
        )
    )
    ack = await api.send(s["session_id"], "look", attachments=[img["file_id"]])
    turn = await api.turn_done(ack["turn_id"])
    assert turn["status"] == "failed"
    assert turn["error"]["kind"] == "provider"
    assert "cannot see images" in turn["error"]["message"]


async def test_websocket_send_carries_attachments(
    connect: Any, fake_model: Any, user: Any, api: Api
) -> None:
    # covers: H3, D2
    _, img = await upload(api, "ws.png", png_bytes())
    ws = await connect(user)
    fake_model.script(Reply(text="seen"))
    await ws.send({"type": "send", "content": "and this?", "attachments": [img["file_id"]]})
    frames = await ws.until(lambda f: f["type"] == "turn_updated")
    delta = next(f for f in frames if f["type"] == "history_delta")
    assert delta["messages"][0]["attachments"][0]["file_id"] == img["file_id"]
    await ws.send({"type": "send", "content": "bad", "attachments": "nope"})
    error = await ws.until(lambda f: f["type"] == "error")
    assert error[-1]["code"] == "bad_request"


# --- Purge and sweep --------------------------------------------------------------------------


async def test_purge_deletes_the_files_only_that_dialog_used(
    api: Api, fake_model: Any, storage_dir: Path
) -> None:
    # covers: H3, A7
    _, only = await upload(api, "only.png", png_bytes())
    _, shared = await upload(api, "shared.txt", b"shared text")
    first = await api.create(dialog_id="one")
    second = await api.create(dialog_id="two")
    fake_model.script(Reply(text="a"), Reply(text="b"))
    ack = await api.send(
        first["session_id"], "both", attachments=[only["file_id"], shared["file_id"]]
    )
    await api.turn_done(ack["turn_id"])
    ack = await api.send(second["session_id"], "again", attachments=[shared["file_id"]])
    await api.turn_done(ack["turn_id"])
    assert len(stored_files(storage_dir)) == 3  # image, its thumbnail, the text

    session = await _session(first["session_id"])
    await sync_to_async(services.session_purge)(session=session)
    remaining = {str(pk) async for pk in File.objects.values_list("pk", flat=True)}
    assert remaining == {shared["file_id"]}
    assert len(stored_files(storage_dir)) == 1

    session = await _session(second["session_id"])
    await sync_to_async(services.session_purge)(session=session)
    assert await File.objects.acount() == 0
    assert stored_files(storage_dir) == []


async def test_unused_uploads_older_than_a_day_are_swept(
    api: Api, fake_model: Any, storage_dir: Path
) -> None:
    # covers: H3
    _, old = await upload(api, "old.txt", b"old")
    _, used = await upload(api, "used.txt", b"used")
    _, fresh = await upload(api, "fresh.txt", b"fresh")
    s = await api.create(dialog_id="sweep")
    fake_model.script(Reply(text="ok"))
    ack = await api.send(s["session_id"], "use it", attachments=[used["file_id"]])
    await api.turn_done(ack["turn_id"])
    two_days_ago = timezone.now() - timedelta(days=2)
    await File.objects.filter(pk__in=[old["file_id"], used["file_id"]]).aupdate(
        created_at=two_days_ago
    )
    assert await sync_to_async(files.files_sweep_unused)() == 1
    remaining = {str(pk) async for pk in File.objects.values_list("pk", flat=True)}
    assert remaining == {used["file_id"], fresh["file_id"]}
    assert len(stored_files(storage_dir)) == 2

    # Scaled mode: the Celery beat task of the dialog purge sweeps them too.
    from sessions_app import tasks

    await File.objects.filter(pk=fresh["file_id"]).aupdate(created_at=two_days_ago)
    await sync_to_async(tasks.purge_deleted_sessions)()
    remaining = {str(pk) async for pk in File.objects.values_list("pk", flat=True)}
    assert remaining == {used["file_id"]}


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        (
            "Invalid content type. image_url is only supported by certain models.",
            "images_unsupported",
        ),
        ("This model does not support image input.", "images_unsupported"),
        ("llama3 is not a multimodal model", "images_unsupported"),
        ("Model does not support images", "images_unsupported"),
        ("max_tokens is too large", "bad_request"),
    ],
)
def test_a_model_servers_refusal_of_images_is_told_apart(message: str, kind: str) -> None:
    # covers: H3, E5
    from chatcore.engine.provider_errors import classify_http_error

    body = json.dumps({"error": {"message": message}})
    assert classify_http_error(400, body).kind == kind
