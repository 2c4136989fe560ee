"""H3: an upload over the limit is refused before its body is read.

Django's ASGI handler reads a request's whole body (into a temporary file) before any view
or middleware runs, so `UploadGuard` sits in front of it: a `POST /api/v1/files` whose
declared `Content-Length` is over the limit is answered 413 without a byte of its body read
by the application (a server that streams bodies has not received them yet; Daphne, under
`serve`, has, into a temporary file). A body sent without a length cannot be judged before
it arrives; the upload route refuses it by the file's size.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.utils.translation import gettext as _

UPLOAD_PATH = "/api/v1/files"
# Room for the multipart framing around the file's bytes.
MULTIPART_ROOM = 64 * 1024


def is_upload(method: str, path: str) -> bool:
    return method.upper() == "POST" and path.rstrip("/") == UPLOAD_PATH


def upload_body_limit() -> int:
    return int(settings.CHAT["UPLOAD_MAX_BYTES"]) + MULTIPART_ROOM


def _declared_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class UploadGuard:
    """ASGI middleware: answers an oversized upload 413 without reading its body."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and is_upload(scope.get("method", ""), scope.get("path", "")):
            length = _declared_length(scope)
            if length is not None and length > upload_body_limit():
                await self._refuse(send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(send: Any) -> None:
        body = json.dumps(
            {"code": "too_large", "message": _("The request body is too large.")}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    # The rest of the body is never read: the connection cannot be reused.
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
