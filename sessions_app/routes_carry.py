"""The REST routes of search, export, import and share links (SPEC H2, PROTOCOL "Search,
export, import"), on a router of their own that `api.py` adds before the dialogs' router:
`POST /sessions/import` must be matched before `/sessions/{session_id}` takes "import" for a
dialog id. Thin, as `routes.py`: owner-scoped lookups (another user's dialog or share is 404),
one service or selector call, errors raised for `api.py` to map.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from asgiref.sync import sync_to_async
from django.contrib.auth.models import User
from django.http import HttpRequest, StreamingHttpResponse
from django.utils.http import content_disposition_header
from ninja import Query, Router, Status

from audit.trail import Actor, client_ip
from chatcore.common.dbthreads import on_db, on_db_idempotent
from chatcore.common.errors import TooLarge
from chatcore.engine import clientstate, rates, runtime

from . import export, import_writes, importer, search, selectors, shares
from .routes import _session_links
from .schemas import ErrorOut, SessionOut, ValidationErrorOut
from .schemas_carry import SearchOut, ShareOut

router = Router()

ERRORS: dict[int, Any] = {401: ErrorOut, 404: ErrorOut, 422: ValidationErrorOut}
WRITE_ERRORS: dict[int, Any] = {**ERRORS, 429: ErrorOut, 503: ErrorOut}


# The body as OpenAPI can say it: a `chatcore.dialog.v1` document. Its cross-references
# (`parent_seq`, `head_seq`: seqs of its own messages) and the ChatGPT form (`mapping`,
# `current_node`) are in the description and README; both are checked by `importer`.
IMPORT_BODY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "A `chatcore.dialog.v1` document (as GET .../export?format=json gives; "
    "`parent_seq` and `head_seq` name seqs of its own messages), or one conversation of a "
    "ChatGPT data export (`title`, `mapping`, `current_node`).",
    "required": ["format", "messages"],
    "properties": {
        "format": {"const": export.FORMAT},
        "title": {"type": "string", "maxLength": 200},
        "messages": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["seq", "role", "content"],
                "properties": {
                    "seq": {"type": "integer", "minimum": 1, "maximum": 2**53},
                    "role": {"enum": ["system", "user", "assistant", "tool"]},
                    "content": {"type": "string"},
                },
            },
        },
    },
}


def _user(request: HttpRequest) -> User:
    return cast(User, request.auth)  # type: ignore[attr-defined]


def _actor(request: HttpRequest, user: User) -> Actor:
    """The caller, for the audit records of imports and share links (H5)."""
    return Actor.of_user(user, ip=client_ip(request.META), via="rest")


@router.get(
    "/search",
    response={200: SearchOut, **ERRORS},
    summary="Search the caller's live dialogs",
    description="Messages (of the user and the assistant) and titles that contain every word "
    "of `q`, case-insensitively, best first. On PostgreSQL a word matches the start of a word "
    "of the text and CJK text matches as a substring; on SQLite every word matches as a "
    "substring. A title hit has `role` `title` and `seq` null; a message hit's `seq` is the "
    "message to open. `snippet` is plain text; `highlights` are [start, end) spans of it, "
    "in Unicode code points.",
)
async def search_dialogs(
    request: HttpRequest,
    q: str = Query(..., min_length=1, max_length=search.QUERY_MAX_CHARS),  # noqa: B008
    limit: int = Query(20, ge=1, le=search.LIMIT_MAX),  # noqa: B008
    offset: int = Query(0, ge=0, le=10_000),  # noqa: B008
) -> dict[str, Any]:
    user = _user(request)

    def read() -> dict[str, Any]:
        hits, count = search.search_for_owner(owner_id=user.pk, q=q, limit=limit, offset=offset)
        return {"items": [h.as_dict() for h in hits], "count": count}

    return await on_db_idempotent(read)()


@router.get(
    "/sessions/{session_id}/export",
    response={200: None, **ERRORS},
    summary="Export a dialog as JSON (chatcore.dialog.v1) or Markdown",
    description="`format=json`: every message with its `parent_seq`, and `head_seq` (README "
    '"Export and import"). `format=markdown`: the active path, readable. Both are '
    "attachments, streamed.",
)
async def export_session(
    request: HttpRequest,
    session_id: str,
    format: Literal["json", "markdown"] = "json",  # noqa: A002 (the query parameter's name)
) -> StreamingHttpResponse:
    user = _user(request)
    session = await on_db_idempotent(selectors.session_get_for_owner)(
        owner_id=user.pk, session_id=session_id
    )
    if format == "markdown":
        body, content_type, ext = export.markdown_chunks(session), "text/markdown", "md"
    else:
        body, content_type, ext = export.json_chunks(session), "application/json", "json"
    response = StreamingHttpResponse(body, content_type=f"{content_type}; charset=utf-8")
    response["Content-Disposition"] = content_disposition_header(
        True, export.filename(session, ext)
    )
    response["Cache-Control"] = "no-store"
    return response


def _read_import(request: HttpRequest) -> importer.ImportedDialog:
    limit = importer.max_bytes()
    raw = request.read(limit + 1)
    if len(raw) > limit:
        raise TooLarge(importer.too_large_message())
    return importer.parse_bytes(raw)


@router.post(
    "/sessions/import",
    response={201: SessionOut, 400: ErrorOut, 413: ErrorOut, **WRITE_ERRORS},
    summary="Import a dialog",
    description="The body is a `chatcore.dialog.v1` document or one conversation of a "
    "ChatGPT data export (`mapping`, `current_node`). It is checked whole first: a bad "
    "document answers 400 naming the first problem and creates nothing; over "
    "`CHAT_IMPORT_MAX_BYTES` 413. 201: the new dialog, in the caller's web chat.",
    exclude_unset=True,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": IMPORT_BODY_SCHEMA}},
        },
        # As for a created dialog: what clients and fuzzers do next with an imported one.
        "responses": {201: _session_links("retry_session", "continue_session")},
    },
)
async def import_session(request: HttpRequest) -> Status[Any]:
    user = _user(request)
    engine = await runtime.get_engine()
    await rates.acharge(user.pk, rates.WRITE, engine.cfg)
    dialog = await sync_to_async(_read_import, thread_sensitive=False)(request)

    def write() -> dict[str, Any]:
        session = import_writes.dialog_import(
            owner=user, dialog=dialog, actor=_actor(request, user)
        )
        return clientstate.session_state(session, engine)

    return Status(201, await on_db(write)())


@router.post(
    "/sessions/{session_id}/share",
    response={201: ShareOut, **WRITE_ERRORS},
    summary="Make a read-only share link of a dialog",
    description="Freezes the active path as it is now. Anyone with the `url` can read it "
    "without logging in; later messages never appear there.",
)
async def share_session(request: HttpRequest, session_id: str) -> Status[Any]:
    user = _user(request)
    engine = await runtime.get_engine()
    await rates.acharge(user.pk, rates.WRITE, engine.cfg)

    def write() -> dict[str, Any]:
        session = selectors.session_get_for_owner(owner_id=user.pk, session_id=session_id)
        share = shares.share_create(owner=user, session=session, actor=_actor(request, user))
        return shares.share_item(share, session)

    return Status(201, await on_db(write)())


@router.get(
    "/shares",
    response={200: list[ShareOut], **ERRORS},
    summary="The caller's share links, newest first",
)
async def list_shares(request: HttpRequest) -> list[dict[str, Any]]:
    user = _user(request)
    return await on_db_idempotent(shares.share_list_for_owner)(owner_id=user.pk)


@router.delete(
    "/shares/{share_id}",
    response={204: None, **WRITE_ERRORS},
    summary="Revoke a share link",
    description="The page at its `url` answers 404 from now on.",
)
async def revoke_share(request: HttpRequest, share_id: str) -> Status[None]:
    user = _user(request)
    await on_db(shares.share_revoke)(
        owner_id=user.pk, share_id=share_id, actor=_actor(request, user)
    )
    return Status(204, None)
