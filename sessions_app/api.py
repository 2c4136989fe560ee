"""The REST API at `/api/v1/` (SPEC E3, PROTOCOL "REST API"): one NinjaAPI, one router.

Routes are thin (STYLE 1, 8): parse and authorise, call one engine/service/selector function,
serialise the answer. Dialogs are always looked up through the owner-scoped selectors, so
another user's dialog or turn is simply not found (404, never 403; F2). Domain errors
(`ChatError`) become `{"code", "message"}` with their HTTP status in one handler; so do
ninja's validation, authentication and 404 errors, and whatever else fails.

Status codes: 201 created; 202 accepted (a send, retry, continue or compaction runs on); 204
deleted;
400 unparsable JSON; 401 no or bad credentials; 403 CSRF failure of a browser session, or a write
into a chat-app dialog linked read-only to the caller (`read_only`); 404
unknown or another user's dialog/turn, or a first-party chat id that is not the caller's;
409 a live dialog already has that id (`conflict`), the queue is full (`queue_full`) or there
is nothing to retry or continue; 413 content or body too large; 422 invalid input; 429 rate
limited (with Retry-After); 503 overloaded, shutting down or storage failing.

With `Accept: text/event-stream`, POST .../messages (and .../retry, .../continue) answers 200 with a
Server-Sent Events stream of the WebSocket's frames (`event:` = frame type, `id:` = an
increasing integer, `data:` = the frame as JSON): `queued`, then that dialog's
`history_delta`s, that turn's `turn_snapshot`s and its `turn_updated`, where the stream ends.
The turn belongs to the engine, not to the stream: a client that hangs up stops nothing (C3).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import wraps
from typing import Any, cast

from asgiref.sync import sync_to_async
from channels.layers import BaseChannelLayer, get_channel_layer
from django.conf import settings
from django.contrib.auth.models import User
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    JsonResponse,
    StreamingHttpResponse,
)
from django.urls import URLPattern, URLResolver
from django.utils.translation import gettext as _
from ninja import NinjaAPI, Query, Router, Status
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.parser import Parser

from chatcore.common import events, publish
from chatcore.common.errors import ChatError, NotFound, ShuttingDown
from chatcore.common.ids import owner_chat_id
from chatcore.engine import background, clientstate, limits, runtime
from chatcore.engine.engine import Ack, Engine, Inbound

from . import logins, selectors, services
from .api_auth import SAFE_METHODS, CsrfFailed, api_auth, docs_guard, request_login
from .models import Session
from .schemas import (
    ID_PATTERN,
    AckOut,
    CompactOut,
    ErrorOut,
    MessageIn,
    MessagePageOut,
    RetryIn,
    SessionCreateIn,
    SessionListOut,
    SessionOut,
    SessionRenameIn,
    StopOut,
    TurnOut,
    ValidationErrorOut,
)

logger = logging.getLogger(__name__)

# An SSE stream silent this long gets a comment line, so proxies keep it open.
SSE_KEEPALIVE_SECONDS = 15.0
# An idle inject's history delta is published before its acknowledgement returns; this only
# bounds the wait if the channel layer lost it.
SSE_INJECT_WAIT_SECONDS = 5.0
# A terminal found in the database but not yet on the stream gets this long to arrive.
SSE_TERMINAL_GRACE_SECONDS = 2.0
SESSIONS_PAGE_MAX = 100
MESSAGES_PAGE_MAX = selectors.HISTORY_PAGE_MAX
# Bounds that keep query values inside what every database accepts (64-bit integers).
OFFSET_MAX = 1_000_000_000
SEQ_MAX = 2**53
EVENT_STREAM = "text/event-stream"

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


def _error(status: int, code: str, message: str, **extra: Any) -> JsonResponse:
    return JsonResponse({"code": code, "message": message, **extra}, status=status)


def _body_limit() -> int:
    """The largest request body worth parsing: the content limit at 12 bytes per character
    (a JSON-escaped surrogate pair) plus room for the other fields, and never more than
    Django itself would read."""
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
    if length is None and request.method not in SAFE_METHODS:
        # A chunked body has no declared length; the server has already buffered it. Django
        # refuses to read one over DATA_UPLOAD_MAX_MEMORY_SIZE: that is a 413 too (F8), not
        # Django's HTML 400.
        try:
            length = len(request.body)
        except RequestDataTooBig:
            return _error(413, "too_large", _("The request body is too large."))
    if length is not None and length > _body_limit():
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
router = Router()


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


@api.exception_handler(Exception)
def _unexpected(request: HttpRequest, exc: Exception) -> HttpResponse:
    if isinstance(exc, RequestDataTooBig):
        return _error(413, "too_large", _("The request body is too large."))
    if isinstance(exc, SuspiciousOperation):
        return _error(400, "bad_request", _("Bad request."))
    logger.exception("API request failed: %s %s", request.method, request.path)
    return _error(500, "internal_error", _("Internal error."))


# --- Helpers -------------------------------------------------------------------------------

ERRORS: dict[int, Any] = {401: ErrorOut, 404: ErrorOut, 422: ValidationErrorOut}
# Writes into a chat-app dialog linked read-only to the caller answer 403 `read_only`.
WRITE_ERRORS: dict[int, Any] = {**ERRORS, 403: ErrorOut, 429: ErrorOut, 503: ErrorOut}
SEND_ERRORS: dict[int, Any] = {
    **WRITE_ERRORS,
    409: ErrorOut,
    413: ErrorOut,
    429: ErrorOut,
    503: ErrorOut,
}


def _user(request: HttpRequest) -> User:
    return cast(User, request.auth)  # type: ignore[attr-defined]


def _owned(user: User, session_id: str) -> Session:
    return selectors.session_get_for_owner(owner_id=user.pk, session_id=session_id)


def _writable(user: User, session_id: str) -> Session:
    """The caller's dialog for a write; a chat-app dialog linked read-only answers 403."""
    return selectors.session_get_for_writer(owner_id=user.pk, session_id=session_id)


