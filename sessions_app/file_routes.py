"""The REST routes of files (SPEC H3, PROTOCOL "Files and images"): upload and owner-only
download. Thin, like `routes.py`: parse, authorise, call `files`, serialise; errors are
raised and mapped to HTTP in `api.py`. Their router is added before the app's main one,
whose last route answers every other path.

An upload's body is refused before it is read when its declared length is over the limit
(`upload_guard` on the ASGI side, `api._precheck` here); Django streams the rest to a
temporary file, never into memory, and the inspection and the copy into storage run on a
worker thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import IO, Any, cast

from asgiref.sync import sync_to_async
from django.contrib.auth.models import User
from django.core.files.storage import default_storage
from django.http import HttpRequest, StreamingHttpResponse
from django.utils.http import content_disposition_header
from ninja import File as FileParam
from ninja import Router, Status, UploadedFile

from chatcore.common.dbthreads import on_db, on_db_idempotent
from chatcore.engine import rates, runtime

from . import files
from .file_models import File, FileKind
from .schemas import ErrorOut, FileOut, ValidationErrorOut

router = Router()

CHUNK = 64 * 1024
UPLOAD_ERRORS: dict[int, Any] = {
    401: ErrorOut,
    403: ErrorOut,
    413: ErrorOut,
    415: ErrorOut,
    422: ValidationErrorOut,
    429: ErrorOut,
    503: ErrorOut,
}


def _user(request: HttpRequest) -> User:
    return cast(User, request.auth)  # type: ignore[attr-defined]


def file_out(file: File) -> dict[str, Any]:
    return file.as_ref()


@router.post(
    "/files",
    response={201: FileOut, **UPLOAD_ERRORS},
    summary="Upload a file to attach to messages",
    description="Multipart, field `file`. Its kind comes from its bytes: `image` (PNG, JPEG, "
    "GIF, WebP), `document` (PDF, its text extracted) or `text` (UTF-8). Anything else 415; "
    "over CHAT_UPLOAD_MAX_BYTES (default 20 MiB) 413; a damaged image or PDF, or an "
    "encrypted PDF, 422.",
    # Stateful clients and fuzzers follow this link from the upload (E3).
    openapi_extra={
        "responses": {
            201: {
                "links": {
                    "download_file": {
                        "operationId": "sessions_app_api_download_file",
                        "parameters": {"file_id": "$response.body#/file_id"},
                    }
                }
            }
        }
    },
)
async def upload_file(request: HttpRequest, file: FileParam[UploadedFile]) -> Status[Any]:
    user = _user(request)
    engine = await runtime.get_engine()
    await rates.acharge(user.pk, rates.WRITE, engine.cfg)
    try:
        stored = await sync_to_async(files.file_store_bytes, thread_sensitive=False)(
            stream=cast(IO[bytes], file.file), name=file.name or "", size=file.size or 0
        )
    finally:
        file.close()
    row = await on_db(files.file_create)(owner_id=user.pk, stored=stored)
    return Status(201, file_out(row))


async def _chunks(key: str) -> AsyncIterator[bytes]:
    handle = await sync_to_async(default_storage.open, thread_sensitive=False)(key, "rb")
    read = sync_to_async(handle.read, thread_sensitive=False)
    try:
        while chunk := await read(CHUNK):
            yield chunk
    finally:
        await sync_to_async(handle.close, thread_sensitive=False)()


@router.get(
    "/files/{file_id}",
    response={200: None, 401: ErrorOut, 404: ErrorOut},
    summary="Download a file (its owner only; anyone else 404)",
    description="`?thumbnail=1`: an image's thumbnail (JPEG). Images are shown inline, other "
    "files are downloads.",
    openapi_extra={"responses": {"200": {"description": "The file's bytes."}}},
)
async def download_file(
    request: HttpRequest, file_id: str, thumbnail: bool = False
) -> StreamingHttpResponse:
    user = _user(request)
    row = await on_db_idempotent(files.file_get_for_owner)(owner_id=user.pk, file_id=file_id)
    if thumbnail and row.thumbnail_key:
        response = StreamingHttpResponse(_chunks(row.thumbnail_key), content_type="image/jpeg")
    else:
        image = row.kind == FileKind.IMAGE
        # Only the image types Pillow verified are ever shown by the browser; everything
        # else is a download, text as plain text (never HTML of this origin).
        content_type = (
            row.content_type
            if image or row.kind == FileKind.DOCUMENT
            else "text/plain; charset=utf-8"
        )
        response = StreamingHttpResponse(_chunks(row.storage_key), content_type=content_type)
        response["Content-Length"] = str(row.size)
        response["Content-Disposition"] = (
            content_disposition_header(as_attachment=not image, filename=row.name) or ""
        )
    response["Cache-Control"] = "private, max-age=86400"
    return response
