"""The one small interface every chat app implements, and the path its messages take.

Inbound, a platform adapter turns a webhook body or a polled update into `IncomingMessage`s
and hands them to `handle_incoming`, which does what a WebSocket send does: resolve the
chat's dialog (B1), run a slash command (B3) or submit to the engine (C1), and answer errors
on the original message (D5). Outbound, the adapter implements `PlatformClient` (send, edit,
plain text) and `StreamingSink` turns that into a D4 channel sink: one platform message per
turn, edited as the answer grows (throttled, latest wins, a 429's retry_after honoured), a
final edit with the terminal, and long answers continued in further messages.

A third platform adds one module beside `telegram.py` and `feishu.py` with its client, its
inbound parser and a route, plus its sink in `CHAT["SINKS"]`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import IO, Any

from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone, translation
from django.utils.translation import gettext as _

from audit.trail import Actor
from chatcore.common.dbthreads import on_db
from chatcore.common.errors import ChatError, InternalError, StorageError
from chatcore.engine import commands
from chatcore.engine.delivery import DeliveryError, Terminal, fallback_text
from chatcore.engine.engine import Engine, Inbound

from ..connection import run_command
from . import store
from .media import PlatformMedia, store_all, unavailable

logger = logging.getLogger(__name__)

# Inbound event ids are kept this long for de-duplication (D5).
EVENT_KEEP = timedelta(days=7)
EVENT_PURGE_INTERVAL = 3600.0


class RetryAfter(DeliveryError):
    """The platform asked to wait (HTTP 429 with retry_after)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"retry after {seconds}s")
        self.seconds = seconds


@dataclass(frozen=True)
class IncomingMessage:
    """One platform message, normalised (D5)."""

    channel: str
    chat_id: str
    is_group: bool
    sender_id: str
    sender_name: str
    message_id: str
    text: str
    # A private chat, or a group message that mentions the bot or replies to it.
    addressed: bool
    reply_to_message_id: str | None = None
    chat_title: str = ""
    # The sender's language when the platform tells it (Telegram's language_code), F5.
    language: str = ""
    received_at: datetime = field(default_factory=timezone.now)
    # H3: the photos, images, documents and files it carries (`media.py`).
    media: tuple[PlatformMedia, ...] = ()


class PlatformClient(ABC):
    """Outbound calls of one platform. Raise `RetryAfter` on 429, `TargetNotFound` when the
    chat or message is gone, `DeliveryError` on any other refusal."""

    channel = ""
    # Longest message the platform takes, in characters of the rendered text.
    limit = 4096

    @abstractmethod
    def render(self, markdown: str) -> str: ...

    @abstractmethod
    async def send(self, chat_id: str, rendered: str, *, reply_to: str | None) -> str:
        """Send a rendered message; returns its message id."""
        ...

    @abstractmethod
    async def edit(self, chat_id: str, message_id: str, rendered: str) -> None: ...

    @abstractmethod
    async def send_text(self, chat_id: str, text: str, *, reply_to: str | None) -> str:
        """Send plain text (no markup), e.g. a command's reply or a fallback."""
        ...

    async def download(
        self, message: IncomingMessage, media: PlatformMedia
    ) -> tuple[IO[bytes], int]:
        """H3: a file of an inbound message, as a temporary file and its size."""
        raise unavailable()

    async def aclose(self) -> None:
        return None


@dataclass
class StreamHandle:
    client: PlatformClient
    chat_id: str
    message_id: str
    turn_id: str
    interval: float
    last_edit: float = 0.0
    blocked_until: float = 0.0
    shown: str = ""
    claimed: bool = False


PLACEHOLDER = "…"


