"""Ingress (C1, C5, F7): the normalised inbound message, its admission checks and limits,
and the answers the engine gives to an accepted send (`Ack`) or a stop (`StopResult`).

A refusal raises a `ChatError` and changes nothing; what passes goes to `admission.admit`, which
stores it before it is acknowledged (C2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.contrib.auth.models import User
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from chatcore.common import events
from chatcore.common.dbthreads import on_db
from chatcore.common.errors import BadRequest, ReadOnlyDialog, ShuttingDown, TooLarge
from chatcore.common.ids import FIRST_PARTY_CHANNELS, storable_text
from sessions_app import selectors
from sessions_app.models import Session

from . import rates

MODES = ("send", "steer", "inject")


@dataclass(frozen=True)
class Inbound:
    """A normalised inbound message (D5). `channel_context` is opaque to the engine."""

    owner: User
    channel: str
    chat_id: str
    content: str
    sender_id: str
    mode: str = "send"
    client_msg_id: str = ""
    reply_to: str | None = None
    received_at: datetime = field(default_factory=timezone.now)
    media: tuple[Any, ...] = ()
    channel_context: dict[str, Any] = field(default_factory=dict)
    # Run inside the transaction that accepts the message (turn enqueued, input staged or an
    # idle inject stored): a chat app marks its platform event handled there, so a redelivery
    # is neither lost nor a second turn (D5). Raising refuses the message and changes nothing.
    accept: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    def source(self) -> dict[str, Any]:
        data: dict[str, Any] = {"from_channel": self.channel, "from_user_id": self.sender_id}
        if self.reply_to:
            data["reply_to"] = self.reply_to
        if self.client_msg_id:
            data["client_msg_id"] = self.client_msg_id
        if self.media:
            # H3: the attachments of a send, moved into its message's `attachments`.
            data["attachments"] = list(self.media)
        if self.channel_context:
            # D5: the platform's own context, opaque here, handed back to its sink.
            data["context"] = self.channel_context
        return data


@dataclass
class Ack:
    """The answer to an accepted send/steer/inject (PROTOCOL `queued`)."""

    session: Session
    turn_id: str | None
    position: int
    mode: str
    client_msg_id: str = ""

    def frame(self) -> dict[str, Any]:
        return events.queued_frame(
            session_id=self.session.session_id,
            turn_id=self.turn_id,
            position=self.position,
            mode=self.mode,
            client_msg_id=self.client_msg_id,
        )


@dataclass
class StopResult:
    stopped_running: bool
    dropped: int

    def describe(self) -> str:
        if not self.stopped_running and not self.dropped:
            return _("Nothing to stop.")
        parts = []
        if self.stopped_running:
            parts.append(_("Stopped the running answer."))
        if self.dropped:
            parts.append(
                ngettext(
                    "Dropped %(n)d queued message.", "Dropped %(n)d queued messages.", self.dropped
                )
                % {"n": self.dropped}
            )
        return " ".join(parts)


def check_content(content: object, *, cfg: dict[str, Any], attachments: bool = False) -> str:
    """A message's text; empty only beside attachments (H3)."""
    if not isinstance(content, str) or not (content.strip() or (attachments and not content)):
        raise BadRequest(_("The message is empty."))
    if not storable_text(content):
        raise BadRequest(_("The message contains characters that cannot be stored."))
    if len(content) > cfg["CONTENT_LIMIT"]:
        raise TooLarge(
            _("The message is too long (at most %(n)d characters).") % {"n": cfg["CONTENT_LIMIT"]}
        )
    return content


async def check_inbound(
    inbound: Inbound, session: Session, *, cfg: dict[str, Any], closing: bool
) -> None:
    """Every refusal of a send/steer/inject before anything is stored: shutdown, mode,
    content, id length, a read-only linked dialog. The owner's send rate (F7) is charged
    after these and before the admission (`Engine.submit`, `rates.acharge`)."""
    if closing:
        raise ShuttingDown()
    if inbound.mode not in MODES:
        raise BadRequest(_("Unknown mode %(mode)s.") % {"mode": inbound.mode})
    if inbound.media and inbound.mode != "send":
        raise BadRequest(_("Attachments go with a send, not with a steer or inject."))
    check_content(inbound.content, cfg=cfg, attachments=bool(inbound.media))
    if len(inbound.client_msg_id) > 128:
        raise BadRequest(_("client_msg_id is too long (at most 128 characters)."))
    external = session.channel not in FIRST_PARTY_CHANNELS
    if (
        external
        and inbound.channel != session.channel
        and not await on_db(selectors.external_write_allowed)(
            user_id=inbound.owner.pk, session=session
        )
    ):
        # A chat-app dialog linked read-only to this web user.
        raise ReadOnlyDialog()


async def check_model_work(owner: User, *, cfg: dict[str, Any], closing: bool) -> None:
    """A retry or continue starts model work: refused during shutdown and charged to the
    send rate like a send (F7)."""
    if closing:
        raise ShuttingDown()
    await rates.acharge(owner.pk, rates.SEND, cfg)
