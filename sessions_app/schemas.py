"""Request (In) and response (Out) schemas of the REST API (PROTOCOL "REST API", SPEC E3).

Out schemas mirror the dicts of `chatcore.engine.clientstate` and `events.message_frame`, so
the API and the WebSocket show a dialog, a message and a turn in the same shape. Optional
fields of a message are left out when absent (the views render with `exclude_unset`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from uuid import UUID

from django.conf import settings
from ninja import Field, Schema
from pydantic import AfterValidator, model_validator

from chatcore.common.llm_models import SYSTEM_PROMPT_MAX

# A1: each part of a session id.
ID_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
TITLE_MAX = 200
CLIENT_MSG_ID_MAX = 128


def _storable(value: str) -> str:
    """Refuse text no database can keep: NUL characters (PostgreSQL rejects them) and lone
    surrogates (not encodable as UTF-8)."""
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("must be valid Unicode text") from exc
    return value


# Length limits go on the string itself, before `_storable` runs: set after it, pydantic
# checks them as a generic length and speaks of "items" (issue 54).
Title = Annotated[str, Field(min_length=1, max_length=TITLE_MAX), AfterValidator(_storable)]
Content = Annotated[str, Field(min_length=1), AfterValidator(_storable)]
ClientMsgId = Annotated[str, Field(max_length=CLIENT_MSG_ID_MAX), AfterValidator(_storable)]
IdPart = Annotated[str, Field(pattern=ID_PATTERN, min_length=1, max_length=64)]
Timestamp = Annotated[str, Field(json_schema_extra={"format": "date-time"})]


# --- Errors -------------------------------------------------------------------------------


class ErrorOut(Schema):
    """Every error answer: a stable machine code and a human message."""

    code: str = Field(
        description="bad_request, unauthorized, csrf_failed, not_found, conflict, queue_full, "
        "too_large, unsupported_type, rate_limited, overloaded, shutting_down, storage_error, "
        "internal_error"
    )
    message: str


class ValidationErrorOut(ErrorOut):
    errors: list[dict[str, Any]] = Field(
        default_factory=list, description="Where the input was wrong: `loc` and `msg`."
    )


# --- Dialogs ------------------------------------------------------------------------------


class SessionCreateIn(Schema):
    # A1: dialogs of external platforms belong to the account that connected the platform;
    # the API creates dialogs only in the caller's own first-party chats.
    channel: Literal["api", "web", "cli"] = Field("api", description="A first-party channel.")
    chat_id: IdPart | None = Field(
        None,
        description="The caller's own chat: `u{user id}` (default) or `u{user id}.{suffix}`. "
        "Any other first-party chat id answers 404.",
    )
    dialog_id: IdPart | None = Field(
        None, description="Omitted: a new random id. An id of a live dialog answers 409."
    )
    title: Title | None = None


class SessionRenameIn(Schema):
    """PATCH a dialog: any of its title, model and system prompt (H4); omitted = unchanged."""

    title: Title | None = None
    model: Annotated[str, Field(min_length=1, max_length=200), AfterValidator(_storable)] | None = (
        Field(None, description="One of the ids of `GET /models`; anything else answers 400.")
    )
    system_prompt: (
        Annotated[str, Field(max_length=SYSTEM_PROMPT_MAX), AfterValidator(_storable)] | None
    ) = Field(
        None,
        description="The dialog's own instructions, sent in the first (system) message "
        "after the platform's; empty clears them.",
    )

    @model_validator(mode="after")
    def _something(self) -> SessionRenameIn:
        if self.title is None and self.model is None and self.system_prompt is None:
            raise ValueError("give a title, a model or a system_prompt")
        return self


class UsageOut(Schema):
    """Tokens the model reported (H4); `cached_tokens` where the server gave them."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class UsageTotalsOut(UsageOut):
    turns: int = Field(description="The completed turns the totals cover.")


class ModelOut(Schema):
    id: str


class ModelListOut(Schema):
    items: list[ModelOut]
    default: str = Field(description="The model of a dialog that chose none.")


class ToolProgressOut(Schema):
    call_id: str
    name: str
    status: Literal["running", "ok", "error"]


class TurnSnapshotOut(Schema):
    """PROTOCOL `turn_snapshot`: the answer so far is `known[:text_offset] + text`."""

    type: Literal["turn_snapshot"] = "turn_snapshot"
    session_id: str
    turn_id: str
    status: Literal["running"] = "running"
    text_offset: int
    text: str
    tools: list[ToolProgressOut]
    frame: int


class QueueItemOut(Schema):
    turn_id: str
    mode: str
    client_msg_id: str | None
    preview: str