class StreamingSink(ABC):
    """The D4 sink of a platform (see `chatcore.engine.delivery.ChannelSink`)."""

    channel = ""

    @abstractmethod
    def make_client(self) -> PlatformClient: ...

    def edit_interval(self) -> float:
        return float(settings.CHATAPPS[self.channel]["EDIT_INTERVAL_SECONDS"])

    async def open(self, target: dict[str, Any]) -> StreamHandle:
        client = self.make_client()
        try:
            message_id = await client.send(
                target["chat_id"], PLACEHOLDER, reply_to=target.get("reply_to")
            )
        except BaseException:
            await client.aclose()
            raise
        turn_id = str(target.get("turn_id") or "")
        if turn_id:
            await on_db(store.delivery_record)(
                turn_id=turn_id,
                channel=self.channel,
                chat_id=target["chat_id"],
                message_id=message_id,
                target={k: v for k, v in target.items() if isinstance(v, str | int | None)},
            )
        return StreamHandle(
            client=client,
            chat_id=target["chat_id"],
            message_id=message_id,
            turn_id=turn_id,
            interval=self.edit_interval(),
            last_edit=time.monotonic(),
        )

    async def update(self, handle: StreamHandle, text: str) -> None:
        """Latest wins: an update within the edit interval (or a 429's wait) is skipped; a
        later update or the final edit carries the newer text."""
        now = time.monotonic()
        if now < handle.blocked_until or now - handle.last_edit < handle.interval:
            return
        pieces = _pieces(handle.client, text)
        preview = pieces[0] if len(pieces) == 1 else pieces[0] + "\n" + PLACEHOLDER
        if preview == handle.shown:
            return
        handle.last_edit = now
        try:
            await handle.client.edit(handle.chat_id, handle.message_id, preview)
            handle.shown = preview
        except RetryAfter as exc:
            handle.blocked_until = time.monotonic() + exc.seconds
            logger.info("platform asked to slow down for %.1fs", exc.seconds)

    async def finish(self, handle: StreamHandle, terminal: Terminal) -> None:
        """The final edit: the whole answer (continued in further messages when longer than
        the platform allows), or the partial with a short note for a stop or failure."""
        if handle.turn_id and not handle.claimed:
            if not await on_db(store.delivery_claim)(turn_id=handle.turn_id):
                await handle.client.aclose()
                return  # another process already showed this turn's end
            handle.claimed = True
        pieces = _pieces(handle.client, terminal_markdown(terminal))
        wait = handle.blocked_until - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        try:
            await handle.client.edit(handle.chat_id, handle.message_id, pieces[0])
        except RetryAfter as exc:
            handle.blocked_until = time.monotonic() + exc.seconds
            raise
        for piece in pieces[1:]:
            await handle.client.send(handle.chat_id, piece, reply_to=None)
        await handle.client.aclose()

    async def send_plain(self, target: dict[str, Any], text: str) -> None:
        client = self.make_client()
        try:
            for piece in _plain_pieces(client, text):
                await client.send_text(target["chat_id"], piece, reply_to=target.get("reply_to"))
        finally:
            await client.aclose()


def terminal_markdown(terminal: Terminal) -> str:
    """What the streaming message finally says."""
    if terminal.status == "completed":
        return terminal.text or _("(no answer)")
    note = (
        _("⏹ Stopped.")
        if terminal.status == "cancelled"
        else _("⚠ %(error)s") % {"error": terminal.error_message or _("The answer failed.")}
    )
    return f"{terminal.text}\n\n{note}" if terminal.text else note


def _pieces(client: PlatformClient, markdown: str) -> list[str]:
    from .render import pieces_for

    return pieces_for(markdown, limit=client.limit, render=client.render)


def _plain_pieces(client: PlatformClient, text: str) -> list[str]:
    return [text[i : i + client.limit] for i in range(0, len(text), client.limit)] or [""]


# --- inbound ------------------------------------------------------------------------------


async def handle_incoming(
    *,
    engine: Engine,
    client: PlatformClient,
    message: IncomingMessage,
    claim: store.EventClaim | None = None,
) -> str:
    """The path of one platform message: ignored (a group message not for the bot), a slash
    command answered in the chat, or a send/steer submitted to the engine. Every refusal is
    answered on the original message (D5). Returns what happened; "retry" when the database
    could not take the message (the event is given back for the platform to redeliver).

    With the event's `claim`, the event is marked handled in the transaction that enqueues
    the turn or stages the input, so a crash before that leaves it to the redelivery and a
    crash after it never makes a second turn. A command marks it after its effect."""
    if not message.addressed:
        await settle_event(claim)
        return "ignored"
    with translation.override(_language(message.language)):
        return await _handle(engine, client, message, claim)


