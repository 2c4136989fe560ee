"""The choices of the stored rows (dialogs' title sources, messages' roles, kinds and
statuses, turns' modes and statuses), labelled for the admin in every language (E2). The
models import them from here; `sessions_app.models` re-exports them."""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class TitleSource(models.TextChoices):
    DEFAULT = "default", _("default")
    USER = "user", _("user")
    # B4: made after the first completed answer; the threshold's title still replaces it.
    FIRST = "first", _("first answer")
    AUTO = "auto", _("auto")
    OPERATOR = "operator", _("operator")


class Role(models.TextChoices):
    SYSTEM = "system", _("system")
    USER = "user", _("user")
    ASSISTANT = "assistant", _("assistant")
    TOOL = "tool", _("tool")


class MessageKind(models.TextChoices):
    """Where a message came from; stored in `source["kind"]`."""

    WELCOME = "welcome", _("welcome")
    USER_INPUT = "user_input", _("user input")
    STEER = "steer", _("steer")
    INJECT = "inject", _("inject")
    ASSISTANT = "assistant", _("assistant")
    TOOL_RESULT = "tool_result", _("tool result")


class MessageStatus(models.TextChoices):
    COMPLETE = "", _("complete")
    CANCELLED = "cancelled", _("cancelled")
    INTERRUPTED = "interrupted", _("interrupted")
    # E5: the model stopped at its token limit (`length`) or its content filter.
    TRUNCATED = "truncated", _("truncated")
    FILTERED = "filtered", _("filtered")


class TurnMode(models.TextChoices):
    SEND = "send", _("send")
    RETRY = "retry", _("retry")
    # E5: go on with a cut (`truncated`) answer; the cut message's id is in `source`.
    CONTINUE = "continue", _("continue")
    # H1: a user message edited (a sibling of it, `source.edit_of`) and an answer asked for
    # again (a sibling answer, `source.regenerate_of`).
    EDIT = "edit", _("edit")
    REGENERATE = "regenerate", _("regenerate")


class TurnStatus(models.TextChoices):
    QUEUED = "queued", _("queued")
    RUNNING = "running", _("running")
    COMPLETED = "completed", _("completed")
    CANCELLED = "cancelled", _("cancelled")
    FAILED = "failed", _("failed")


TERMINAL_STATUSES = (TurnStatus.COMPLETED, TurnStatus.CANCELLED, TurnStatus.FAILED)