class SessionOut(Schema):
    """A dialog with its live state (D3): what runs now and what waits in its queue (C2)."""

    session_id: str = Field(description="`channel:chat_id:dialog_id`; use it in the URLs.")
    channel: str
    chat_id: str
    dialog_id: str
    title: str
    created_at: Timestamp
    last_active_at: Timestamp
    message_count: int = Field(description="The user's own messages (A2).")
    total_message_count: int
    history_revision: int = Field(description="The highest seq ever assigned (D2).")
    head_seq: int | None = Field(
        None, description="The last message of the active path (H1); null before any."
    )
    status: Literal["idle", "running"]
    active_turn: TurnSnapshotOut | None
    queue: list[QueueItemOut]
    model: str = Field(description="The model its turns ask (H4).")
    system_prompt: str = Field(description="The dialog's own instructions (H4).")
    usage: UsageTotalsOut = Field(description="What its completed turns used (H4).")


class SessionListOut(Schema):
    items: list[SessionOut]
    count: int = Field(description="How many dialogs match, over all pages.")


# --- Messages -----------------------------------------------------------------------------


class MessageIn(Schema):
    content: Content = Field(
        description="At most CONTENT_LIMIT characters (default 65,536; longer answers 413)."
    )
    client_msg_id: ClientMsgId | None = None
    attachments: list[UUID] = Field(
        default_factory=list,
        max_length=settings.CHAT["ATTACHMENTS_MAX"],
        description="Ids of the caller's own files (POST /files) to send with a `send`, at "
        "most CHAT_ATTACHMENTS_MAX (default 10); another user's or an unknown file refuses "
        "the send (422) (H3).",
    )
    mode: Literal["send", "steer", "inject"] = Field(
        "send",
        description="send: a new turn (C1); steer: joins the running turn at its next step, "
        "a send when idle (C4); inject: context without a turn (C5).",
    )


class RetryIn(Schema):
    client_msg_id: ClientMsgId | None = None


class AttachmentOut(Schema):
    """A file a message carries (PROTOCOL "Files and images")."""

    file_id: str
    name: str
    size: int
    content_type: str
    kind: Literal["image", "text", "document"]


class FileOut(AttachmentOut):
    """An uploaded file (POST /files)."""


class EditIn(Schema):
    """H1: the new text of a user message; it becomes a sibling of the edited one."""

    content: Content = Field(
        description="At most CONTENT_LIMIT characters (default 65,536; longer answers 413)."
    )
    client_msg_id: ClientMsgId | None = None


class BranchIn(Schema):
    seq: int = Field(ge=1, le=2**62, description="A message of the branch to make active.")


class BranchOut(Schema):
    head_seq: int
    history_revision: int


class MessageOut(Schema):
    """PROTOCOL "Message". The optional fields appear only when present."""

    id: str
    seq: int
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    created_at: Timestamp
    parent_seq: int | None = Field(
        None, description="The message this one follows on its branch (H1); null for the first."
    )
    siblings: list[int] | None = Field(
        None,
        description="Where the parent has several children: all their seqs, oldest first "
        "(the versions a client switches between).",
    )
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    tool_name: str | None = None
    status: str | None = Field(
        None,
        description="Absent for a whole message; `cancelled`, `interrupted`, or `truncated` "
        "(cut at the model's length limit; `continue` goes on with it) or `filtered` (stopped "
        "by the content filter).",
    )
    source: dict[str, Any] | None = Field(
        None,
        description="Where the message came from (`kind`, ...); `continues` = the id of the "
        "cut answer a continuation goes on with.",
    )
    turn_id: str | None = None
    attachments: list[AttachmentOut] | None = Field(
        None, description="The files a user message carries (H3)."
    )


class MessagePageOut(Schema):
    history_revision: int
    messages: list[MessageOut] = Field(description="seq >= from_seq, ascending.")
    has_more: bool = Field(description="More messages follow the last one of this page.")
    next_from_seq: int = Field(description="The `from_seq` of the next page.")


class AckOut(Schema):
    """PROTOCOL `queued`: an accepted send (durable from here on, C2)."""

    session_id: str
    turn_id: str | None = Field(description="null for an inject into an idle dialog.")
    position: int = Field(description="Turns of the dialog ahead of this one (0 = runs now).")
    mode: str
    client_msg_id: str | None


class StopOut(Schema):
    stopped_running: bool
    dropped: int


class CompactOut(Schema):
    session_id: str
    accepted: bool = True


# --- Turns --------------------------------------------------------------------------------


class TurnErrorOut(Schema):
    kind: str
    message: str


class TurnOut(Schema):
    turn_id: str
    session_id: str
    status: Literal["queued", "running", "completed", "cancelled", "failed"]
    mode: str
    reason: str | None = Field(
        description="stopped, dropped or stale when cancelled; truncated, filtered or empty "
        "when completed with an answer that is not whole."
    )
    error: TurnErrorOut | None
    notice: TurnErrorOut | None = Field(
        None, description="For truncated/filtered/empty: {kind, message} to show the user."
    )
    client_msg_id: str | None
    messages: list[MessageOut] = Field(description="The turn's committed messages.")
    model: str | None = Field(None, description="The model a completed turn asked (H4).")
    usage: UsageOut = Field(description="What the model reported for this turn (H4).")
