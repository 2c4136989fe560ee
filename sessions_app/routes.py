"""The routes of the REST API at `/api/v1/` (SPEC E3, PROTOCOL "REST API"): the app's one
router, added to the one NinjaAPI in `api.py`.

Routes are thin (STYLE 1, 8): parse and authorise, call one engine/service/selector function,
serialise the answer. Dialogs are always looked up through the owner-scoped selectors, so
another user's dialog or turn is simply not found (404, never 403; F2). Errors are raised,
never answered here: `api.py` maps them to HTTP in one place.

Status codes: 201 created; 202 accepted (a send, retry, continue or compaction runs on); 204
deleted;
400 unparsable JSON; 401 no or bad credentials; 403 CSRF failure of a browser session, or a write
into a chat-app dialog linked read-only to the caller (`read_only`); 404
unknown or another user's dialog/turn, or a first-party chat id that is not the caller's;
409 a live dialog already has that id (`conflict`), the queue is full (`queue_full`) or there
is nothing to retry or continue; 413 content or body too large; 422 invalid input; 429 rate
limited (with Retry-After); 503 overloaded, shutting down or storage failing.

With `Accept: text/event-stream`, POST .../messages (and .../retry, .../continue) answers 200
with a Server-Sent Events stream of the turn (`sse.py`). The turn belongs to the engine, not
to the stream: a client that hangs up stops nothing (C3).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any, cast

from django.contrib.auth.models import User
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
)
from django.utils.translation import gettext as _
from ninja import Query, Router, Status

from audit.trail import Actor, client_ip
from chatcore.common import events
from chatcore.common.dbthreads import on_db, on_db_idempotent
from chatcore.common.errors import NotFound, ShuttingDown
from chatcore.common.ids import owner_chat_id
from chatcore.engine import background, clientstate, rates, runtime
from chatcore.engine.dialog_settings import dialog_settings_update
from chatcore.engine.dialogs import delete_dialog
from chatcore.engine.engine import Ack
from chatcore.engine.sessions import dialog_create

from . import selectors, services, usage
from .api_auth import request_login
from .connection import build_inbound, resolve_attachments
from .models import Session
from .schemas import (
    ID_PATTERN,
    AckOut,
    CompactOut,
    ErrorOut,
    MessageIn,
    MessagePageOut,
    ModelListOut,
    RetryIn,
    SessionCreateIn,
    SessionListOut,
    SessionOut,
    SessionRenameIn,
    StopOut,
    TurnOut,
    ValidationErrorOut,
)
from .sse import EVENT_STREAM, ack_body, stream, wants_stream

logger = logging.getLogger(__name__)

SESSIONS_PAGE_MAX = 100
MESSAGES_PAGE_MAX = selectors.HISTORY_PAGE_MAX
# Bounds that keep query values inside what every database accepts (64-bit integers).
OFFSET_MAX = 1_000_000_000
SEQ_MAX = 2**53

router = Router()


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


def _actor(request: HttpRequest, user: User) -> Actor:
    """H5: the caller (a token's or a session's user; `request.user` is not set for a token)."""
    return Actor.of_user(user, ip=client_ip(request.META), via="rest")


def _owned(user: User, session_id: str) -> Session:
    return selectors.session_get_for_owner(owner_id=user.pk, session_id=session_id)


def _writable(user: User, session_id: str) -> Session:
    """The caller's dialog for a write; a chat-app dialog linked read-only answers 403."""
    return selectors.session_get_for_writer(owner_id=user.pk, session_id=session_id)


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


