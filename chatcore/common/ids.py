"""Session ids (A1): `{channel}:{chat_id}:{dialog_id}`, each part `[A-Za-z0-9_.-]{1,64}`;
and the random UUIDs rows are keyed by (`new_uuid`)."""

from __future__ import annotations

import os
import re
import threading
import uuid
from dataclasses import dataclass

from django.utils.translation import gettext as _

from .errors import BadRequest

ID_PART = re.compile(r"[A-Za-z0-9_.-]{1,64}")
DEFAULT_DIALOG = "default"
# First-party channels: the chat id is derived from the owning user (A1).
FIRST_PARTY_CHANNELS = frozenset({"web", "api", "cli"})


# Bytes of the OS's randomness read at once for `new_uuid`: 256 ids.
_RANDOM_BLOCK = 4096
_random_lock = threading.Lock()
_random = b""
_random_at = 0


def new_uuid() -> uuid.UUID:
    """A random (version 4) UUID from the OS's randomness, as `uuid.uuid4` makes, read in
    blocks. `uuid4` reads 16 bytes per call, and the read gives the interpreter lock up: a
    database thread then waits for the event loop to hand it back, which a busy loop does at
    its switch interval. Measured beside a busy thread: 177 µs per `uuid4` against 2 µs for
    one from a block; every turn and message a burst starts made one on a database thread.
    """
    global _random, _random_at
    with _random_lock:
        if _random_at + 16 > len(_random):
            _random, _random_at = os.urandom(_RANDOM_BLOCK), 0
        raw = _random[_random_at : _random_at + 16]
        _random_at += 16
    return uuid.UUID(bytes=raw, version=4)


def _forget_random() -> None:
    # A forked child (a Celery worker) must never hand out what its parent has read, and
    # starts with a lock of its own (another thread of the parent may have held it).
    global _random, _random_at, _random_lock
    _random, _random_at, _random_lock = b"", 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_random)


def validate_part(value: object, *, field: str) -> str:
    if not isinstance(value, str) or not ID_PART.fullmatch(value):
        raise BadRequest(
            _("Invalid %(field)s: use 1 to 64 letters, digits, '_', '.' or '-'.") % {"field": field}
        )
    return value


@dataclass(frozen=True, slots=True)
class SessionKey:
    channel: str
    chat_id: str
    dialog_id: str

    def __str__(self) -> str:
        return f"{self.channel}:{self.chat_id}:{self.dialog_id}"

    @classmethod
    def parse(cls, raw: object) -> SessionKey:
        if not isinstance(raw, str) or raw.count(":") != 2:
            raise BadRequest(_("Invalid session id: expected channel:chat_id:dialog_id."))
        channel, chat_id, dialog_id = raw.split(":")
        return cls.build(channel, chat_id, dialog_id)

    @classmethod
    def build(cls, channel: object, chat_id: object, dialog_id: object) -> SessionKey:
        return cls(
            validate_part(channel, field="channel"),
            validate_part(chat_id, field="chat_id"),
            validate_part(dialog_id, field="dialog_id"),
        )


def owner_chat_id(user_id: int, suffix: str | None = None) -> str:
    """The chat id of a user's first-party chat: `u42`, or `u42.work` with a suffix."""
    base = f"u{user_id}"
    if suffix:
        validate_part(suffix, field="chat_id")
        return f"{base}.{suffix}"
    return base


def chat_belongs_to(user_id: int, channel: str, chat_id: str) -> bool:
    """Whether a first-party chat id is the user's own (A1): `u42` or `u42.<anything>`."""
    if channel not in FIRST_PARTY_CHANNELS:
        return True
    base = f"u{user_id}"
    return chat_id == base or chat_id.startswith(base + ".")


def storable_text(text: str) -> bool:
    """Whether every database can store the text: no NUL character, no lone surrogate."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
