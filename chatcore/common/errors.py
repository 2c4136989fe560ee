"""One domain error base (STYLE 9), translated once for HTTP and once for WebSocket frames."""

from __future__ import annotations

from django.utils.translation import gettext_lazy as _


class ChatError(Exception):
    """A refusal or failure that the caller can show as `{code, message}`."""

    code = "bad_request"
    http_status = 400
    default_message = _("Bad request.")

    def __init__(self, message: str | None = None, *, retry_after: float | None = None) -> None:
        self.message = str(message) if message is not None else str(self.default_message)
        self.retry_after = retry_after
        super().__init__(self.message)

    def as_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class BadRequest(ChatError):
    code = "bad_request"
    http_status = 422


class DialogExists(BadRequest):
    """A live dialog of the chat already has the requested id."""

    code = "conflict"
    http_status = 409
    default_message = _("A dialog with this id already exists.")


class NotFound(ChatError):
    code = "not_found"
    http_status = 404
    default_message = _("Not found.")


class ReadOnlyDialog(ChatError):
    """A chat-app dialog shown to a linked web user who may only read it."""

    code = "read_only"
    http_status = 403
    default_message = _("This dialog is read-only for you.")


class TooLarge(ChatError):
    code = "too_large"
    http_status = 413
    default_message = _("Too large.")


class UnsupportedType(ChatError):
    """An upload whose bytes are nothing a model can be given (H3)."""

    code = "unsupported_type"
    http_status = 415
    default_message = _("This type of file is not supported.")


class QueueFull(ChatError):
    code = "queue_full"
    http_status = 409
    default_message = _("This dialog already has the maximum number of queued messages.")


class Overloaded(ChatError):
    code = "overloaded"
    http_status = 503
    default_message = _("The server is overloaded; try again shortly.")


class RateLimited(ChatError):
    code = "rate_limited"
    http_status = 429
    default_message = _("Too many messages; slow down.")


class UnknownCommand(ChatError):
    code = "unknown_command"
    http_status = 422


class ShuttingDown(ChatError):
    code = "shutting_down"
    http_status = 503
    default_message = _("The server is shutting down; try again shortly.")


class NothingToRetry(ChatError):
    code = "bad_request"
    http_status = 409
    default_message = _("There is no failed or cancelled turn to retry.")


class NothingToContinue(ChatError):
    code = "bad_request"
    http_status = 409
    default_message = _("The last answer was not cut off, so there is nothing to continue.")


class StorageError(ChatError):
    """A write that still failed after its retries (A4)."""

    code = "storage_error"
    http_status = 503
    default_message = _("Saving failed; please try again.")


class StorageUnavailable(ChatError):
    """The database could not answer a request (down, restarting, every connection lost),
    also after the one more try a lost connection gets (A4)."""

    code = "storage_error"
    http_status = 503
    default_message = _("The database could not be reached; please try again.")


class InternalError(ChatError):
    """An unexpected failure while handling one request; details go to the log only."""

    code = "internal_error"
    http_status = 500
    default_message = _("Something went wrong; please try again.")
