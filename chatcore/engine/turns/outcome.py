"""Typed turn outcomes and failure kinds (C9, C10), and the one presenter that turns a
failure into safe user-visible text."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from django.utils.translation import gettext as _


class FailureKind(StrEnum):
    INPUT_PERSISTENCE = "input_persistence"
    AGENT_CREATION = "agent_creation"
    CONTEXT_PREPARATION = "context_preparation"
    PROVIDER = "provider"
    TURN_PERSISTENCE = "turn_persistence"
    DELIVERY = "delivery"
    INTERRUPTED = "interrupted"
    # F7: the turn ran past CHAT["TURN_DEADLINE_SECONDS"].
    TIMEOUT = "timeout"
    # F3: the answer grew past CHAT["ANSWER_MAX_BYTES"]; what fit is kept.
    TOO_LARGE = "too_large"


@dataclass
class PendingMessage:
    """A message the turn will commit (assistant tool calls, tool results, steer/inject
    records, the final answer), in the order it happened."""

    role: str
    content: str
    kind: str
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    tool_name: str | None = None
    source: dict[str, Any] = field(default_factory=dict)
    created_at: Any = None
    status: str = ""


class Notice(StrEnum):
    """Why a completed turn's answer is not a whole answer (E5); also the turn's `reason`."""

    TRUNCATED = "truncated"
    FILTERED = "filtered"
    EMPTY = "empty"


@dataclass
class Completed:
    messages: list[PendingMessage]
    usage: dict[str, Any] = field(default_factory=dict)
    notice: str = ""
    # H4: the model the turn asked.
    model: str = ""


@dataclass
class Cancelled:
    messages: list[PendingMessage]
    partial: str = ""
    reason: str = "stopped"


@dataclass
class Failed:
    kind: FailureKind
    detail: str
    messages: list[PendingMessage] = field(default_factory=list)
    partial: str = ""
    provider_kind: str = ""


@dataclass
class Stale:
    pass


TurnOutcome = Completed | Cancelled | Failed | Stale


def present_failure(kind: FailureKind | str, provider_kind: str = "") -> str:
    """The single place that words failures for people (C10). Never includes raw errors."""
    if kind == FailureKind.PROVIDER:
        return {
            "context_overflow": _(
                "The conversation is too long for the model, even after compacting it."
            ),
            "auth": _(
                "The model server refused our credentials. "
                "An operator needs to check the configuration."
            ),
            "rate_limited": _("The model server is busy right now. Please retry in a moment."),
            "timeout": _("The model server took too long to answer. Please retry."),
            "connection": _("The model server could not be reached. Please retry later."),
            # Not retryable: the same request would be refused again.
            "bad_request": _(
                "The model server rejected the request. "
                "An operator needs to check the model settings."
            ),
            "content_filter": _("The model server's content filter stopped the answer."),
            # H3: the request held images and the model server refused them.
            "images_unsupported": _(
                "The model cannot see images: the model server refused the attached image. "
                "Send the message without it, or use a model that takes images."
            ),
        }.get(provider_kind, _("The model server failed to answer. Please retry."))
    return {
        FailureKind.INPUT_PERSISTENCE: _("Your message could not be saved. Please send it again."),
        FailureKind.AGENT_CREATION: _("The assistant could not be started. Please retry."),
        FailureKind.CONTEXT_PREPARATION: _(
            "The conversation context could not be prepared. Please retry."
        ),
        FailureKind.TURN_PERSISTENCE: _(
            "The answer could not be saved, so it was not delivered. Please retry."
        ),
        FailureKind.DELIVERY: _("The answer could not be delivered."),
        FailureKind.INTERRUPTED: _(
            "The answer was interrupted because the server stopped. Please retry."
        ),
        FailureKind.TIMEOUT: _(
            "The answer took too long and was stopped. Please retry, or ask for something shorter."
        ),
        FailureKind.TOO_LARGE: _(
            "The answer grew too long and was stopped. Please ask for something shorter."
        ),
    }.get(FailureKind(kind), _("Something went wrong. Please retry."))


def present_notice(kind: str) -> str:
    """The user-visible words for a completed turn whose answer was cut or withheld (E5)."""
    words: dict[str, str] = {
        Notice.TRUNCATED: _("The answer was cut off because it reached the length limit."),
        Notice.FILTERED: _("The model's content filter stopped the answer."),
        Notice.EMPTY: _("The model returned an empty answer."),
    }
    return words.get(kind, "")