def _wants_stream(request: HttpRequest) -> bool:
    return EVENT_STREAM in request.headers.get("Accept", "")


def _ack_body(ack: Ack) -> dict[str, Any]:
    frame = ack.frame()
    frame.pop("type")
    return frame


# --- Dialogs -------------------------------------------------------------------------------


def _session_links(*operations: str) -> dict[str, Any]:
    """OpenAPI links from a response carrying `session_id` to operations on that dialog."""
    return {
        "links": {
            operation: {
                "operationId": f"sessions_app_api_{operation}",
                "parameters": {"session_id": "$response.body#/session_id"},
            }
            for operation in operations
        }
    }


@router.get(
    "/sessions",
    response={200: SessionListOut, **ERRORS},
    summary="List the caller's dialogs, most recently active first",
    exclude_unset=True,
)
async def list_sessions(
    request: HttpRequest,
    channel: str | None = Query(None, pattern=ID_PATTERN),  # noqa: B008
    chat_id: str | None = Query(None, pattern=ID_PATTERN),  # noqa: B008
    limit: int = Query(10, ge=1, le=SESSIONS_PAGE_MAX),  # noqa: B008
    offset: int = Query(0, ge=0, le=OFFSET_MAX),  # noqa: B008
) -> dict[str, Any]:
    user = _user(request)
    engine = await runtime.get_engine()

    def read() -> dict[str, Any]:
        items, count = selectors.session_list_for_owner(
            owner_id=user.pk, channel=channel, chat_id=chat_id, limit=limit, offset=offset
        )
        return {"items": [clientstate.session_state(s, engine) for s in items], "count": count}

    return await sync_to_async(read)()


@router.post(
    "/sessions",
    response={201: SessionOut, **ERRORS, 409: ErrorOut, 429: ErrorOut, 503: ErrorOut},
    summary="Create a dialog",
    description="Creates a dialog in one of the caller's own first-party chats (default: "
    "channel `api`, chat `u{user id}`, a new random dialog id). A chat id that is not the "
    "caller's answers 404; an id of a live dialog answers 409 `conflict`.",
    exclude_unset=True,
    # Stateful clients and fuzzers follow these links from the created dialog (E3).
    openapi_extra={"responses": {201: _session_links("retry_session", "continue_session")}},
)
async def create_session(request: HttpRequest, payload: SessionCreateIn) -> Status[Any]:
    user = _user(request)
    engine = await runtime.get_engine()
    await limits.acharge(user.pk, limits.WRITE, engine.cfg)

    def create() -> dict[str, Any]:
        chat_id = payload.chat_id or owner_chat_id(user.pk)
        session = services.session_create(
            owner=user,
            channel=payload.channel,
            chat_id=chat_id,
            dialog_id=payload.dialog_id,
            title=payload.title,
        )
        return clientstate.session_state(session, engine)

    return Status(201, await sync_to_async(create)())


