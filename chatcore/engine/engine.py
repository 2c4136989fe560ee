"""The engine of one process: admission (ingress), the durable per-session FIFO with its
database lease (queue), running turns (builder -> runner -> committer), stop/steer/inject/
retry, snapshots, recovery and supervision.

Turns of one dialog never overlap, across processes too (C3): a process runs a dialog's
turns only while it holds the dialog's lease (`lease.Lease`), renewed while it works. Every
write of a turn checks the lease's epoch in its own transaction, and a lost renewal cancels
the turn at once (G2). Queue items are `Turn` rows, stored before they are acknowledged
(C2). Stop reaches the running turn at once in this process, through the channel layer's
control group in another, and through the turn row's `cancel_requested` flag as a fallback
(C6).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.contrib.auth.models import User
from django.db import DatabaseError, transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from chatcore.common import events, publish
from chatcore.common.errors import (
    BadRequest,
    NotFound,
    NothingToContinue,
    NothingToRetry,
    Overloaded,
    QueueFull,
    ReadOnlyDialog,
    ShuttingDown,
    TooLarge,
)
from chatcore.common.ids import FIRST_PARTY_CHANNELS, storable_text
from sessions_app import selectors, services
from sessions_app.models import (
    Message,
    MessageKind,
    MessageStatus,
    Role,
    Session,
    StagedInput,
    Turn,
    TurnMode,
    TurnStatus,
)

from . import jobs, lease, limits
from .delivery import DeliveryCoordinator, DeliveryHandle, Terminal, sink_for_channel
from .layerwatch import LayerWatch
from .lease import Lease, LeaseLost
from .provider import ChatProvider, provider_from_settings
from .scheduler import CeleryScheduler, InProcessScheduler, Scheduler
from .sessions import SessionStates
from .supervisor import TaskSupervisor
from .tools import ToolContext, ToolRegistry, registry_from_settings
from .turns.builder import CONTINUE_INSTRUCTION, RuntimeInfo, TurnInputBuilder
from .turns.committer import CommitResult, commit_outcome, record_turn_start, take_staged
from .turns.outcome import (
    Cancelled,
    Completed,
    Failed,
    FailureKind,
    Notice,
    PendingMessage,
    Stale,
    TurnOutcome,
    present_failure,
)
from .turns.runner import TurnRunner, TurnSnapshot

logger = logging.getLogger(__name__)


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


@dataclass
class LocalTurn:
    turn_id: str
    session: Session
    snapshot: TurnSnapshot
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    frame: int = 0
    published_offset: int = 0
    published_version: int = 0
    delivery: DeliveryHandle | None = None
    ended: bool = False
    lease: Lease | None = None

    @property
    def may_speak(self) -> bool:
        """G2: frames that are not database writes (snapshots) go out only while the lease
        is confirmed recently enough; a thawed process stays quiet until it knows."""
        return self.lease is None or self.lease.trusted


# `_claim_next`: the dialog has queued turns but its owner has no free slot (F7).
HELD_BACK = object()


def _process_id() -> str:
    return f"{socket.gethostname()[:40]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Engine:
    def __init__(
        self,
        *,
        provider: ChatProvider | None = None,
        tools: ToolRegistry | None = None,
        builder: TurnInputBuilder | None = None,
        scope: Callable[[Any], Any] | None = None,
        name: str | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.process_id = name or _process_id()
        # F7: at most CHAT["MODEL_CALLS_MAX"] model calls of this process at once.
        self.provider = limits.bounded(provider or provider_from_settings(), settings.CHAT)
        self.tools = tools or registry_from_settings()
        self.states = SessionStates()
        self.builder = builder or TurnInputBuilder(states=self.states)
        self.supervisor = TaskSupervisor(self.process_id)
        # Background jobs (B4, B5): Celery in scaled mode, this engine's supervisor otherwise.
        self.scheduler: Scheduler = scheduler or (
            CeleryScheduler()
            if settings.SCALED
            else InProcessScheduler(
                spawn=self.supervisor.spawn,
                provider=self.provider,
                loop=lambda: self.loop,
                closing=lambda: self.closing,
            )
        )
        # F7: open WebSockets per user, counted by the consumers of this process.
        self.sockets = limits.SocketRegistry()
        # Optional filter of the dialogs this engine picks up by itself in sweeps (the terminal
        # channel only resumes its own chat).
        self.scope = scope
        self.local: dict[str, LocalTurn] = {}
        self._workers: dict[str, asyncio.Task[Any]] = {}
        self._wakeups: dict[str, asyncio.Event] = {}
        self._leases: dict[str, Lease] = {}
        # G5: connections of this process register to be closed when the layer lost frames.
        self.layer_watch = LayerWatch()
        self._control_channel: str | None = None
        self._started = False
        self.cfg = settings.CHAT
        self.loop: asyncio.AbstractEventLoop | None = None
        self.delivery = DeliveryCoordinator(
            retries=self.cfg["SINK_RETRIES"],
            backoff=self.cfg["SINK_BACKOFF_SECONDS"],
            timeout=self.cfg["SINK_TIMEOUT_SECONDS"],
        )

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self.loop = asyncio.get_running_loop()
        publish.bind_loop(self.loop, spawn=self._spawn_publish)
        layer = get_channel_layer()
        if layer is not None:
            self._control_channel = await layer.new_channel("engine.")
            await layer.group_add(publish.engine_control_group(), self._control_channel)
            self.supervisor.spawn("control", self._control_loop(), daemon=True)
            if settings.SCALED:
                self.supervisor.spawn("layer-watch", self.layer_watch.run(layer), daemon=True)
        self.supervisor.spawn("sweep", self._sweep_loop(), daemon=True)
        # Load the tokenizer's tables now, off the loop, not in the first turn's build.
        await asyncio.to_thread(lambda: self.builder.counter)

    async def shutdown(self, grace: float | None = None) -> None:
        """Refuse new work, end running turns as interrupted (their queued successors stay
        queued for the next process), release leases, reap every task (F1)."""
        grace = self.cfg["SHUTDOWN_GRACE_SECONDS"] if grace is None else grace
        self.supervisor.close()
        for local in list(self.local.values()):
            local.cancel.set()
        await self.supervisor.shutdown(grace=grace)
        layer = get_channel_layer()
        if layer is not None and self._control_channel:
            try:
                await layer.group_discard(publish.engine_control_group(), self._control_channel)
            except Exception:
                logger.warning("control group discard failed")
        await self.provider.aclose()

    def _spawn_publish(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        return self.supervisor.spawn(name, coro)

    @property
    def closing(self) -> bool:
        return self.supervisor.closing

    # --- ingress (C1, C2, C4, C5) --------------------------------------------------------

    def _check_content(self, content: object) -> str:
        if not isinstance(content, str) or not content.strip():
            raise BadRequest(_("The message is empty."))
        if not storable_text(content):
            raise BadRequest(_("The message contains characters that cannot be stored."))
        if len(content) > self.cfg["CONTENT_LIMIT"]:
            raise TooLarge(
                _("The message is too long (at most %(n)d characters).")
                % {"n": self.cfg["CONTENT_LIMIT"]}
            )
        return content

    async def submit(self, inbound: Inbound, session: Session) -> Ack:
        """Admit one send/steer/inject for a dialog. Refusals raise and change nothing."""
        if self.closing:
            raise ShuttingDown()
        if inbound.mode not in ("send", "steer", "inject"):
            raise BadRequest(_("Unknown mode %(mode)s.") % {"mode": inbound.mode})
        self._check_content(inbound.content)
        if len(inbound.client_msg_id) > 128:
            raise BadRequest(_("client_msg_id is too long (at most 128 characters)."))
        external = session.channel not in FIRST_PARTY_CHANNELS
        if (
            external
            and inbound.channel != session.channel
            and not await sync_to_async(selectors.external_write_allowed)(
                user_id=inbound.owner.pk, session=session
            )
        ):
            # A chat-app dialog linked read-only to this web user.
            raise ReadOnlyDialog()
        await limits.acharge(inbound.owner.pk, limits.SEND, self.cfg)
        ack = await sync_to_async(self._admit)(inbound, session)
        if ack.turn_id is not None:
            await self.kick(session.pk)
        return ack

    def _admit(self, inbound: Inbound, session: Session) -> Ack:
        def write() -> tuple[Ack, Turn | None, services.Appended | None]:
            with transaction.atomic():
                live = _lock_live(session.pk)
                if inbound.accept is not None:
                    inbound.accept()
                busy = Turn.objects.filter(
                    session_id=session.pk, status__in=(TurnStatus.QUEUED, TurnStatus.RUNNING)
                ).exists()
                if inbound.mode in ("steer", "inject") and busy:
                    # C4/C5: staged durably, recorded at the running turn's next step boundary.
                    StagedInput.objects.create(
                        session_id=session.pk,
                        mode=inbound.mode,
                        content=inbound.content,
                        client_msg_id=inbound.client_msg_id,
                        source=inbound.source(),
                        received_at=inbound.received_at,
                    )
                    running = Turn.objects.filter(
                        session_id=session.pk, status=TurnStatus.RUNNING
                    ).first()
                    return (
                        Ack(
                            live,
                            str(running.pk) if running else None,
                            0,
                            inbound.mode,
                            inbound.client_msg_id,
                        ),
                        None,
                        None,
                    )
                if inbound.mode == "inject":
                    # C5: idle inject is appended to history without running the model.
                    appended = services.messages_append(
                        session_pk=session.pk,
                        session=live,
                        messages=[
                            services.NewMessage(
                                role=Role.USER,
                                content=inbound.content,
                                kind=MessageKind.INJECT,
                                created_at=inbound.received_at,
                                source=inbound.source(),
                            )
                        ],
                    )
                    return (
                        Ack(appended.session, None, 0, "inject", inbound.client_msg_id),
                        None,
                        appended,
                    )
                turn = self._enqueue_locked(
                    live,
                    owner_id=inbound.owner.pk,
                    content=inbound.content,
                    client_msg_id=inbound.client_msg_id,
                    source=inbound.source(),
                    received_at=inbound.received_at,
                )
                position = self._position(turn)
                # An idle steer is a send (C4), acknowledged as such.
                return (
                    Ack(
                        live,
                        str(turn.pk),
                        position,
                        "send" if inbound.mode == "steer" else inbound.mode,
                        inbound.client_msg_id,
                    ),
                    turn,
                    None,
                )

        ack, _turn, appended = services.storage_retry(write, what="admit", session=session)
        if appended is not None:
            self.states.apply_appended(appended)
        return ack

    def _enqueue_locked(
        self,
        session: Session,
        *,
        owner_id: int,
        content: str,
        client_msg_id: str,
        source: dict[str, Any],
        received_at: datetime,
        mode: str = TurnMode.SEND,
        retry_of: Turn | None = None,
    ) -> Turn:
        """Append a queue item; the caller holds the session row lock in a transaction."""
        queued = Turn.objects.filter(session_id=session.pk, status=TurnStatus.QUEUED).count()
        if queued >= self.cfg["QUEUE_CAPACITY"]:
            raise QueueFull()
        if (
            Turn.objects.filter(status=TurnStatus.QUEUED).count()
            >= self.cfg["GLOBAL_ADMISSION_BOUND"]
        ):
            raise Overloaded()
        Session.objects.filter(pk=session.pk).update(turn_counter=session.turn_counter + 1)
        session.turn_counter += 1
        return Turn.objects.create(
            session_id=session.pk,
            owner_id=owner_id,
            number=session.turn_counter,
            mode=mode,
            content=content,
            client_msg_id=client_msg_id,
            source=source,
            received_at=received_at,
            retry_of=retry_of,
        )

    @staticmethod
    def _position(turn: Turn) -> int:
        """How many turns of the dialog are ahead of this one (0 = runs now)."""
        return (
            Turn.objects.filter(session_id=turn.session_id)
            .filter(
                Q(status=TurnStatus.RUNNING) | Q(status=TurnStatus.QUEUED, number__lt=turn.number)
            )
            .count()
        )

    # --- stop / retry (C6) -------------------------------------------------------------------

    async def stop(self, session: Session) -> StopResult:
        """Abort the running turn at once, drop unstarted sends and staged steers."""
        running, dropped = await sync_to_async(self._stop_write)(session)
        for turn in dropped:
            await publish.apublish(
                publish.chat_group(session.channel, session.chat_id),
                events.turn_updated_frame(
                    session_id=session.session_id,
                    turn_id=str(turn.pk),
                    status=TurnStatus.CANCELLED,
                    reason="dropped",
                    client_msg_id=turn.client_msg_id,
                ),
            )
        if running is not None:
            await self.signal_cancel(str(running.pk))
        return StopResult(stopped_running=running is not None, dropped=len(dropped))

    def _stop_write(self, session: Session) -> tuple[Turn | None, list[Turn]]:
        def write() -> tuple[Turn | None, list[Turn]]:
            with transaction.atomic():
                Session.objects.select_for_update().filter(pk=session.pk).first()
                now = timezone.now()
                running = Turn.objects.filter(
                    session_id=session.pk, status=TurnStatus.RUNNING
                ).first()
                if running is not None:
                    Turn.objects.filter(pk=running.pk).update(cancel_requested=True)
                dropped = list(Turn.objects.filter(session_id=session.pk, status=TurnStatus.QUEUED))
                Turn.objects.filter(pk__in=[t.pk for t in dropped]).update(
                    status=TurnStatus.CANCELLED, reason="dropped", finished_at=now
                )
                StagedInput.objects.filter(
                    session_id=session.pk,
                    status=StagedInput.Status.STAGED,
                    mode=StagedInput.Mode.STEER,
                ).update(status=StagedInput.Status.DROPPED)
                return running, dropped

        return services.storage_retry(write, what="stop", session=session)

    async def cancel_for_delete(self, session: Session) -> None:
        """Before a delete: the running turn is cancelled and will find itself stale (C9)."""
        running = await sync_to_async(selectors.turn_running)(session_pk=session.pk)
        if running is not None:
            await sync_to_async(Turn.objects.filter(pk=running.pk).update)(cancel_requested=True)
            await self.signal_cancel(str(running.pk))

    async def signal_cancel(self, turn_id: str) -> None:
        local = self.local.get(turn_id)
        if local is not None:
            local.cancel.set()
            return
        layer = get_channel_layer()
        if layer is not None:
            await layer.group_send(
                publish.engine_control_group(), {"type": "engine.cancel", "turn_id": turn_id}
            )

    async def retry(self, session: Session, *, owner: User, client_msg_id: str = "") -> Ack:
        """C6: re-run the last failed or cancelled turn as a new turn, without adding its user
        message again (a send dropped before it started never had one, so it gets it)."""
        if self.closing:
            raise ShuttingDown()
        # F7: a retry starts model work, so it is charged to the send rate.
        await limits.acharge(owner.pk, limits.SEND, self.cfg)

        def write() -> Ack:
            with transaction.atomic():
                live = _lock_live(session.pk)
                last = Turn.objects.filter(session_id=session.pk).order_by("-number").first()
                if last is None or last.status not in (TurnStatus.FAILED, TurnStatus.CANCELLED):
                    raise NothingToRetry()
                if last.reason == "stale":
                    raise NothingToRetry()
                started = last.started_at is not None
                if started:
                    mode = TurnMode.RETRY
                else:
                    # A dropped continuation is retried as one (it has no user message).
                    mode = TurnMode.CONTINUE if last.source.get("continues") else TurnMode.SEND
                turn = self._enqueue_locked(
                    live,
                    owner_id=owner.pk,
                    content=last.content,
                    client_msg_id=client_msg_id,
                    source=dict(last.source, retry_of=str(last.pk)),
                    received_at=timezone.now() if started else last.received_at,
                    mode=mode,
                    retry_of=last,
                )
                return Ack(live, str(turn.pk), self._position(turn), "retry", client_msg_id)

        ack = await sync_to_async(services.storage_retry)(write, what="retry", session=session)
        await self.kick(session.pk)
        return ack

    async def continue_answer(
        self, session: Session, *, owner: User, client_msg_id: str = ""
    ) -> Ack:
        """E5: go on with the last answer when the model cut it at its length limit, as a new
        turn (mode `continue`) whose text is stored as a message linked to the cut one
        (`source.continues`); stored messages are never rewritten (B5), the builder and the
        clients join them. Charged to the send rate like a send."""
        if self.closing:
            raise ShuttingDown()
        await limits.acharge(owner.pk, limits.SEND, self.cfg)

        def write() -> Ack:
            with transaction.atomic():
                live = _lock_live(session.pk)
                cut = _continuable_answer(session.pk)
                if cut is None:
                    raise NothingToContinue()
                turn = self._enqueue_locked(
                    live,
                    owner_id=owner.pk,
                    content="",
                    client_msg_id=client_msg_id,
                    source={"continues": str(cut.pk)},
                    received_at=timezone.now(),
                    mode=TurnMode.CONTINUE,
                )
                return Ack(live, str(turn.pk), self._position(turn), "continue", client_msg_id)

        ack = await sync_to_async(services.storage_retry)(write, what="continue", session=session)
        await self.kick(session.pk)
        return ack

    # --- queue workers (C1, C3, C11) -------------------------------------------------------

    def _acquire_lease(self, session_pk: str) -> Lease | None:
        """Take a free or expired lease with a new epoch. Not re-entrant: two workers of one
        process never run the same dialog, and a live lease of another process is never
        stolen (C11)."""
        return lease.acquire(session_pk, owner=self.process_id, seconds=self.cfg["LEASE_SECONDS"])

    async def kick(self, session_pk: str) -> None:
        """Make sure someone runs this dialog's queue: this process if it can take the lease;
        otherwise the lease holder, which re-reads the queue after every turn."""
        if self.closing:
            return
        worker = self._workers.get(session_pk)
        if worker is not None and not worker.done():
            self._wakeups[session_pk].set()
            return
        held = await sync_to_async(self._acquire_lease)(session_pk)
        if held is None:
            return
        worker = self._workers.get(session_pk)
        if worker is not None and not worker.done():
            # Another kick of this process won meanwhile; it cannot hold our lease, but be safe.
            self._wakeups[session_pk].set()
            return
        self._wakeups[session_pk] = asyncio.Event()
        self._leases[session_pk] = held
        try:
            self._workers[session_pk] = self.supervisor.spawn(
                f"worker:{session_pk}", self._worker(session_pk)
            )
        except ShuttingDown:
            self._leases.pop(session_pk, None)
            await sync_to_async(lease.release)(held)

    async def _worker(self, session_pk: str) -> None:
        wake = self._wakeups[session_pk]
        held = self._leases[session_pk]
        renew = self.supervisor.spawn(
            f"lease:{session_pk}", self._renew_loop(session_pk), daemon=True
        )
        try:
            await sync_to_async(self._recover_interrupted)(session_pk, held)
            while not self.closing:
                wake.clear()
                turn = await sync_to_async(self._claim_next)(session_pk, held)
                if isinstance(turn, Turn):
                    await self._run_turn(turn, held)
                    await self._start_waiting(turn)
                    continue
                # Release, then look once more: an item enqueued meanwhile is either seen
                # here or its enqueuer's kick finds no worker and takes the lease itself.
                await sync_to_async(lease.release)(held)
                if turn is HELD_BACK:
                    # F7: the owner runs the most turns allowed. The queue waits, leaseless,
                    # until one of the owner's turns ends (`_start_waiting`, any process) or
                    # the sweep; a kick that came meanwhile means a slot may be free now.
                    if wake.is_set():
                        again = await sync_to_async(self._acquire_lease)(session_pk)
                        if again is not None:
                            held = self._leases[session_pk] = again
                            continue
                    break
                if await sync_to_async(self._has_queued)(session_pk) or wake.is_set():
                    again = await sync_to_async(self._acquire_lease)(session_pk)
                    if again is not None:
                        held = self._leases[session_pk] = again
                        continue
                # No await from the last check to the pop below (kick runs only at awaits).
                break
        except LeaseLost:
            # G2: another process took the dialog over; it runs the queue from here on.
            logger.error("lost the lease of a dialog", extra={"session_id": session_pk})
        finally:
            renew.cancel()
            self._workers.pop(session_pk, None)
            self._wakeups.pop(session_pk, None)
            self._leases.pop(session_pk, None)
            if not held.released and not held.lost:
                try:
                    await asyncio.shield(sync_to_async(lease.release)(held))
                except Exception:
                    logger.warning("lease release failed", extra={"session_id": session_pk})

    async def _renew_loop(self, session_pk: str) -> None:
        """Renew the dialog's lease every third of its period. A renewal that finds the
        lease taken over cancels the local turn at once (its upstream stream closes) and its
        writes fail their fencing check (G2). A renewal that fails on the database retries;
        the lease is lost only when the database says so."""
        interval = self.cfg["LEASE_SECONDS"] / 3
        while True:
            await asyncio.sleep(interval)
            held = self._leases.get(session_pk)
            if held is None or held.released or held.lost:
                continue
            try:
                if await sync_to_async(lease.renew)(held):
                    continue
            except Exception:
                logger.exception("lease renewal failed", extra={"session_id": session_pk})
                await self._reset_db()
                continue
            logger.error("lost the lease of a dialog", extra={"session_id": session_pk})
            self._lease_lost(session_pk)

    @staticmethod
    async def _reset_db() -> None:
        try:
            await sync_to_async(services.reset_broken_connection)()
        except Exception:
            logger.exception("could not reset the database connection")

    def _lease_lost(self, session_pk: str) -> None:
        for local in self.local.values():
            if local.session.pk == session_pk:
                local.cancel.set()
        wake = self._wakeups.get(session_pk)
        if wake is not None:
            wake.set()

    async def _start_waiting(self, turn: Turn) -> None:
        """F7: a turn ended; start the dialogs of its party (`limits.party`) held back by the
        cap, oldest first (whichever process takes a dialog's lease runs it)."""
        if self.closing:
            return
        try:
            waiting = await sync_to_async(self._waiting_dialogs)(turn)
        except Exception:
            logger.exception("could not list dialogs waiting for a slot")
            return
        for pk in waiting:
            await self.kick(pk)

    def _waiting_dialogs(self, turn: Turn) -> list[str]:
        pks = limits.waiting_dialogs(turn, self.cfg)
        if self.scope is not None and pks:
            allowed = set(
                self.scope(Session.objects.filter(pk__in=pks)).values_list("pk", flat=True)
            )
            pks = [pk for pk in pks if pk in allowed]
        return pks

    @staticmethod
    def _has_queued(session_pk: str) -> bool:
        return Turn.objects.filter(session_id=session_pk, status=TurnStatus.QUEUED).exists()

    def _claim_next(self, session_pk: str, held: Lease) -> Turn | object | None:
        """The dialog's next queued turn, now running; None when the queue is empty, or
        `HELD_BACK` when its owner already runs the most turns allowed (F7)."""
        return services.storage_retry(lambda: self._claim_once(session_pk, held), what="claim")

    def _claim_once(self, session_pk: str, held: Lease) -> Turn | object | None:
        with transaction.atomic():
            held.check()
            turn = (
                Turn.objects.filter(session_id=session_pk, status=TurnStatus.QUEUED)
                .select_related("session", "owner")
                .order_by("number")
                .first()
            )
            if turn is None:
                return None
            limits.lock_owner(turn.owner_id)
            if not limits.turn_may_start(turn, self.cfg):
                return HELD_BACK
            Turn.objects.filter(pk=turn.pk).update(
                status=TurnStatus.RUNNING, started_at=timezone.now()
            )
            turn.status = TurnStatus.RUNNING
            return turn

    def _recover_interrupted(self, session_pk: str, held: Lease) -> list[tuple[Turn, CommitResult]]:
        """C11: a turn still marked running while we hold a fresh lease belonged to a process
        that died. Close it as failed (`interrupted`), keeping its checkpointed partial."""
        results = []
        for turn in Turn.objects.filter(
            session_id=session_pk, status=TurnStatus.RUNNING
        ).select_related("session"):
            if str(turn.pk) in self.local:
                continue
            outcome = Failed(
                FailureKind.INTERRUPTED, detail="process died", partial=turn.partial_text
            )
            session = turn.session
            result = commit_outcome(
                turn=turn,
                outcome=outcome,
                base_generation=session.generation,
                states=self.states,
                fence=held,
            )
            logger.warning(
                "closed an interrupted turn",
                extra={"turn_id": str(turn.pk), "session_id": session.session_id},
            )
            publish.publish_to_chat(
                session,
                events.turn_updated_frame(
                    session_id=session.session_id,
                    turn_id=str(turn.pk),
                    status=result.status,
                    reason=result.reason,
                    error=result.error,
                    client_msg_id=turn.client_msg_id,
                ),
            )
            results.append((turn, result))
        return results

    # --- one turn ------------------------------------------------------------------------

    async def _run_turn(self, turn: Turn, held: Lease) -> None:
        session = turn.session
        turn_id = str(turn.pk)
        log = {"session_id": session.session_id, "turn_id": turn_id}
        snapshot = TurnSnapshot(turn_id=turn_id)
        local = LocalTurn(turn_id=turn_id, session=session, snapshot=snapshot, lease=held)
        self.local[turn_id] = local
        try:
            try:
                _appended, generation = await sync_to_async(record_turn_start)(
                    turn=turn, states=self.states, fence=held
                )
            except services.StaleSession:
                await self._finish(turn, session, Stale(), 0, fence=held)
                return
            except LeaseLost:
                logger.error("lost the lease before the turn started", extra=log)
                return
            except Exception:
                logger.exception("could not record the user message", extra=log)
                await self._finish(
                    turn,
                    session,
                    Failed(FailureKind.INPUT_PERSISTENCE, "input write failed"),
                    0,
                    fence=held,
                )
                return
            session = await sync_to_async(Session.objects.get)(pk=session.pk)
            local.session = session
            if session.deleted_at is not None:
                await self._finish(turn, session, Stale(), generation, fence=held)
                return
            sink = sink_for_channel(session.channel)
            if sink is not None:
                # D4: an external platform's streaming message for this turn.
                target = {
                    "chat_id": session.chat_id,
                    **dict(turn.source.get("context") or {}),
                    "turn_id": turn_id,
                }
                local.delivery = await self.delivery.start(sink, target)
            runtime = RuntimeInfo(
                channel=session.channel, dialog_id=session.dialog_id, title=session.title
            )
            exclude = (
                str(turn.retry_of_id) if turn.mode == TurnMode.RETRY and turn.retry_of_id else None
            )
            continues, lead = _continuation(turn)
            try:
                prepared = await self.builder.prepare(
                    session_pk=session.pk,
                    runtime=runtime,
                    exclude_turn_partials=exclude,
                    pending=lead,
                )
            except Exception:
                logger.exception("context preparation failed", extra=log)
                await self._finish(
                    turn,
                    session,
                    Failed(FailureKind.CONTEXT_PREPARATION, "prepare failed"),
                    generation,
                    fence=held,
                )
                return
            if prepared.dropped_for_budget:
                await sync_to_async(self.scheduler.schedule)(
                    "compact_session", session_pk=session.pk, manual=False
                )

            async def fetch_staged() -> list[Any]:
                return await sync_to_async(take_staged)(turn=turn, fence=held)

            runner = TurnRunner(
                provider=self.provider,
                tools=self.tools,
                builder=self.builder,
                snapshot=snapshot,
                tool_context=ToolContext(owner_id=turn.owner_id, session_pk=session.pk),
                fetch_staged=fetch_staged,
                runtime=runtime,
                session_pk=session.pk,
                # E5: a continuation is one text step that goes on with the cut answer.
                max_steps=1 if continues else self.cfg["MAX_STEPS"],
                exclude_turn_partials=exclude,
                continues=continues,
                lead=lead,
            )
            outcome = await self._run_cancellable(local, runner, prepared)
            if runner.recovered:
                await sync_to_async(self.scheduler.schedule)(
                    "compact_session", session_pk=session.pk, manual=False
                )
            await self._finish(
                turn, session, outcome, generation, delivery=local.delivery, fence=held
            )
        finally:
            self.local.pop(turn_id, None)

    async def _run_cancellable(
        self, local: LocalTurn, runner: TurnRunner, prepared: Any
    ) -> TurnOutcome:
        run = asyncio.get_running_loop().create_task(
            runner.run(prepared), name=f"run:{local.turn_id}"
        )
        cancel_wait = asyncio.get_running_loop().create_task(local.cancel.wait())
        publisher = asyncio.get_running_loop().create_task(self._publish_snapshots(local))
        heartbeat = asyncio.get_running_loop().create_task(self._checkpoint_loop(local))
        try:
            # F7: a turn has an overall deadline; a model that trickles cannot hold the
            # dialog's lease and a model slot forever.
            deadline = float(self.cfg["TURN_DEADLINE_SECONDS"])
            await asyncio.wait(
                {run, cancel_wait}, timeout=deadline, return_when=asyncio.FIRST_COMPLETED
            )
            if not run.done() and not cancel_wait.done():
                run.cancel()
                try:
                    await run
                except asyncio.CancelledError:
                    pass
                logger.warning(
                    "turn passed its deadline of %.0fs", deadline, extra={"turn_id": local.turn_id}
                )
                return Failed(
                    FailureKind.TIMEOUT,
                    "turn deadline",
                    messages=runner.pending,
                    partial=runner.partial,
                )
            if not run.done():
                # C6: cancelling the task closes the provider's HTTP stream at once.
                run.cancel()
                try:
                    await run
                except asyncio.CancelledError:
                    pass
                if self.closing:
                    return Failed(
                        FailureKind.INTERRUPTED,
                        "shutdown",
                        messages=runner.pending,
                        partial=runner.partial,
                    )
                return Cancelled(messages=runner.pending, partial=runner.partial)
            try:
                return run.result()
            except Exception as exc:
                logger.exception("turn runner failed", extra={"turn_id": local.turn_id})
                return Failed(
                    FailureKind.AGENT_CREATION,
                    str(exc),
                    messages=runner.pending,
                    partial=runner.partial,
                )
        finally:
            # Stop the helpers by flag as well as by cancel: a cancellation can be swallowed
            # inside a channel-layer call (asyncio.wait_for on Python 3.11), and the turn's end
            # must never wait on them for long.
            local.ended = True
            local.snapshot.changed.set()
            helpers = (cancel_wait, publisher, heartbeat)
            for task in helpers:
                task.cancel()
            _done, stuck = await asyncio.wait(helpers, timeout=5)
            if stuck:
                logger.error("turn helpers did not stop in time", extra={"turn_id": local.turn_id})
            await self._flush_snapshot(local)

    async def _finish(
        self,
        turn: Turn,
        session: Session,
        outcome: TurnOutcome,
        generation: int,
        *,
        delivery: DeliveryHandle | None = None,
        fence: Lease,
    ) -> None:
        try:
            result = await sync_to_async(commit_outcome)(
                turn=turn,
                outcome=outcome,
                base_generation=generation,
                states=self.states,
                fence=fence,
            )
        except LeaseLost:
            # G2: the dialog's new holder ends this turn; a stale holder commits, publishes
            # and delivers nothing.
            logger.error(
                "lost the lease; the turn's outcome was dropped",
                extra={"turn_id": str(turn.pk), "session_id": session.session_id},
            )
            return
        except Exception:
            logger.exception("commit failed", extra={"turn_id": str(turn.pk)})
            result = CommitResult(
                TurnStatus.FAILED,
                error={
                    "kind": str(FailureKind.TURN_PERSISTENCE),
                    "message": present_failure(FailureKind.TURN_PERSISTENCE),
                },
            )
        if isinstance(outcome, Failed):
            logger.warning(
                "turn failed: %s (%s)",
                outcome.kind,
                outcome.provider_kind or outcome.detail,
                extra={"turn_id": str(turn.pk), "session_id": session.session_id},
            )
        await publish.apublish(
            publish.chat_group(session.channel, session.chat_id),
            events.turn_updated_frame(
                session_id=session.session_id,
                turn_id=str(turn.pk),
                status=result.status,
                reason=result.reason,
                error=result.error,
                client_msg_id=turn.client_msg_id,
                notice=result.notice,
            ),
        )
        if delivery is not None:
            await delivery.finish(_terminal_for_sink(outcome, result))
        if result.status == TurnStatus.COMPLETED:
            try:
                if await sync_to_async(jobs.title_due)(session_pk=session.pk):
                    await sync_to_async(self.scheduler.schedule)(
                        "generate_title", session_pk=session.pk
                    )
            except DatabaseError:
                # A title is scheduled again after the next turn; the queue must go on.
                logger.warning(
                    "could not schedule after-turn jobs", extra={"turn_id": str(turn.pk)}
                )
                await self._reset_db()
        try:
            await sync_to_async(services.storage_retry)(
                lambda: self._after_turn_staged(turn, result, fence), what="after_turn"
            )
        except LeaseLost:
            logger.error("lost the lease after a turn", extra={"turn_id": str(turn.pk)})

    def _after_turn_staged(self, turn: Turn, result: CommitResult, fence: Lease) -> None:
        """Inputs staged after the last boundary are never lost: injects enter history now;
        steers after a completed turn become sends (C4: when idle, steer is a send); after a
        failure steers stay staged for the next send or retry; a stop dropped them."""
        staged = list(
            StagedInput.objects.filter(
                session_id=turn.session_id, status=StagedInput.Status.STAGED
            ).order_by("received_at")
        )
        if not staged:
            return
        injects = [s for s in staged if s.mode == StagedInput.Mode.INJECT]
        if injects and result.reason != "stale":
            appended = services.messages_append(
                session_pk=turn.session_id,
                session=turn.session,
                messages=[
                    services.NewMessage(
                        role=Role.USER,
                        content=i.content,
                        kind=MessageKind.INJECT,
                        created_at=i.received_at,
                        source=dict(i.source),
                    )
                    for i in injects
                ],
                extra=lambda _s: _mark_recorded([i.pk for i in injects]),
                guard=fence.guard,
            )
            self.states.apply_appended(appended)
        if result.status == TurnStatus.COMPLETED:
            with transaction.atomic():
                fence.check()
                session = Session.objects.get(pk=turn.session_id)
                for s in staged:
                    if s.mode != StagedInput.Mode.STEER:
                        continue
                    self._enqueue_locked(
                        session,
                        owner_id=turn.owner_id,
                        content=s.content,
                        client_msg_id=s.client_msg_id,
                        source=dict(s.source),
                        received_at=s.received_at,
                    )
                    StagedInput.objects.filter(pk=s.pk).update(status=StagedInput.Status.RECORDED)

    # --- snapshots and checkpoints (D1, C11) -------------------------------------------------

    async def _publish_snapshots(self, local: LocalTurn) -> None:
        """Coalesce to at most SNAPSHOT_FPS frames a second; each frame carries only the new
        tail of the text (`text_offset`), so bytes grow with the answer."""
        interval = 1.0 / max(1, self.cfg["SNAPSHOT_FPS"])
        snap = local.snapshot
        while not local.ended:
            await snap.changed.wait()
            snap.changed.clear()
            if local.ended:
                return
            if snap.version == local.published_version or not local.may_speak:
                continue
            await self._send_snapshot(local)
            if local.delivery is not None:
                await local.delivery.update(snap.text)
            await asyncio.sleep(interval)

    async def _send_snapshot(self, local: LocalTurn) -> None:
        """Send the tail since the last frame that was sent. It counts as sent only once the
        layer took it: a publish cancelled at turn end is sent again by the final flush, so
        the last tokens always reach clients before `turn_updated` (D1)."""
        version = local.snapshot.version
        frame = self.snapshot_frame(local, full=False)
        await publish.apublish(publish.session_group(local.session.pk), frame)
        local.published_version = version
        local.published_offset = frame["text_offset"] + len(frame["text"])

    async def _flush_snapshot(self, local: LocalTurn) -> None:
        """One last frame before the terminal when the coalescer held back a change (or its
        last publish was cancelled before the layer took it)."""
        if local.snapshot.version != local.published_version and local.may_speak:
            await self._send_snapshot(local)

    def snapshot_frame(self, local: LocalTurn, *, full: bool) -> dict[str, Any]:
        """A `turn_snapshot` frame: the whole text (`full`, for a client joining mid-turn) or
        the tail after the last frame sent to the session group."""
        snap = local.snapshot
        text = snap.text
        offset = 0 if full else min(local.published_offset, len(text))
        local.frame += 1
        return events.turn_snapshot_frame(
            session_id=local.session.session_id,
            turn_id=local.turn_id,
            text=text[offset:],
            tools=snap.tools_dicts(),
            frame=local.frame,
            text_offset=offset,
        )

    def active_snapshot(self, turn_id: str) -> dict[str, Any] | None:
        local = self.local.get(turn_id)
        if local is None or not local.may_speak:
            return None
        return self.snapshot_frame(local, full=True)

    async def _checkpoint_loop(self, local: LocalTurn) -> None:
        """C11: the partial text goes to the turn record at most every second (never to
        messages, never per token); the same round trip picks up a stop from elsewhere."""
        interval = self.cfg["CHECKPOINT_SECONDS"]
        written = ""
        while not local.ended:
            await asyncio.sleep(interval)
            if local.ended:
                return
            text = local.snapshot.text
            try:
                cancel = await sync_to_async(self._checkpoint)(
                    local.turn_id, None if text == written else text, local.lease
                )
            except LeaseLost:
                logger.error("lost the lease during a turn", extra={"turn_id": local.turn_id})
                cancel = True
            except DatabaseError:
                # G5: try again at the next beat on a fresh connection.
                logger.warning("checkpoint failed", extra={"turn_id": local.turn_id})
                await self._reset_db()
                continue
            written = text
            if cancel:
                local.cancel.set()

    @staticmethod
    def _checkpoint(turn_id: str, text: str | None, held: Lease | None) -> bool:
        with transaction.atomic():
            if held is not None:
                held.check()
            if text is not None:
                Turn.objects.filter(pk=turn_id).update(partial_text=text)
            return bool(Turn.objects.filter(pk=turn_id, cancel_requested=True).exists())

    # --- control channel and sweeps --------------------------------------------------------

    async def _control_loop(self) -> None:
        layer = get_channel_layer()
        assert layer is not None and self._control_channel is not None
        while True:
            try:
                message = await layer.receive(self._control_channel)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("control channel receive failed")
                await asyncio.sleep(1)
                continue
            try:
                await self._handle_control(layer, message)
            except asyncio.CancelledError:
                raise
            except Exception:
                # One bad message must not end cross-process stop and snapshot requests.
                logger.exception("control message failed: %s", message.get("type"))

    async def _handle_control(self, layer: Any, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "engine.cancel":
            local = self.local.get(str(message.get("turn_id")))
            if local is not None:
                local.cancel.set()
        elif kind == "engine.snapshot_request":
            frame = self.active_snapshot(str(message.get("turn_id")))
            reply = message.get("reply_channel")
            if frame is not None and reply:
                await layer.send(reply, {"type": publish.EVENT_TYPE, "frame": frame})
        elif kind == "engine.evict":
            self.evict_idle()
        elif kind == "engine.kick":
            await self.kick(str(message.get("session_pk")))

    async def _sweep_loop(self) -> None:
        """Pick up dialogs with work and no live lease (recovery after a crash, C11). In
        embedded mode also evict idle session state (A6) and purge dialogs past retention
        (A7); in scaled mode Celery beat schedules those."""
        interval = max(1.0, self.cfg["LEASE_SECONDS"] / 3)
        last_evict = time.monotonic()
        while True:
            try:
                for pk in await sync_to_async(self._orphaned_sessions)():
                    await self.kick(pk)
                if settings.SCALED:
                    await sync_to_async(self.sockets.refresh, thread_sensitive=False)()
                if (
                    not settings.SCALED
                    and time.monotonic() - last_evict >= self.cfg["CLEANUP_INTERVAL_SECONDS"]
                ):
                    last_evict = time.monotonic()
                    self.evict_idle()
                    await sync_to_async(services.sessions_purge_expired)()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("sweep failed")
                await self._reset_db()
            await asyncio.sleep(interval)

    def evict_idle(self) -> int:
        busy = {local.session.pk for local in self.local.values()} | set(self._workers)
        return self.states.evict_expired(busy=busy)

    def _orphaned_sessions(self) -> list[str]:
        now = timezone.now()
        qs = Session.objects.filter(
            turns__status__in=(TurnStatus.QUEUED, TurnStatus.RUNNING)
        ).filter(Q(lease_owner="") | Q(lease_expires_at__lt=now))
        if self.scope is not None:
            qs = self.scope(qs)
        # F7: dialogs of owners at their running-turn cap wait for one of those turns to end.
        qs = limits.not_held_back(qs, self.cfg)
        return list(qs.values_list("pk", flat=True).distinct()[:100])

    # --- reading state for clients ---------------------------------------------------------

    async def wait_idle(self, session_pk: str | None = None, timeout: float = 30.0) -> None:
        """Wait until this engine has no worker (for one dialog, or at all)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            workers = [
                w for pk, w in self._workers.items() if session_pk is None or pk == session_pk
            ]
            if not workers:
                return
            await asyncio.wait(workers, timeout=max(0.0, deadline - time.monotonic()))
        raise TimeoutError("engine did not become idle")


def _mark_recorded(pks: list[Any]) -> None:
    StagedInput.objects.filter(pk__in=pks).update(status=StagedInput.Status.RECORDED)


def _terminal_for_sink(outcome: TurnOutcome, result: CommitResult) -> Terminal:
    """What a sink shows at the end (D4). The answer body goes out only for a committed,
    completed turn; a persistence failure never passes on the text from before it."""
    if result.status == TurnStatus.COMPLETED and isinstance(outcome, Completed):
        answers = [
            m.content for m in outcome.messages if m.role == Role.ASSISTANT and not m.tool_calls
        ]
        text = "\n\n".join(a for a in answers if a)
        if result.notice:
            # E5: a cut or withheld answer says so where it is shown.
            text = f"{text}\n\n[{result.notice['message']}]" if text else result.notice["message"]
        return Terminal(status="completed", text=text)
    error = (result.error or {}).get("message", "")
    persisted = result.error is None or result.error.get("kind") != str(
        FailureKind.TURN_PERSISTENCE
    )
    partial = getattr(outcome, "partial", "") if persisted else ""
    status = "cancelled" if result.status == TurnStatus.CANCELLED else "failed"
    return Terminal(status=status, text=partial, error_message=error)


def _continuable_answer(session_pk: str) -> Message | None:
    """E5: the cut answer a `continue` goes on with: the last turn of the dialog completed
    with a `truncated` answer and nothing was queued after it."""
    last = Turn.objects.filter(session_id=session_pk).order_by("-number").first()
    if last is None or last.status != TurnStatus.COMPLETED or last.reason != Notice.TRUNCATED:
        return None
    return (
        Message.objects.filter(
            session_id=session_pk,
            turn=last,
            role=Role.ASSISTANT,
            status=MessageStatus.TRUNCATED,
        )
        .order_by("-seq")
        .first()
    )


def _continuation(turn: Turn) -> tuple[str | None, list[PendingMessage]]:
    """The cut message a continue turn (or the retry of one) goes on with, and its model-only
    instruction; (None, []) for other turns."""
    continues = turn.source.get("continues") if turn.mode != TurnMode.SEND else None
    if not continues:
        return None, []
    instruction = PendingMessage(role=Role.USER, content=CONTINUE_INSTRUCTION, kind="continue")
    return str(continues), [instruction]


def _lock_live(session_pk: str) -> Session:
    """Lock a live dialog's row for this transaction (queue changes serialise on it)."""
    live = (
        Session.objects.select_for_update().filter(pk=session_pk, deleted_at__isnull=True).first()
    )
    if live is None:
        raise NotFound(_("Dialog not found."))
    return live
