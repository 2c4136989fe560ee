"""REST routes of edit, regenerate and branch (SPEC H1, PROTOCOL "Branches"), under `/api/v1/`.

The same engine calls as the WebSocket frames (`chatcore.engine.branching`): an edit or a
regenerate is a turn like a send (202 with the ack, or its frames as Server-Sent Events with
`Accept: text/event-stream`); a seq of the wrong role or not in the dialog answers 422
`bad_request`, another user's dialog 404, and nothing changes. Registered ahead of
`routes.router`, whose last route answers every other path with a 404.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, cast

from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponseBase
from ninja import Path, Router, Status

from chatcore.common.dbthreads import on_db_idempotent
from chatcore.engine import branching, runtime
from chatcore.engine.engine import Ack

from . import selectors
from .api_auth import request_login
from .routes import _STREAM_DOC, SEND_ERRORS, WRITE_ERRORS
from .schemas import AckOut, BranchIn, BranchOut, EditIn, RetryIn
from .sse import ack_body, stream, wants_stream

router = Router()

SEQ_MAX = 2**53


def _user(request: HttpRequest) -> User:
    return cast(User, request.auth)  # type: ignore[attr-defined]


async def _turn(
    request: HttpRequest, session_id: str, begin: Any
) -> Status[Any] | HttpResponseBase:
    """Start an edit or regenerate turn of the caller's dialog: 202 with the ack, or its
    stream."""
    user = _user(request)
    session = await on_db_idempotent(selectors.session_get_for_writer)(
        owner_id=user.pk, session_id=session_id
    )
    engine = await runtime.get_engine()

    def start() -> Awaitable[Ack]:
        return cast(Awaitable[Ack], begin(engine, session, user))

    if wants_stream(request):
        return await stream(
            user=user, session=session, engine=engine, start=start, login=request_login(request)
        )
    return Status(202, ack_body(await start()))


@router.post(
    "/sessions/{session_id}/messages/{seq}/edit",
    response={202: AckOut, **SEND_ERRORS},
    summary="Edit a user message: its new version answered as a new branch (H1)",
    description="The new text becomes a sibling of message `seq` (a user message; else 422 "
    "`bad_request`) and its answer follows it; the new branch becomes active when its turn "
    "starts. Queued and charged like a send; streams with `Accept: text/event-stream`.",
    openapi_extra=_STREAM_DOC,
)
async def edit_message(
    request: HttpRequest,
    session_id: str,
    payload: EditIn,
    seq: int = Path(..., ge=1, le=SEQ_MAX),  # noqa: B008
) -> Status[Any] | HttpResponseBase:
    async def begin(engine: Any, session: Any, user: User) -> Ack:
        return await branching.edit(
            engine,
            session,
            owner=user,
            seq=seq,
            content=payload.content,
            channel="api",
            client_msg_id=payload.client_msg_id or "",
        )

    return await _turn(request, session_id, begin)


@router.post(
    "/sessions/{session_id}/messages/{seq}/regenerate",
    response={202: AckOut, **SEND_ERRORS},
    summary="Answer again: a new answer beside answer `seq` (H1)",
    description="Message `seq` must be an answer (else 422 `bad_request`); the new answer "
    "answers the same user message and becomes active when its turn starts. Queued and "
    "charged like a send; streams with `Accept: text/event-stream`.",
    openapi_extra=_STREAM_DOC,
)
async def regenerate_message(
    request: HttpRequest,
    session_id: str,
    payload: RetryIn | None = None,
    seq: int = Path(..., ge=1, le=SEQ_MAX),  # noqa: B008
) -> Status[Any] | HttpResponseBase:
    client_msg_id = (payload.client_msg_id if payload else None) or ""

    async def begin(engine: Any, session: Any, user: User) -> Ack:
        return await branching.regenerate(
            engine, session, owner=user, seq=seq, channel="api", client_msg_id=client_msg_id
        )

    return await _turn(request, session_id, begin)


@router.post(
    "/sessions/{session_id}/branch",
    response={200: BranchOut, **WRITE_ERRORS},
    summary="Make the branch through a message active (H1)",
    description="The active path then runs to the newest message below `seq`; 422 "
    "`bad_request` for a seq not in the dialog or while a turn of the dialog runs or waits.",
)
async def branch_session(request: HttpRequest, session_id: str, payload: BranchIn) -> Any:
    user = _user(request)
    session = await on_db_idempotent(selectors.session_get_for_writer)(
        owner_id=user.pk, session_id=session_id
    )
    written = await branching.branch(session, seq=payload.seq)
    return {"head_seq": written.head_seq, "history_revision": written.last_seq}