@router.get(
    "/sessions/{session_id}",
    response={200: SessionOut, **ERRORS},
    summary="A dialog with its status, running turn and queue",
    exclude_unset=True,
)
async def get_session(request: HttpRequest, session_id: str) -> dict[str, Any]:
    user = _user(request)
    engine = await runtime.get_engine()
    return await sync_to_async(
        lambda: clientstate.session_state(_owned(user, session_id), engine)
    )()


@router.patch(
    "/sessions/{session_id}",
    response={200: SessionOut, **WRITE_ERRORS},
    summary="Rename a dialog",
    exclude_unset=True,
)
async def rename_session(
    request: HttpRequest, session_id: str, payload: SessionRenameIn
) -> dict[str, Any]:
    user = _user(request)
    engine = await runtime.get_engine()
    await limits.acharge(user.pk, limits.WRITE, engine.cfg)

    def rename() -> dict[str, Any]:
        session = services.session_rename(session=_writable(user, session_id), title=payload.title)
        return clientstate.session_state(session, engine)

    return await sync_to_async(rename)()


@router.delete(
    "/sessions/{session_id}",
    response={204: None, **WRITE_ERRORS},
    summary="Delete a dialog (hidden at once; a running turn ends as stale)",
)
async def delete_session(request: HttpRequest, session_id: str) -> HttpResponse:
    user = _user(request)
    session = await sync_to_async(_writable)(user, session_id)
    engine = await runtime.get_engine()
    await limits.acharge(user.pk, limits.WRITE, engine.cfg)
    await engine.cancel_for_delete(session)
    await sync_to_async(services.session_soft_delete)(session=session)
    response = HttpResponse(status=204)
    del response["Content-Type"]  # no body, so no type
    return response


# --- Messages ------------------------------------------------------------------------------


@router.get(
    "/sessions/{session_id}/messages",
    response={200: MessagePageOut, **ERRORS},
    summary="History from a seq on, ascending (stable while messages are appended)",
    exclude_unset=True,
)
async def list_messages(
    request: HttpRequest,
    session_id: str,
    from_seq: int = Query(0, ge=0, le=SEQ_MAX),  # noqa: B008
    limit: int = Query(selectors.HISTORY_PAGE_DEFAULT, ge=1, le=MESSAGES_PAGE_MAX),  # noqa: B008
) -> dict[str, Any]:
    user = _user(request)

    def read() -> dict[str, Any]:
        session = _owned(user, session_id)
        messages, has_more = selectors.messages_from(
            session_pk=session.pk, from_seq=from_seq, limit=limit
        )
        return {
            # A page read after the dialog row may hold newer messages; never report less.
            "history_revision": max([session.last_seq, *(m.seq for m in messages)]),
            "messages": [events.message_frame(m) for m in messages],
            "has_more": has_more,
            "next_from_seq": messages[-1].seq + 1 if messages else from_seq,
        }

    return await sync_to_async(read)()


_STREAM_DOC = {
    "responses": {
        "200": {
            "description": "With `Accept: text/event-stream`: Server-Sent Events, one frame "
            "per event (`event:` = frame type), until the turn's `turn_updated`.",
            "content": {EVENT_STREAM: {"schema": {"type": "string"}}},
        }
    }
}


