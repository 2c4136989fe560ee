"""What every first-party live channel shares (SPEC B1, B3, C6, D1, D3, D5): the WebSocket
consumer (`consumers.py`), the Server-Sent Events stream (`sse.py`) and the terminal
(`management/commands/chat.py`).

A `ChannelConnection` is one client of one chat, reached on the channel layer at
`reply_channel`. It resolves the dialog (B1), joins the chat's and the current dialog's
groups, relays snapshot tails with a `SnapshotRelay` so each applies contiguously (D1, D3),
and turns what the client typed into engine calls: a leading `/` runs the slash command,
anything else becomes ONE `Inbound` carrying the sender, the time it was received and, as
reply-to, the client's message id (D5). Stop, retry and continue go through it too; a delete
is the `/delete` command, which calls the one `delete_dialog` (A7, C9).

It owns no turn (STYLE 5): it only forwards to the engine and relays what the engine
publishes. The channel around it parses and serialises.
"""

from __future__ import annotations

from typing import Any

from channels.layers import BaseChannelLayer
from django.contrib.auth.models import User
from django.utils import timezone
from django.utils.translation import gettext as _

from audit.trail import Actor
from chatcore.common import publish
from chatcore.common.dbthreads import on_db_idempotent
from chatcore.common.errors import BadRequest, ChatError, ShuttingDown
from chatcore.engine import branching, commands
from chatcore.engine.clientstate import SnapshotRelay, request_full_snapshot
from chatcore.engine.engine import Ack, Engine, Inbound
from chatcore.engine.sessions import resolve_dialog

from . import files, selectors
from .models import Session


def build_inbound(
    *,
    user: User,
    channel: str,
    chat_id: str,
    content: str,
    mode: str = "send",
    client_msg_id: str = "",
    attachments: list[dict[str, Any]] | None = None,
) -> Inbound:
    """D5: how a first-party channel's message enters the engine, built once: the sender's
    id, the time it was received, and the client's message id as both the idempotency key
    and what the message replies to. `attachments`: from `resolve_attachments` (H3)."""
    return Inbound(
        owner=user,
        channel=channel,
        chat_id=chat_id,
        content=content,
        sender_id=str(user.pk),
        mode=mode,
        client_msg_id=client_msg_id,
        reply_to=client_msg_id or None,
        received_at=timezone.now(),
        media=tuple(attachments or ()),
    )


async def resolve_attachments(user: User, raw: object) -> list[dict[str, Any]]:
    """H3: a send's `attachments` (file ids) as its message will carry them; a malformed
    list, too many, or a file that is not the sender's own refuses the send."""
    ids = files.attachments_check(raw)
    if not ids:
        return []
    return await on_db_idempotent(files.attachments_resolve)(owner_id=user.pk, file_ids=ids)


async def run_command(
    engine: Engine | None, ctx: commands.CommandContext, text: str
) -> commands.CommandResult:
    """B3: a slash command, refused during shutdown exactly as a send is (`shutting_down`):
    a closing engine writes nothing new. `/stop` only ever reduces work and still runs."""
    if engine is not None and engine.closing and commands.parse(text)[0] != "stop":
        raise ShuttingDown()
    return await commands.run_command(ctx, text)


