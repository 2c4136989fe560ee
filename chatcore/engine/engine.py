"""The engine of one process, a facade over the data flow (STYLE "The shape"):

    ingress (admission checks, `Inbound`) -> admission (stored before the ack; a send to an
    idle dialog started in the same transaction) -> queue (durable per-dialog FIFO, lease
    writes) -> worker (claim, run builder -> runner -> committer, finish) -> publish

with snapshots and checkpoints (`snapshots`), the control channel and sweeps (`control`),
background jobs through the scheduler it is built with (`scheduler`), external delivery off
the turn's path (`delivery`). Every task it starts belongs to its supervisor (F1).

Turns of one dialog never overlap, across processes too (C3, `worker`); queue items are
`Turn` rows, stored before they are acknowledged (C2). Stop reaches the running turn at once
in this process, through the channel layer's control group in another, and through the turn
row's `cancel_requested` flag as a fallback (C6).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from channels.layers import get_channel_layer
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection, transaction

from chatcore.common import dbthreads, events, publish
from chatcore.common.dbthreads import Lane, start_on_db
from sessions_app import storage
from sessions_app.models import Session, TurnMode, TurnStatus

from . import (
    admission,
    admission_batch,
    control,
    limits,
    queue,
    rates,
    snapshots,
    turn_controls,
)
from .delivery import DeliveryCoordinator
from .gather import Gathered
from .ingress import Ack, Inbound, StopResult, check_inbound, check_model_work
from .layerwatch import LayerWatch
from .model_catalog import ModelCatalog
from .opening import Openings
from .provider import provider_from_settings
from .provider_types import ChatProvider
from .scheduler import CeleryScheduler, InProcessScheduler, Scheduler
from .sessions import SessionStates
from .snapshots import LocalTurn
from .supervisor import TaskSupervisor
from .tools import ToolRegistry, registry_from_settings
from .turns.builder import WINDOW_CHARS_PER_TOKEN, PreparedInput, TurnInputBuilder
from .turns.runner import FirstRequest
from .worker import Workers

__all__ = ["Ack", "Engine", "Inbound", "LocalTurn", "StopResult"]

logger = logging.getLogger(__name__)


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
        self.cfg = settings.CHAT
        # F7: at most CHAT["MODEL_CALLS_MAX"] model calls of this process at once.
        self.provider = limits.bounded(provider or provider_from_settings(), settings.CHAT)
        self.tools = tools or registry_from_settings()
        # H4: the models this process's model server offers (cached, refreshed every 5 min).
        self.models = ModelCatalog.for_provider(self.provider)
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
        # G5: connections of this process register to be closed when the layer lost frames.
        self.layer_watch = LayerWatch()
        self._control_channel: str | None = None
        self._started = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.delivery = DeliveryCoordinator(
            retries=self.cfg["SINK_RETRIES"],
            backoff=self.cfg["SINK_BACKOFF_SECONDS"],
            timeout=self.cfg["SINK_TIMEOUT_SECONDS"],
        )
        # G6: on SQLite, whose writes take turns anyway, the admissions and the final commits
        # of many turns go to the database threads a batch per trip (`dbthreads.Lane`); on
        # PostgreSQL each has its own trip, and those of different dialogs run side by side.
        self.writes = Lane("writes") if connection.vendor == "sqlite" else None
        # G6: there, sends that come faster than their admissions finish are admitted
        # together, a transaction per batch (`admission_batch.admit_and_start_many`): in a
        # burst of a hundred sends, the CPU of a transaction each (statements, hops, a COMMIT,
        # under the one interpreter lock) is what the last first token waits for, and together
        # it is less than half (`bench/admission_bench.py`). A dialog's sends are admitted in
        # the order they came (C1), and a batch starts at most one send of each sender (its
        # F7 counts are read once per batch); at shutdown a waiting send is refused.
        self.admissions: (
            Gathered[admission_batch.Admission, tuple[Ack, queue.Started | None]] | None
        ) = (
            Gathered(
                "admissions",
                functools.partial(
                    admission_batch.admit_and_start_many, cfg=self.cfg, states=self.states
                ),
                spawn=self.supervisor.spawn,
                alone_limit=max(1, dbthreads.thread_count() // 3),
                key=lambda send: str(send.session.pk),
                distinct=lambda send: send.inbound.owner.pk,
                refuse_at_shutdown=True,
            )
            if self.writes is None
            else None
        )
        self.workers = Workers(
            process_id=self.process_id,
            cfg=self.cfg,
            supervisor=self.supervisor,
            states=self.states,
            builder=self.builder,
            provider=self.provider,
            tools=self.tools,
            delivery=self.delivery,
            scheduler=self.scheduler,
            scope=scope,
            writes=self.writes,
        )
        # The turns this process runs now, by turn id.
        self.local: dict[str, LocalTurn] = self.workers.local
        # What sockets open with: the users' lists, the dialogs' pages (issue 57).
        self.openings = Openings(
            cfg=self.cfg, states=self.states, local_turns=self.local, spawn=self.supervisor.spawn
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
            self.openings.attach(layer)
            self.layer_watch.register(self.openings.layer_lost)
            self._control_channel = await layer.new_channel("engine.")
            await layer.group_add(publish.engine_control_group(), self._control_channel)
            self.supervisor.spawn(
                "control", control.control_loop(layer, self._control_channel, self), daemon=True
            )
            if settings.SCALED:
                self.supervisor.spawn("layer-watch", self.layer_watch.run(layer), daemon=True)
        self.supervisor.spawn("sweep", control.sweep_loop(self), daemon=True)
        self.workers.start()
        # Load the tokenizer's tables now, off the loop, not in the first turn's build; and
        # ready the scheduler (scaled mode: the broker), not in the first job's scheduling.
        await asyncio.gather(
            asyncio.to_thread(lambda: self.builder.counter),
            asyncio.to_thread(self.scheduler.warm),
        )

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

    async def submit(self, inbound: Inbound, session: Session) -> Ack:
        """Admit one send/steer/inject for a dialog. Refusals raise and change nothing."""
        await check_inbound(inbound, session, cfg=self.cfg, closing=self.closing)
        # F7: the send rate, charged before the admission's transaction begins: it never
        # waits on Redis while it holds the dialog's row or SQLite's write lock (I3).
        await rates.acharge(inbound.owner.pk, rates.SEND, self.cfg)
        # G6: a send to a dialog this process does not run now may start its turn in the
        # admitting transaction (`admission.admit_and_start`), and so may one to a dialog whose
        # worker here lingers after its last turn (under that worker's lease, handed to it);
        # otherwise the usual kick.
        start_as = None if self.workers.running(session.pk) else self.process_id
        held = self.workers.lingering_lease(session.pk)
        # G6: a send that may start its turn has its context read by its admission, in the
        # round trip of its lock, where the admission is round trips to a database server
        # (PostgreSQL); the started turn's input is built from it while the admission commits.
        context_chars = (
            self.builder.window_of(session) * WINDOW_CHARS_PER_TOKEN
            if self.writes is None
            and inbound.mode in ("send", "steer")
            and (start_as is not None or held is not None)
            else None
        )

        loop = asyncio.get_running_loop()

        def open_when_built(started: queue.Started) -> None:
            # G6: once the admission has committed and the input is built (whichever ends
            # last, on its database thread), the model request goes out from the loop at
            # once, ahead of the trip back to this coroutine and on to the worker
            # (`Workers.open_first_request`). Never for an attempt that rolled back.
            def ready(_built: object) -> None:
                if started.appended is not None:
                    # A4: its user message joins the history held here, once committed and
                    # once the build is done. The admission records it as it commits too,
                    # but a build that began later (its thread busy with others, a burst)
                    # held nothing then, and left the history without it: the turn's answer
                    # did not follow on, and the dialog's next build read it all again.
                    self.states.apply_appended(started.appended)
                with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to send
                    loop.call_soon_threadsafe(self.workers.open_first_request, started)

            if started.prepared is not None:
                started.prepared.add_done_callback(ready)

        def build_beside(started: queue.Started) -> None:
            # G6: the turn's input is built from that context, on another database thread,
            # while the admission finishes and commits, and its model request goes out as
            # soon as both are done.
            if started.context is None:
                return
            started.prepared = start_on_db(
                functools.partial(self._prepare_early, started, committed=False)
            )
            transaction.on_commit(functools.partial(open_when_built, started), robust=True)

        def build_once_committed(started: queue.Started) -> None:
            # G6, SQLite: the same build, handed to another database thread the moment the
            # admission commits (its context read there, not inside the write transaction,
            # which would hold the write lock longer): the worker's first step is the model
            # request, with no trip back to the loop and out again before it.
            # Its model request waits for the worker: sent from the build's end instead, a
            # burst of a hundred sends reached its last first token later (p99 372 against
            # 319 ms), the requests' loop work ahead of the admissions still to come.
            def start() -> None:
                started.prepared = start_on_db(
                    functools.partial(self._prepare_early, started, committed=True)
                )

            transaction.on_commit(start, robust=True)

        on_started = None
        if context_chars is not None:
            on_started = build_beside
        elif self.writes is not None and inbound.mode in ("send", "steer"):
            on_started = build_once_committed

        def admit() -> tuple[Ack, queue.Started | None]:
            return admission.admit_and_start(
                inbound,
                session,
                cfg=self.cfg,
                states=self.states,
                start_as=start_as,
                held=held,
                on_started=on_started,
                context_chars=context_chars,
            )

        async def alone() -> tuple[Ack, queue.Started | None]:
            # A4: retries of the write wait on the loop, not on the database thread.
            return await storage.astorage_retry(
                admit, what="admit", session=session, lane=self.writes
            )

        if (
            self.admissions is not None
            and start_as is not None
            and held is None
            and inbound.accept is None
            and inbound.mode in ("send", "steer")
        ):
            send = admission_batch.Admission(
                inbound,
                session,
                start_as,
                on_started=on_started,
                context_chars=context_chars,
            )
            ack, started = await self.admissions(send, alone)
        else:
            ack, started = await alone()
        if started is not None and started.lease is held:
            await self.workers.hand_off(started)
        elif started is not None:
            await self.workers.start_claimed(started)
        elif ack.turn_id is not None:
            await self.kick(session.pk)
        return ack

    def _prepare_early(self, started: queue.Started, *, committed: bool) -> PreparedInput | None:
        """On a database thread, a started turn's input: while its admission commits, from the
        context it read (`prepare_beside`), or once it has committed (SQLite,
        `prepare_committed`). None for the worker to build (`prepare`)."""
        try:
            if committed:
                return self.builder.prepare_committed(started.session, started.appended)
            prepared = self.builder.prepare_beside(
                started.session, started.context, started.appended
            )
            if prepared is not None and started.turn.mode == TurnMode.SEND:
                started.first_request = self._first_request(prepared)
            return prepared
        except Exception:
            logger.warning(
                "could not build a turn's input beside its admission",
                exc_info=True,
                extra={"turn_id": str(started.turn.pk)},
            )
            return None

    def _first_request(self, prepared: PreparedInput) -> tuple[FirstRequest, Any] | None:
        """A started turn's first model request, made on its build's database thread for the
        loop to send as it is (`Workers.open_first_request`): its body holds the window's
        messages, and encoding it and making the HTTP request cost the loop, which every
        socket shares, about 0.2 ms per send (F7). None: the provider makes none ahead."""
        make = getattr(self.provider, "prepare_request", None)
        if make is None:
            return None
        request = FirstRequest.of(
            prepared, builder=self.builder, tools=self.tools, max_steps=self.cfg["MAX_STEPS"]
        )
        ahead = make(
            messages=request.messages,
            tools=request.tools,
            max_tokens=request.max_tokens,
            model=request.model,
        )
        return request, ahead

    # --- stop / retry / continue (C6, E5) ------------------------------------------------

    async def stop(self, session: Session) -> StopResult:
        """Abort the running turn at once, drop unstarted sends and staged steers."""
        running, dropped = await storage.astorage_retry(
            lambda: turn_controls.stop(session), what="stop", session=session
        )
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
        """C6: re-run the last failed or cancelled turn as a new turn
        (`turn_controls.enqueue_retry`). A retry starts model work, so it is charged to the send
        rate (F7)."""
        await check_model_work(owner, cfg=self.cfg, closing=self.closing)
        ack = await storage.astorage_retry(
            lambda: turn_controls.enqueue_retry(
                session, owner_id=owner.pk, client_msg_id=client_msg_id, cfg=self.cfg
            ),
            what="retry",
            session=session,
        )
        await self.kick(session.pk)
        return ack

    async def continue_answer(
        self, session: Session, *, owner: User, client_msg_id: str = ""
    ) -> Ack:
        """E5: go on with the last answer when the model cut it at its length limit, as a new
        turn (mode `continue`) whose text is stored as a message linked to the cut one
        (`source.continues`); stored messages are never rewritten (B5), the builder and the
        clients join them. Charged to the send rate like a send."""
        await check_model_work(owner, cfg=self.cfg, closing=self.closing)
        ack = await storage.astorage_retry(
            lambda: turn_controls.enqueue_continue(
                session, owner_id=owner.pk, client_msg_id=client_msg_id, cfg=self.cfg
            ),
            what="continue",
            session=session,
        )
        await self.kick(session.pk)
        return ack

    # --- the queue's workers (C1, C3, C11) -------------------------------------------------

    async def kick(self, session_pk: str) -> None:
        """Make sure someone runs this dialog's queue (`worker.Workers.kick`)."""
        await self.workers.kick(session_pk)

    # --- what the control channel and the sweep call (`control`) ---------------------------

    def cancel_local(self, turn_id: str) -> None:
        local = self.local.get(turn_id)
        if local is not None:
            local.cancel.set()

    def evict_idle(self) -> int:
        return self.states.evict_expired(busy=self.workers.busy())

    def refresh_sockets(self) -> None:
        self.sockets.refresh()

    # --- reading state for clients ---------------------------------------------------------

    def snapshot_frame(self, local: LocalTurn, *, full: bool) -> dict[str, Any]:
        return snapshots.snapshot_frame(local, full=full)

    def active_snapshot(self, turn_id: str) -> dict[str, Any] | None:
        local = self.local.get(turn_id)
        if local is None or not local.may_speak:
            return None
        return snapshots.snapshot_frame(local, full=True)

    async def wait_idle(self, session_pk: str | None = None, timeout: float = 30.0) -> None:
        """Wait until this engine has no worker (for one dialog, or at all) and no terminal
        on its way to a sink (D4)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            workers = [
                w for pk, w in self.workers.tasks.items() if session_pk is None or pk == session_pk
            ]
            workers += self.delivery.pending()
            if not workers:
                return
            await asyncio.wait(workers, timeout=max(0.0, deadline - time.monotonic()))
        raise TimeoutError("engine did not become idle")