@router.post(
    "/sessions/{session_id}/messages",
    response={202: AckOut, **SEND_ERRORS},
    summary="Send, steer or inject a message",
    description="202 with the acknowledgement (`queued`); poll `GET /turns/{turn_id}` for the "
    "outcome, or ask for `Accept: text/event-stream` to stream the turn.",
    openapi_extra={
        "responses": {**_STREAM_DOC["responses"], 202: _session_links("continue_session")}
    },
)
async def post_message(
    request: HttpRequest, session_id: str, payload: MessageIn
) -> Status[Any] | HttpResponseBase:
    user = _user(request)
    session = await sync_to_async(_writable)(user, session_id)
    engine = await runtime.get_engine()
    inbound = Inbound(
        owner=user,
        channel="api",
        chat_id=session.chat_id,
        content=payload.content,
        sender_id=str(user.pk),
        mode=payload.mode,
        client_msg_id=payload.client_msg_id or "",
    )
    if _wants_stream(request):
        return await _stream(
            session, engine, lambda: engine.submit(inbound, session), request_login(request)
        )
    return Status(202, _ack_body(await engine.submit(inbound, session)))


@router.post(
    "/sessions/{session_id}/stop",
    response={200: StopOut, **WRITE_ERRORS},
    summary="Stop the running turn and drop queued sends (C6)",
)
async def stop_session(request: HttpRequest, session_id: str) -> dict[str, Any]:
    user = _user(request)
    session = await sync_to_async(_writable)(user, session_id)
    engine = await runtime.get_engine()
    result = await engine.stop(session)
    return {"stopped_running": result.stopped_running, "dropped": result.dropped}


@router.post(
    "/sessions/{session_id}/retry",
    response={202: AckOut, **SEND_ERRORS},
    summary="Re-run the last failed or cancelled turn as a new turn (C6)",
    description="409 when the last turn did not fail and was not cancelled. Streams like "
    "POST messages with `Accept: text/event-stream`.",
    openapi_extra=_STREAM_DOC,
)
async def retry_session(
    request: HttpRequest, session_id: str, payload: RetryIn | None = None
) -> Status[Any] | HttpResponseBase:
    user = _user(request)
    session = await sync_to_async(_writable)(user, session_id)
    engine = await runtime.get_engine()
    client_msg_id = (payload.client_msg_id if payload else None) or ""

    def start() -> Awaitable[Ack]:
        return engine.retry(session, owner=user, client_msg_id=client_msg_id)

    if _wants_stream(request):
        return await _stream(session, engine, start, request_login(request))
    return Status(202, _ack_body(await start()))


@router.post(
    "/sessions/{session_id}/continue",
    response={202: AckOut, **SEND_ERRORS},
    summary="Continue the last answer when the model cut it at its length limit (E5)",
    description="A new turn (mode `continue`) whose answer is stored as a message linked to "
    "the cut one by `source.continues`. 409 when the last answer was not cut (`truncated`). "
    "Streams like POST messages with `Accept: text/event-stream`.",
    openapi_extra=_STREAM_DOC,
)
async def continue_session(
    request: HttpRequest, session_id: str, payload: RetryIn | None = None
) -> Status[Any] | HttpResponseBase:
    user = _user(request)
    session = await sync_to_async(_writable)(user, session_id)
    engine = await runtime.get_engine()
    client_msg_id = (payload.client_msg_id if payload else None) or ""

    def start() -> Awaitable[Ack]:
        return engine.continue_answer(session, owner=user, client_msg_id=client_msg_id)

    if _wants_stream(request):
        return await _stream(session, engine, start)
    return Status(202, _ack_body(await start()))


@router.post(
    "/sessions/{session_id}/compact",
    response={202: CompactOut, **WRITE_ERRORS},
    summary="Summarise older history in the background (B5)",
)
async def compact_session(request: HttpRequest, session_id: str) -> Status[Any]:
    user = _user(request)
    session = await sync_to_async(_writable)(user, session_id)
    engine = await runtime.get_engine()
    if engine.closing:
        raise ShuttingDown()
    # F7: a compaction is model work, charged to the send rate.
    await limits.acharge(user.pk, limits.SEND, engine.cfg)
    await sync_to_async(background.request_compaction)(session_pk=session.pk, manual=True)
    return Status(202, {"session_id": session.session_id, "accepted": True})


# --- Turns ---------------------------------------------------------------------------------


