"""The REST API at `/api/v1/` (SPEC E3, PROTOCOL "REST API"): one NinjaAPI (STYLE 8).

This module owns what wraps every route: the URL guard (an oversized body is refused before
anything parses it, F3; every error answers JSON) and the one place domain errors
(`ChatError`), ninja's validation, authentication and 404 errors, and whatever else fails
become `{"code", "message"}` with their HTTP status (STYLE 9). The routes are in `routes.py`,
the Server-Sent Events transport in `sse.py`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.db import DatabaseError, InterfaceError, OperationalError
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    JsonResponse,
)
from django.http.multipartparser import MultiPartParserError
from django.urls import URLPattern, URLResolver
from django.utils.translation import gettext as _
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.operation import Operation
from ninja.parser import Parser

from chatcore.common.errors import ChatError, StorageUnavailable

from .api_auth import SAFE_METHODS, CsrfFailed, api_auth, docs_guard
from .branch_routes import router as branch_router
from .file_routes import router as files_router
from .routes import router
from .routes_carry import router as carry_router
from .upload_guard import is_upload, upload_body_limit

logger = logging.getLogger(__name__)

DESCRIPTION = """
Dialogs, messages, streaming and turns of the chat platform (PROTOCOL "REST API").

**Auth:** `Authorization: Bearer <token>` (issue one with `manage.py issue_token USERNAME`)
or the browser session (unsafe methods then need the `X-CSRFToken` header).