def _language(code: str) -> str:
    if code:
        try:
            return translation.get_supported_language_variant(code)
        except LookupError:
            pass
    return str(settings.LANGUAGE_CODE)


async def _handle(
    engine: Engine, client: PlatformClient, message: IncomingMessage, claim: store.EventClaim | None
) -> str:
    text = message.text.strip()
    try:
        ctx = await on_db(store.chat_context)(
            channel=message.channel,
            chat_id=message.chat_id,
            is_group=message.is_group,
            chat_title=message.chat_title,
            sender_id=message.sender_id,
            sender_name=message.sender_name,
        )
        if commands.is_command(text):
            cmd = commands.CommandContext(
                owner=ctx.owner,
                channel=message.channel,
                chat_id=message.chat_id,
                current=ctx.current,
                engine=engine,
                actor=Actor.of_user(ctx.owner, via=message.channel),
            )
            # B3: refused during shutdown like a send (the same path as the web chat's).
            result = await run_command(engine, cmd, text)
            if result.current is not None:
                await on_db(store.chat_set_current)(
                    chat=ctx.chat, dialog_id=result.current.dialog_id
                )
            if claim is not None:
                await on_db(store.event_accept)(claim)
            await client.send_text(message.chat_id, result.content, reply_to=message.message_id)
            return "command"
        # H3: its files, stored as uploads of the dialog's owner (who reads the dialog, also
        # on the web when linked; in a group, not every sender); a message with files is a
        # send.
        attachments = await store_all(client, message, owner_id=ctx.current.owner_id)
        mode = "send"
        if (
            message.reply_to_message_id
            and not attachments
            and await on_db(store.running_turn_of_message)(
                channel=message.channel,
                chat_id=message.chat_id,
                message_id=message.reply_to_message_id,
            )
        ):
            # C4: a reply to the answer being written steers it.
            mode = "steer"
        inbound = Inbound(
            owner=ctx.sender,
            channel=message.channel,
            chat_id=message.chat_id,
            content=text,
            sender_id=message.sender_id,
            mode=mode,
            client_msg_id=message.message_id,
            reply_to=message.message_id,
            received_at=message.received_at,
            channel_context=_context(message),
            media=tuple(attachments),
            accept=functools.partial(store.event_accept, claim) if claim is not None else None,
        )
        await engine.submit(inbound, ctx.current)
        return mode
    except store.EventAlreadyAccepted:
        return "duplicate"
    except (StorageError, DatabaseError) as exc:
        # Nothing was accepted: give the event back so the platform's redelivery (or the
        # next poll) brings the message again, rather than answering an error for it.
        logger.warning("chat app message not stored, left for redelivery: %s", exc)
        await _release(claim)
        return "retry"
    except ChatError as exc:
        await _answer_error(client, message, exc.message)
        await settle_event(claim)
        return "error"
    except Exception:
        logger.exception("chat app message failed", extra={"chat_id": message.chat_id})
        await _answer_error(client, message, InternalError().message)
        await settle_event(claim)
        return "error"


async def settle_event(claim: store.EventClaim | None) -> None:
    """Mark an event handled that needs no accepting write (ignored, or answered with a
    refusal): a redelivery of it is a duplicate."""
    if claim is None:
        return
    try:
        await on_db(store.event_accept)(claim)
    except store.EventAlreadyAccepted:
        pass
    except Exception as exc:
        logger.warning("could not mark a chat app event handled: %s", type(exc).__name__)


async def _release(claim: store.EventClaim | None) -> None:
    if claim is None:
        return
    try:
        await on_db(store.event_release)(claim)
    except Exception as exc:
        # The claim then times out (store.EVENT_CLAIM_TIMEOUT) and a redelivery takes it.
        logger.warning("could not give a chat app event back: %s", type(exc).__name__)