def _turn_links() -> dict[str, Any]:
    """OpenAPI links from a send's turn (its messages: the user message, then the answer) to
    an edit of the one and a regenerate of the other (H1)."""
    session = "$response.body#/session_id"
    return {
        "links": {
            "edit_message": {
                "operationId": "sessions_app_api_edit_message",
                "parameters": {"session_id": session, "seq": "$response.body#/messages/0/seq"},
            },
            "regenerate_message": {
                "operationId": "sessions_app_api_regenerate_message",
                "parameters": {"session_id": session, "seq": "$response.body#/messages/1/seq"},
            },
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
        used = usage.sessions_usage(session_pks=[s.pk for s in items])
        return {
            "items": [clientstate.session_state(s, engine, used[s.pk]) for s in items],
            "count": count,
        }

    return await on_db_idempotent(read)()


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
    await rates.acharge(user.pk, rates.WRITE, engine.cfg)

    def create() -> dict[str, Any]:
        chat_id = payload.chat_id or owner_chat_id(user.pk)
        session = dialog_create(
            owner=user,
            channel=payload.channel,
            chat_id=chat_id,
            dialog_id=payload.dialog_id,
            title=payload.title,
            states=engine.states,
        )
        return clientstate.session_state(session, engine)

    return Status(201, await on_db(create)())


@router.get(
    "/sessions/{session_id}",
    response={200: SessionOut, **ERRORS},
    summary="A dialog with its status, running turn and queue",
    exclude_unset=True,
)
async def get_session(request: HttpRequest, session_id: str) -> dict[str, Any]:
    user = _user(request)
    engine = await runtime.get_engine()
    return await on_db_idempotent(
        lambda: clientstate.session_state(_owned(user, session_id), engine)
    )()


@router.patch(
    "/sessions/{session_id}",
    response={200: SessionOut, 400: ErrorOut, **WRITE_ERRORS},
    summary="Rename a dialog, or set its model and system prompt",
    exclude_unset=True,
)
async def rename_session(
    request: HttpRequest, session_id: str, payload: SessionRenameIn
) -> dict[str, Any]:
    user = _user(request)
    engine = await runtime.get_engine()
    await rates.acharge(user.pk, rates.WRITE, engine.cfg)
    session = await on_db_idempotent(_writable)(user, session_id)
    if payload.model is not None or payload.system_prompt is not None:
        # H4: the model is checked first, so an unknown one changes nothing.
        session = await dialog_settings_update(
            engine=engine,
            session=session,
            model=payload.model,
            system_prompt=payload.system_prompt,
        )

    def rename() -> dict[str, Any]:
        renamed = session
        if payload.title is not None:
            renamed = services.session_rename(
                session=session, title=payload.title, actor=_actor(request, user)
            )
        return clientstate.session_state(renamed, engine)

    return await on_db(rename)()


@router.get(
    "/models",
    response={200: ModelListOut, **ERRORS},
    summary="The models a dialog may use, and the default",
)
async def list_models(request: HttpRequest) -> dict[str, Any]:
    """H4: what the model server lists (`GET {LLM_BASE_URL}/models`, asked at most every
    5 minutes), narrowed by `LLM_MODELS`."""
    engine = await runtime.get_engine()
    return engine.models.listing(await engine.models.aids())


@router.delete(
    "/sessions/{session_id}",
    response={204: None, **WRITE_ERRORS},
    summary="Delete a dialog (hidden at once; a running turn ends as stale)",
)
async def delete_session(request: HttpRequest, session_id: str) -> HttpResponse:
    user = _user(request)
    session = await on_db_idempotent(_writable)(user, session_id)
    engine = await runtime.get_engine()
    await rates.acharge(user.pk, rates.WRITE, engine.cfg)
    await delete_dialog(engine=engine, session=session, by=_actor(request, user))
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
            session_pk=session.pk, from_seq=from_seq, limit=limit, session=session
        )
        return {
            # A page read after the dialog row may hold newer messages; never report less.
            "history_revision": max([session.last_seq, *(m.seq for m in messages)]),
            "messages": [events.message_frame(m) for m in messages],
            "has_more": has_more,
            "next_from_seq": messages[-1].seq + 1 if messages else from_seq,
        }

    return await on_db_idempotent(read)()


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
    session = await on_db_idempotent(_writable)(user, session_id)
    engine = await runtime.get_engine()
    inbound = build_inbound(
        user=user,
        channel="api",
        chat_id=session.chat_id,
        content=payload.content,
        mode=payload.mode,
        client_msg_id=payload.client_msg_id or "",
        attachments=await resolve_attachments(user, [str(i) for i in payload.attachments]),
    )
    if wants_stream(request):
        return await stream(
            user=user,
            session=session,
            engine=engine,
            start=lambda: engine.submit(inbound, session),
            login=request_login(request),
        )
    return Status(202, ack_body(await engine.submit(inbound, session)))


@router.post(
    "/sessions/{session_id}/stop",
    response={200: StopOut, **WRITE_ERRORS},
    summary="Stop the running turn and drop queued sends (C6)",
)
async def stop_session(request: HttpRequest, session_id: str) -> dict[str, Any]:
    user = _user(request)
    session = await on_db_idempotent(_writable)(user, session_id)
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
    return await _rerun(request, session_id, payload, continue_answer=False)


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
    return await _rerun(request, session_id, payload, continue_answer=True)


async def _rerun(
    request: HttpRequest, session_id: str, payload: RetryIn | None, *, continue_answer: bool
) -> Status[Any] | HttpResponseBase:
    """A turn without a new user message: retry (C6) or continue a cut answer (E5); 202 with
    the ack, or the turn's frames as SSE."""
    user = _user(request)
    session = await on_db_idempotent(_writable)(user, session_id)
    engine = await runtime.get_engine()
    client_msg_id = (payload.client_msg_id if payload else None) or ""
    begin = engine.continue_answer if continue_answer else engine.retry

    def start() -> Awaitable[Ack]:
        return begin(session, owner=user, client_msg_id=client_msg_id)

    if wants_stream(request):
        return await stream(
            user=user, session=session, engine=engine, start=start, login=request_login(request)
        )
    return Status(202, ack_body(await start()))


@router.post(
    "/sessions/{session_id}/compact",
    response={202: CompactOut, **WRITE_ERRORS},
    summary="Summarise older history in the background (B5)",
)
async def compact_session(request: HttpRequest, session_id: str) -> Status[Any]:
    user = _user(request)
    session = await on_db_idempotent(_writable)(user, session_id)
    engine = await runtime.get_engine()
    if engine.closing:
        raise ShuttingDown()
    # F7: a compaction is model work, charged to the send rate.
    await rates.acharge(user.pk, rates.SEND, engine.cfg)
    await on_db(background.request_compaction)(session_pk=session.pk, manual=True)
    return Status(202, {"session_id": session.session_id, "accepted": True})


# --- Turns ---------------------------------------------------------------------------------


@router.get(
    "/turns/{turn_id}",
    response={200: TurnOut, **ERRORS},
    summary="A turn: status, reason, error and its committed messages",
    exclude_unset=True,
    # H1: a send's turn holds its user message, then its answer: an edit of the one and a
    # regenerate of the other (clients and the schema's stateful tests follow these).
    openapi_extra={"responses": {200: _turn_links()}},
)
async def get_turn(request: HttpRequest, turn_id: str) -> dict[str, Any]:
    user = _user(request)

    def read() -> dict[str, Any]:
        turn = selectors.turn_get_for_owner(owner_id=user.pk, turn_id=turn_id)
        if turn.session.deleted_at is not None:
            # A7: a deleted dialog is hidden at once, its turns too.
            raise NotFound(_("Turn not found."))
        return clientstate.turn_state(turn)

    return await on_db_idempotent(read)()


@router.api_operation(
    ["GET", "POST", "PUT", "PATCH", "DELETE"],
    "/{path:rest}",
    auth=None,
    include_in_schema=False,
)
def unknown_path(request: HttpRequest, rest: str) -> None:
    """Every other path under the API answers a JSON 404."""
    raise Http404(rest)