**Errors** are always JSON `{"code", "message"}`: 400 unparsable body, 401 unauthenticated,
403 CSRF failure or `read_only` (a write into a chat-app dialog linked read-only), 404
unknown dialog or turn (also another user's: never 403), 409 `conflict`
(a live dialog already has that id), `queue_full` or nothing to retry, 413 `too_large`,
422 `bad_request` (validation; `errors` says where), 429 `rate_limited` with `Retry-After`,
503 `overloaded` / `shutting_down` / `storage_error`.

**Streaming:** `POST /sessions/{session_id}/messages` with `Accept: text/event-stream` answers
a Server-Sent Events stream of the WebSocket frames (`queued`, `history_delta`,
`turn_snapshot`, `turn_updated`) until that turn's `turn_updated`.
"""


# --- The API and its guards ----------------------------------------------------------------


IMPORT_PATH = "/sessions/import"


def _error(status: int, code: str, message: str, **extra: Any) -> JsonResponse:
    return JsonResponse({"code": code, "message": message, **extra}, status=status)


def _body_limit(request: HttpRequest | None = None) -> int:
    """The largest request body worth parsing: the content limit at 12 bytes per character
    (a JSON-escaped surrogate pair) plus room for the other fields, and never more than
    Django itself would read. An upload (H3): the file limit plus room for the multipart
    framing (Django streams its file part to disk, not memory). An import (H2) reads its own
    body, up to its own limit."""
    if request is not None and is_upload(request.method or "", request.path):
        return upload_body_limit()
    if request is not None and request.path.endswith(IMPORT_PATH):
        return int(settings.CHAT["IMPORT_MAX_BYTES"])
    limit = int(settings.CHAT["CONTENT_LIMIT"]) * 12 + 64 * 1024
    django_limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return min(limit, django_limit) if django_limit is not None else limit


def _precheck(request: HttpRequest) -> HttpResponse | None:
    """F3: refuse an oversized body before anything parses it."""
    raw = request.META.get("CONTENT_LENGTH")
    try:
        length = int(raw) if raw else None
    except ValueError:
        length = None
    importing = request.path.endswith(IMPORT_PATH)  # reads its own body, to its own limit
    if (
        length is None
        and request.method not in SAFE_METHODS
        and not importing
        and not is_upload(request.method or "", request.path)
    ):
        # A chunked body has no declared length; the server has already buffered it. Django
        # refuses to read one over DATA_UPLOAD_MAX_MEMORY_SIZE: that is a 413 too (F8), not
        # Django's HTML 400.
        try:
            length = len(request.body)
        except RequestDataTooBig:
            return _error(413, "too_large", _("The request body is too large."))
    if length is not None and length > _body_limit(request):
        return _error(413, "too_large", _("The request body is too large."))
    return None


def _finish(response: HttpResponseBase) -> HttpResponseBase:
    """Errors are always JSON: ninja answers a wrong method with plain text."""
    if response.status_code == 405 and not response.get("Content-Type", "").startswith(
        "application/json"
    ):
        allowed = response.get("Allow", "")
        response = _error(405, "method_not_allowed", _("Method not allowed."))
        if allowed:
            response["Allow"] = allowed
    return response


def _guard_view(view: Callable[..., Any]) -> Callable[..., Any]:
    if asyncio.iscoroutinefunction(view):

        @wraps(view)
        async def guarded_async(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            early = _precheck(request)
            if early is not None:
                return early
            try:
                return _finish(await view(request, *args, **kwargs))
            except Http404:
                return _error(404, "not_found", _("Not found."))

        guarded: Callable[..., Any] = guarded_async
    else:

        @wraps(view)
        def guarded_sync(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            early = _precheck(request)
            if early is not None:
                return early
            try:
                return _finish(view(request, *args, **kwargs))
            except Http404:
                return _error(404, "not_found", _("Not found."))

        guarded = guarded_sync
    guarded.csrf_exempt = getattr(view, "csrf_exempt", False)  # type: ignore[attr-defined]
    return guarded


class ChatNinjaAPI(NinjaAPI):
    """NinjaAPI whose URL views also guard the body size and keep every error JSON."""

    @property
    def urls(self) -> tuple[list[URLResolver | URLPattern], str, str]:
        patterns, app_name, namespace = super().urls
        guarded: list[URLResolver | URLPattern] = [
            URLPattern(p.pattern, _guard_view(p.callback), p.default_args, p.name)
            if isinstance(p, URLPattern)
            else p
            for p in patterns
        ]
        return guarded, app_name, namespace

    def get_openapi_operation_id(self, operation: Operation) -> str:
        # PROTOCOL: operation ids stay `sessions_app_api_<view>` (clients and the schema's
        # links name them) although the views live in `routes.py`.
        return f"sessions_app_api_{operation.view_func.__name__}"


class EmptyAsObjectParser(Parser):
    """An empty body reads as `{}`, so bodies whose fields are all optional may be left out
    (POST .../retry)."""

    def parse_body(self, request: HttpRequest) -> dict[str, Any]:
        if not request.body.strip():
            return {}
        return super().parse_body(request)


api = ChatNinjaAPI(
    title="chatcore API",
    parser=EmptyAsObjectParser(),
    version="1",
    description=DESCRIPTION,
    urls_namespace="api-v1",
    auth=api_auth(),
    docs_decorator=docs_guard,
)


# --- Errors: one place maps them to HTTP (STYLE 8, 9) ---------------------------------------


@api.exception_handler(ChatError)
def _chat_error(request: HttpRequest, exc: ChatError) -> HttpResponse:
    response = _error(exc.http_status, exc.code, exc.message)
    if exc.retry_after is not None:
        response["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return response


@api.exception_handler(ValidationError)
def _validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    errors = [
        {"loc": [str(part) for part in e.get("loc", ())], "msg": str(e.get("msg", ""))}
        for e in exc.errors
    ]
    if not errors:
        return _error(422, "bad_request", _("Invalid input."), errors=errors)
    # ["body", "payload", "content"] -> "content"; ["query", "limit"] -> "limit".
    loc = errors[0]["loc"]
    field = loc[2:] if loc[:1] == ["body"] and len(loc) > 2 else loc[1:]
    message = f"{'.'.join(field) or (loc[0] if loc else 'input')}: {errors[0]['msg']}"
    return _error(422, "bad_request", message, errors=errors)


@api.exception_handler(AuthenticationError)
def _authentication_error(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    response = _error(
        401,
        "unauthorized",
        _("Authentication required: a valid bearer token or a signed-in session."),
    )
    response["WWW-Authenticate"] = 'Bearer realm="api"'
    return response


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    if isinstance(exc, CsrfFailed):
        code = "csrf_failed"
    else:
        code = {
            400: "bad_request",
            401: "unauthorized",
            403: "forbidden",
            404: "not_found",
            413: "too_large",
            429: "rate_limited",
        }.get(exc.status_code, "error")
    return _error(exc.status_code, code, exc.message)


@api.exception_handler(Http404)
def _not_found(request: HttpRequest, exc: Http404) -> HttpResponse:
    return _error(404, "not_found", _("Not found."))


@api.exception_handler(OperationalError)
@api.exception_handler(InterfaceError)
def _database_unavailable(request: HttpRequest, exc: DatabaseError) -> HttpResponse:
    # A4: the database is down or the call lost its connection again (a read runs once more
    # on a fresh one, `on_db_idempotent`; writes retry, A4): a retryable 503, never a 500.
    logger.warning(
        "API request failed on the database: %s %s: %s", request.method, request.path, exc
    )
    return _chat_error(request, StorageUnavailable(retry_after=1))


@api.exception_handler(Exception)
def _unexpected(request: HttpRequest, exc: Exception) -> HttpResponse:
    if isinstance(exc, RequestDataTooBig):
        return _error(413, "too_large", _("The request body is too large."))
    if isinstance(exc, SuspiciousOperation):
        return _error(400, "bad_request", _("Bad request."))
    if isinstance(exc, MultiPartParserError):
        # H3: a multipart body without a boundary, or cut short.
        return _error(400, "bad_request", _("The multipart body could not be read."))
    logger.exception("API request failed: %s %s", request.method, request.path)
    return _error(500, "internal_error", _("Internal error."))


# The routers of this app (their routes register on import). Files', H2's and H1's first:
# the main router's last route answers every other path, and `/sessions/import` must match
# before `/sessions/{session_id}` does.
api.add_router("/", files_router)
api.add_router("/", carry_router)
api.add_router("/", branch_router)
api.add_router("/", router)