def _context(message: IncomingMessage) -> dict[str, Any]:
    """Opaque platform context kept in the message source and handed back to the sink."""
    context: dict[str, Any] = {"reply_to": message.message_id, "sender_name": message.sender_name}
    if message.reply_to_message_id:
        context["in_reply_to"] = message.reply_to_message_id
    return context


async def _answer_error(client: PlatformClient, message: IncomingMessage, text: str) -> None:
    try:
        await client.send_text(message.chat_id, text, reply_to=message.message_id)
    except Exception as exc:
        logger.warning("could not answer an error on the platform: %s", type(exc).__name__)


# --- per-process adapter state -------------------------------------------------------------


class Adapter(ABC):
    """What a platform keeps per engine (per process): its start-up work (done once) and the
    loop that closes deliveries left open by a process that died mid-turn (D4, C11)."""

    channel = ""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.started = False
        self.ready = False
        self._lock = asyncio.Lock()

    @abstractmethod
    def client(self) -> PlatformClient: ...

    async def on_start(self) -> None:
        return None

    async def start(self) -> None:
        """Once per process: the start-up calls (tried again on the next message while they
        fail) and the reconcile loop."""
        async with self._lock:
            if not self.ready:
                try:
                    await self.on_start()
                    self.ready = True
                except Exception as exc:
                    logger.warning("%s adapter start-up call failed: %s", self.channel, exc)
            if not self.started:
                self.started = True
                self.engine.supervisor.spawn(
                    f"{self.channel}-reconcile", self._reconcile_loop(), daemon=True
                )

    async def _reconcile_loop(self) -> None:
        last_purge = 0.0
        while True:
            try:
                await self.reconcile()
                if time.monotonic() - last_purge >= EVENT_PURGE_INTERVAL:
                    # Platforms redeliver for hours, not weeks: old event ids can go.
                    last_purge = time.monotonic()
                    await on_db(store.events_purge)(older_than=EVENT_KEEP)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("%s delivery reconcile failed", self.channel)
            await asyncio.sleep(settings.CHAT["DELIVERY_RECONCILE_SECONDS"])

    async def reconcile(self, grace: timedelta | None = None) -> int:
        """Show the terminal of turns whose streaming message a dead process left open (the
        turn ended at least `grace` ago, by default `CHAT["DELIVERY_ORPHAN_GRACE_SECONDS"]`)."""
        if grace is None:
            grace = timedelta(seconds=settings.CHAT["DELIVERY_ORPHAN_GRACE_SECONDS"])
        done = 0
        rows = await on_db(store.deliveries_orphaned)(channel=self.channel, grace=grace)
        for delivery, turn, partial in rows:
            if not await on_db(store.delivery_claim)(turn_id=str(turn.pk)):
                continue
            status = turn.status if turn.status in ("completed", "cancelled") else "failed"
            terminal = Terminal(status=status, text=partial, error_message=turn.error_message)
            client = self.client()
            try:
                rendered = _pieces(client, terminal_markdown(terminal))[0]
                await client.edit(delivery.chat_id, delivery.message_id, rendered)
            except Exception as exc:
                logger.warning("closing an orphaned delivery failed: %s", type(exc).__name__)
                text = fallback_text(terminal)
                if text:
                    await client.send_text(
                        delivery.chat_id, text, reply_to=delivery.target.get("reply_to")
                    )
            finally:
                await client.aclose()
            done += 1
        return done


_adapters: weakref.WeakKeyDictionary[Engine, dict[str, Adapter]] = weakref.WeakKeyDictionary()


async def adapter_for(engine: Engine, channel: str, make: Callable[[Engine], Adapter]) -> Adapter:
    """The started adapter of a platform for this process's engine."""
    per_engine = _adapters.setdefault(engine, {})
    adapter = per_engine.get(channel)
    if adapter is None:
        adapter = per_engine[channel] = make(engine)
    await adapter.start()
    return adapter