@router.get(
    "/turns/{turn_id}",
    response={200: TurnOut, **ERRORS},
    summary="A turn: status, reason, error and its committed messages",
    exclude_unset=True,
)
async def get_turn(request: HttpRequest, turn_id: str) -> dict[str, Any]:
    user = _user(request)

    def read() -> dict[str, Any]:
        turn = selectors.turn_get_for_owner(owner_id=user.pk, turn_id=turn_id)
        if turn.session.deleted_at is not None:
            # A7: a deleted dialog is hidden at once, its turns too.
            raise NotFound(_("Turn not found."))
        return clientstate.turn_state(turn)

    return await sync_to_async(read)()


@router.api_operation(
    ["GET", "POST", "PUT", "PATCH", "DELETE"],
    "/{path:rest}",
    auth=None,
    include_in_schema=False,
)
def unknown_path(request: HttpRequest, rest: str) -> None:
    """Every other path under the API answers a JSON 404."""
    raise Http404(rest)


api.add_router("/", router)


# --- Server-Sent Events ---------------------------------------------------------------------


async def _stream(
    session: Session,
    engine: Engine,
    start: Callable[[], Awaitable[Ack]],
    login: logins.Login | None = None,
) -> HttpResponseBase:
    """Join the dialog's fan-out BEFORE the engine accepts the send, so no frame of its turn
    can pass unseen (D3), then stream that turn. A refusal answers as JSON, as without SSE.
    A steer or inject joins a turn that already runs: the stream then starts from the turn's
    full snapshot, read after joining, so it misses nothing (D3). The stream also joins its
    login's groups: when the login ends it ends too (F8)."""
    layer = get_channel_layer()
    if layer is None:  # no channel layer configured: acknowledge without a stream
        return JsonResponse(_ack_body(await start()), status=202)
    channel = await layer.new_channel("sse.")
    groups = (
        publish.chat_group(session.channel, session.chat_id),
        publish.session_group(session.pk),
    )
    for group in groups:
        await layer.group_add(group, channel)
    if login is not None:
        await logins.join(channel, login)
    try:
        ack = await start()
        joined = None
        if ack.turn_id is not None and ack.mode in ("steer", "inject"):
            joined = await sync_to_async(clientstate.active_turn)(session, engine)
    except BaseException:
        await _leave(layer, channel, groups, login)
        raise
    if joined is not None and joined["turn_id"] != ack.turn_id:
        joined = None
    response = StreamingHttpResponse(
        _events(layer, channel, groups, session, ack, joined, login), content_type=EVENT_STREAM
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: do not buffer the stream
    return response


async def _leave(
    layer: BaseChannelLayer, channel: str, groups: tuple[str, ...], login: logins.Login | None
) -> None:
    if login is not None:
        await logins.leave(channel, login)
    for group in groups:
        try:
            await layer.group_discard(group, channel)
        except Exception:
            logger.warning("SSE: leaving %s failed", group)


class _Inbox:
    """The stream's channel on the layer. A receive is never cancelled while the stream
    lives: the Redis pub/sub layer drops a channel whose receive is cancelled (and the frames
    sent to it meanwhile), so a keepalive timeout only stops waiting, not receiving."""

    def __init__(self, layer: BaseChannelLayer, channel: str) -> None:
        self.layer = layer
        self.channel = channel
        self._next: asyncio.Future[dict[str, Any]] | None = None

    async def get(self, timeout: float) -> dict[str, Any] | None:
        """The next message, or None after `timeout` seconds of silence."""
        if self._next is None:
            self._next = asyncio.ensure_future(self.layer.receive(self.channel))
        done, _pending = await asyncio.wait({self._next}, timeout=max(0.0, timeout))
        if not done:
            return None
        received, self._next = self._next, None
        return received.result()

    async def close(self) -> None:
        if self._next is not None:
            self._next.cancel()
            await asyncio.gather(self._next, return_exceptions=True)
            self._next = None


async def _events(
    layer: BaseChannelLayer,
    channel: str,
    groups: tuple[str, ...],
    session: Session,
    ack: Ack,
    joined: dict[str, Any] | None,
    login: logins.Login | None,
) -> AsyncIterator[str]:
    ids = itertools.count(1)
    inbox = _Inbox(layer, channel)

    def event(frame: dict[str, Any]) -> str:
        return f"event: {frame['type']}\nid: {next(ids)}\ndata: {json.dumps(frame)}\n\n"

    try:
        yield event(ack.frame())
        if ack.turn_id is None:
            # C5: an idle inject is no turn; its history delta ends the stream. A steer or
            # inject staged behind queued sends has nothing more to show.
            if ack.session.last_seq > session.last_seq:
                delta = await _idle_inject_delta(inbox, ack)
                if delta is not None:
                    yield event(delta)
            return
        relay = clientstate.SnapshotRelay()
        if joined is not None:
            relay.seed(joined)
            yield event(joined)
        async for frame in _turn_frames(inbox, session, ack.turn_id, relay):
            yield event(frame) if frame else ": keepalive\n\n"
    finally:
        # The client may have left (the ASGI handler cancels us): the turn runs on (C3).
        await asyncio.shield(_close(inbox, groups, login))


async def _close(inbox: _Inbox, groups: tuple[str, ...], login: logins.Login | None) -> None:
    await inbox.close()
    await _leave(inbox.layer, inbox.channel, groups, login)


async def _idle_inject_delta(inbox: _Inbox, ack: Ack) -> dict[str, Any] | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SSE_INJECT_WAIT_SECONDS
    while (remaining := deadline - loop.time()) > 0:
        message = await inbox.get(remaining)
        if message is None:
            return None
        frame = message.get("frame") or {}
        if (
            frame.get("type") == "history_delta"
            and frame.get("session_id") == ack.session.session_id
            and frame.get("turn_id") is None
            and frame.get("history_revision") == ack.session.last_seq
        ):
            return dict(frame)
    return None


async def _turn_frames(
    inbox: _Inbox, session: Session, turn_id: str, relay: clientstate.SnapshotRelay
) -> AsyncIterator[dict[str, Any] | None]:
    """The frames one client of this dialog would see for the turn; None = keepalive."""
    session_id = session.session_id
    loop = asyncio.get_running_loop()
    stored: dict[str, Any] | None = None
    give_up = 0.0
    while True:
        wait = SSE_KEEPALIVE_SECONDS if stored is None else give_up - loop.time()
        message = await inbox.get(wait)
        if message is None:
            if stored is not None:
                # The layer lost the terminal: end with the stored one.
                yield stored
                return
            # Silence: also the moment to notice a terminal the layer failed to deliver. It
            # may only be in flight (stored before it is published), so wait a little more.
            stored = await sync_to_async(_stored_terminal)(session, turn_id)
            give_up = loop.time() + SSE_TERMINAL_GRACE_SECONDS
            yield None
            continue
        if message.get("type") == logins.LOGIN_ENDED:
            # F8: the login ended; the turn runs on (C3), this stream does not.
            yield {
                "type": "error",
                "code": "unauthorized",
                "message": _("Your login ended: sign in again."),
            }
            return
        frame = message.get("frame")
        if not isinstance(frame, dict) or frame.get("session_id") != session_id:
            continue
        kind = frame.get("type")
        if kind == "turn_snapshot":
            if frame.get("turn_id") != turn_id:
                continue
            out, ask = relay.relay(frame)
            if ask:
                await clientstate.request_full_snapshot(turn_id, inbox.channel)
            if out is not None:
                yield out
        elif kind == "turn_updated":
            if frame.get("turn_id") != turn_id:
                continue
            yield frame
            if clientstate.is_terminal_frame(frame):
                return
        elif kind in ("history_delta", "session_updated", "system_notification"):
            yield frame


def _stored_terminal(session: Session, turn_id: str) -> dict[str, Any] | None:
    try:
        turn = selectors.turn_get_for_owner(owner_id=session.owner_id, turn_id=turn_id)
    except NotFound:
        return None
    if not turn.is_terminal:
        return None
    error = None
    if turn.error_kind:
        error = {"kind": turn.error_kind, "message": turn.error_message}
    return events.turn_updated_frame(
        session_id=session.session_id,
        turn_id=turn_id,
        status=turn.status,
        reason=turn.reason,
        error=error,
        client_msg_id=turn.client_msg_id,
    )