class ChannelConnection:
    """One client of one chat on the channel layer (see the module docstring)."""

    __slots__ = (
        "engine",
        "actor",
        "user",
        "channel",
        "chat_id",
        "layer",
        "reply_channel",
        "chat_group",
        "session_group",
        "current",
        "relay",
    )

    def __init__(
        self,
        *,
        engine: Engine,
        user: User,
        channel: str,
        chat_id: str,
        layer: BaseChannelLayer,
        reply_channel: str,
        ip: str | None = None,
        via: str = "",
    ) -> None:
        self.engine = engine
        # H5: who acts through this connection and through which door, for the audit trail.
        self.actor = Actor.of_user(user, ip=ip, via=via or channel)
        self.user = user
        self.channel = channel
        self.chat_id = chat_id
        self.layer = layer
        self.reply_channel = reply_channel
        self.chat_group = publish.chat_group(channel, chat_id)
        self.session_group = ""
        self.current: Session | None = None
        self.relay = SnapshotRelay()

    # --- dialogs and groups ----------------------------------------------------------------

    def resolve(self, dialog_id: str | None = None, *, create: bool = False) -> Session:
        """B1: the named dialog (created when missing with `create`), else the most recently
        active one of the chat within the TTL, else a new one. Synchronous (ORM)."""
        return resolve_dialog(
            owner=self.user,
            channel=self.channel,
            chat_id=self.chat_id,
            dialog_id=dialog_id,
            create=create,
            states=self.engine.states,
        )

    def resolve_or_latest(self, requested: str | None) -> Session:
        """B1, with a requested dialog picked when it exists (else as without one)."""
        if requested:
            try:
                return self.resolve(requested)
            except ChatError:
                pass
        return self.resolve()

    async def join_chat(self) -> None:
        """D3: join the chat's fan-out before reading any state, so nothing falls between."""
        await self.layer.group_add(self.chat_group, self.reply_channel)

    async def follow(self, session: Session) -> None:
        """Make `session` the current dialog: its snapshots reach this connection (and no
        other dialog's). What the client has of its running turn is re-seeded by `seed`."""
        group = publish.session_group(session.pk)
        if group != self.session_group:
            await self.layer.group_add(group, self.reply_channel)
            if self.session_group:
                await self.layer.group_discard(self.session_group, self.reply_channel)
            self.session_group = group
        self.current = session
        self.relay.reset()

    def groups(self) -> tuple[str, ...]:
        """The groups this connection follows: its chat's and its current dialog's."""
        return (self.chat_group, self.session_group) if self.session_group else (self.chat_group,)

    async def leave(self) -> None:
        await publish.leave(self.layer, self.groups(), self.reply_channel)

    # --- relaying --------------------------------------------------------------------------

    def seed(self, active_turn: dict[str, Any] | None) -> None:
        """The client now holds `active_turn` (its full text): tails continue from there."""
        self.relay.reset()
        self.relay.seed(active_turn)

    async def relay_snapshot(self, frame: dict[str, Any]) -> dict[str, Any] | None:
        """D1, D3: the part of a snapshot this client lacks, or None. A gap asks the turn's
        process for a full snapshot, which arrives on this connection's own channel."""
        out, ask = self.relay.relay(frame)
        if ask:
            await request_full_snapshot(str(frame["turn_id"]), self.reply_channel)
        return out

    # --- client input ----------------------------------------------------------------------

    def inbound(
        self,
        content: str,
        *,
        mode: str = "send",
        client_msg_id: str = "",
        attachments: list[dict[str, Any]] | None = None,
    ) -> Inbound:
        return build_inbound(
            user=self.user,
            channel=self.channel,
            chat_id=self.chat_id,
            content=content,
            mode=mode,
            client_msg_id=client_msg_id,
            attachments=attachments,
        )

    async def send_or_command(
        self,
        content: str,
        target: Session,
        *,
        mode: str = "send",
        client_msg_id: str = "",
        attachments: list[dict[str, Any]] | None = None,
        literal: bool = False,
    ) -> Ack | commands.CommandResult:
        """A send whose text starts with `/` runs that slash command (B3) unless the client
        marked it `literal` (PROTOCOL `send`: "/usr/bin/python crashes" is a message);
        anything else is submitted (the engine refuses a write into a read-only dialog)."""
        if mode == "send" and not literal and commands.is_command(content):
            if attachments:
                raise BadRequest(_("A slash command takes no attachments."))
            return await self.command(content, target)
        return await self.engine.submit(
            self.inbound(content, mode=mode, client_msg_id=client_msg_id, attachments=attachments),
            target,
        )

    async def command(self, text: str, target: Session) -> commands.CommandResult:
        """B3: run one slash command on `target`; one that changes the dialog is refused on
        a dialog read-only for this user."""
        if commands.writes_dialog(text):
            await on_db_idempotent(selectors.dialog_check_writable)(
                user_id=self.user.pk, session=target
            )
        ctx = commands.CommandContext(
            owner=self.user,
            channel=self.channel,
            chat_id=self.chat_id,
            current=target,
            engine=self.engine,
            actor=self.actor,
        )
        return await run_command(self.engine, ctx, text)

    async def stop(self, target: Session) -> commands.CommandResult:
        """C6: the same path as `/stop`."""
        return await self.command("/stop", target)

    async def retry(self, target: Session, *, client_msg_id: str = "") -> Ack:
        await self._check_writable(target)
        return await self.engine.retry(target, owner=self.user, client_msg_id=client_msg_id)

    async def continue_answer(self, target: Session, *, client_msg_id: str = "") -> Ack:
        """E5: go on with a cut answer."""
        await self._check_writable(target)
        return await self.engine.continue_answer(
            target, owner=self.user, client_msg_id=client_msg_id
        )

    async def edit(
        self, target: Session, *, seq: object, content: object, client_msg_id: str = ""
    ) -> Ack:
        """H1: a new version of user message `seq`, answered like a send."""
        await self._check_writable(target)
        return await branching.edit(
            self.engine,
            target,
            owner=self.user,
            seq=seq,
            content=content,
            channel=self.channel,
            client_msg_id=client_msg_id,
        )

    async def regenerate(
        self, target: Session, *, seq: object | None, client_msg_id: str = ""
    ) -> Ack:
        """H1: another answer to the message answer `seq` answers."""
        await self._check_writable(target)
        return await branching.regenerate(
            self.engine,
            target,
            owner=self.user,
            seq=seq,
            channel=self.channel,
            client_msg_id=client_msg_id,
        )

    async def branch(self, target: Session, *, seq: object) -> Session:
        """H1: make the branch through `seq` active."""
        await self._check_writable(target)
        return await branching.branch(target, seq=seq)

    async def _check_writable(self, target: Session) -> None:
        await on_db_idempotent(selectors.dialog_check_writable)(
            user_id=self.user.pk, session=target
        )
