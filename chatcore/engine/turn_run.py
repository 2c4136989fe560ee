"""One claimed turn run to its end (C3-C6, D1, D4, E5, F7, G6): the user message's
`history_delta` published once the model request is on its way, the input taken from the
admission's build or built here (builder), the first request taken from the admission
(`Workers.open_first_request`), the runner under the turn's deadline and its cancel, its
snapshots published meanwhile, and the outcome handed to the dialog's worker (`finish`), which
ends the turn and goes on with the dialog's queue (`worker.Workers`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, MutableMapping
from typing import Any, Protocol

from chatcore.common import publish
from chatcore.common.dbthreads import on_db
from chatcore.common.errors import ShuttingDown
from sessions_app import services
from sessions_app.models import Session, Turn, TurnMode

from . import lease, queue, snapshots, turn_controls
from .delivery import DeliveryCoordinator, sink_for_channel
from .gather import Gathered
from .lease import Lease
from .provider_types import ChatProvider
from .scheduler import Scheduler
from .snapshots import LocalTurn
from .supervisor import TaskSupervisor
from .tools import ToolContext, ToolRegistry
from .turns.builder import RuntimeInfo, TurnInputBuilder
from .turns.committer import take_staged
from .turns.outcome import Cancelled, Failed, FailureKind, TurnOutcome
from .turns.runner import OpenedRequest, TurnRunner, TurnSnapshot

logger = logging.getLogger(__name__)


class TurnFinish(Protocol):
    """What ends a turn run here and goes on with its dialog (`Workers._finish`)."""

    async def __call__(
        self,
        turn: Turn,
        session: Session,
        outcome: TurnOutcome,
        generation: int,
        *,
        local: LocalTurn,
    ) -> None: ...


class TurnRuns:
    """Runs the turns the process's workers claimed, one call of `run` each; `local` holds
    them while they run (the workers' and the engine's view of this process's turns)."""

    def __init__(
        self,
        *,
        cfg: dict[str, Any],
        supervisor: TaskSupervisor,
        builder: TurnInputBuilder,
        provider: ChatProvider,
        tools: ToolRegistry,
        delivery: DeliveryCoordinator,
        scheduler: Scheduler,
        boundaries: Gathered[Lease, bool],
        local: MutableMapping[str, LocalTurn],
        finish: TurnFinish,
    ) -> None:
        self.cfg = cfg
        self.supervisor = supervisor
        self.builder = builder
        self.provider = provider
        self.tools = tools
        self.delivery = delivery
        self.scheduler = scheduler
        self.boundaries = boundaries
        self.local = local
        self.finish = finish

    @property
    def closing(self) -> bool:
        return self.supervisor.closing

    def announce(self, appended: services.Appended, turn: Turn) -> asyncio.Task[None]:
        return self.supervisor.spawn(f"publish:{turn.pk}", _publish_appended(appended, turn))

    def announcer(
        self, started: queue.Started, local: LocalTurn | None = None
    ) -> Callable[[], None]:
        """Publish the `history_delta` of what `started` appended (its user message), once:
        a task of its own (`local.announced`, which the turn's first snapshot waits for), or
        at once when the process is shutting down."""
        pending = [started.appended] if started.appended is not None else []

        def announce() -> None:
            if not pending:
                return
            appended = pending.pop()
            try:
                task = self.announce(appended, started.turn)
            except ShuttingDown:
                services.announce_appended(appended, started.turn)
            else:
                if local is not None:
                    local.announced = task

        return announce

    async def run(self, started: queue.Started) -> None:
        """Run a turn claimed under `started.lease` with its user message recorded in the
        claiming transaction (G6), on the dialog's row as that transaction locked it. That
        message's `history_delta` goes out as the turn starts: when its input was built
        beside the admission, once the model request is on its way (G6: the request first;
        the delta still reaches the clients before any snapshot of the turn, whose publishes
        wait for it, `LocalTurn.announced`), else before the input is built."""
        turn, held = started.turn, started.lease
        session = started.session
        turn_id = str(turn.pk)
        log = {"session_id": session.session_id, "turn_id": turn_id}
        snapshot = TurnSnapshot(turn_id=turn_id)
        local = LocalTurn(turn_id=turn_id, session=session, snapshot=snapshot, lease=held)
        announce = self.announcer(started, local)
        self.local[turn_id] = local
        generation = started.generation
        opened: OpenedRequest | None = None
        try:
            sink = sink_for_channel(session.channel)
            if sink is not None:
                announce()  # the platform's message is made first: the delta does not wait
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
            continues, lead = turn_controls.continuation(turn)
            try:
                # G6: a send's input may be under way since its admission committed, and is
                # often built by now (taken as it is: no hop through the loop for it).
                building = started.prepared
                prepared = building.result() if building is not None and building.done() else None
                if prepared is None:
                    # Still to build, which may take a while in a long dialog: the user's
                    # message enters the clients' history first.
                    announce()
                    if building is not None and not building.done():
                        prepared = await asyncio.wrap_future(building)
                if prepared is None:
                    prepared = await self.builder.prepare(
                        session_pk=session.pk,
                        runtime=runtime,
                        exclude_turn_partials=exclude,
                        pending=lead,
                        session=session,
                        context=started.context,
                    )
            except Exception:
                logger.exception("context preparation failed", extra=log)
                announce()
                failed = Failed(FailureKind.CONTEXT_PREPARATION, "prepare failed")
                await self.finish(turn, session, failed, generation, local=local)
                return
            dropped = prepared.dropped_for_budget

            def after_request() -> None:
                # The model request is on its way: the user message's delta, and (B5) the
                # compaction a long dialog needs, scheduled off the path to the first token
                # (in scaled mode a round trip to Redis on a database thread).
                announce()
                if dropped:
                    self._schedule_compaction(session.pk)

            async def fetch_staged() -> list[Any]:
                # One statement: the lease still ours, and whether anything is staged (with
                # other turns' boundaries, in a burst).
                staged = await self.boundaries(
                    held, functools.partial(on_db(held.confirm), lease.STAGED_INPUTS)
                )
                if not staged:
                    return []
                return await on_db(take_staged)(turn=turn, fence=held, confirmed=True)

            # The first request, if it went out already (`Workers.open_first_request`): the runner
            # takes it, and none is opened from here on.
            started.may_open = False
            opened, started.opened = started.opened, None
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
                opened=opened,
            )
            outcome = await self._run_cancellable(
                local, runner, prepared, after_request=after_request
            )
            if runner.recovered:
                self._schedule_compaction(session.pk)
            await self.finish(turn, session, outcome, generation, local=local)
        finally:
            announce()  # a turn that ended before its request: the message is stored
            self.local.pop(turn_id, None)
            if opened is not None:
                await opened.aclose()  # a runner cancelled before it ran; else nothing
            await close_opened(started)

    def _schedule_compaction(self, session_pk: str) -> None:
        """B5: a compaction for the dialog, scheduled beside the turn, not before its model
        request: a long dialog drops messages for the budget on every turn until its summary
        lands."""
        self.schedule_beside("compact_session", session_pk=session_pk, manual=False)

    def schedule_beside(self, job: str, **kwargs: Any) -> None:
        """Schedule a background job (B4, B5) under the supervisor, off the turn's path and
        the next turn's: in scaled mode scheduling takes a round trip to Redis for the job's
        guard and, when it is due, one to the broker (the first of a process also connects).
        At shutdown it is left to a later turn, which finds it due again."""
        try:
            self.supervisor.spawn(
                f"schedule:{job}:{kwargs.get('session_pk')}",
                on_db(self.scheduler.schedule)(job, **kwargs),
            )
        except ShuttingDown:
            pass

    async def _run_cancellable(
        self,
        local: LocalTurn,
        runner: TurnRunner,
        prepared: Any,
        *,
        after_request: Callable[[], None] | None = None,
    ) -> TurnOutcome:
        loop = asyncio.get_running_loop()
        # Set before the runner runs: its first step may read the first token at once (a
        # request opened at the admission, `OpenedRequest`), and the rest of a burst then
        # waits for the publisher below to take the first frame (D1), whose task has not run
        # yet.
        local.snapshot.first_sent = asyncio.Event()
        run = loop.create_task(runner.run(prepared), name=f"run:{local.turn_id}")
        if after_request is not None:
            # After the runner's first step, which sends the model request and waits for its
            # answer: what runs there (the user message's delta) runs while the model works,
            # before its first token can be read.
            loop.call_soon(after_request)
        cancel_wait = loop.create_task(local.cancel.wait())
        publisher = loop.create_task(
            snapshots.publish_snapshots(
                local, fps=self.cfg["SNAPSHOT_FPS"], spawn=self.supervisor.spawn
            )
        )
        try:
            # F7: a turn has an overall deadline; a model that trickles cannot hold the
            # dialog's lease and a model slot forever.
            deadline = float(self.cfg["TURN_DEADLINE_SECONDS"])
            await asyncio.wait(
                {run, cancel_wait}, timeout=deadline, return_when=asyncio.FIRST_COMPLETED
            )
            if not run.done() and not cancel_wait.done():
                await _cancel(run)
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
                await _cancel(run)
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
            helpers = (cancel_wait, publisher)
            for task in helpers:
                # A snapshot publish under way is let land (the publisher returns after it):
                # cancelled after the layer took the frame, it would count as unsent and the
                # flush would send its tail twice (D1).
                if task is not publisher or not local.publishing:
                    task.cancel()
            # The publish under way lands and the last tail goes out while the outcome is
            # committed; the terminal waits for both (`TurnEnds.announce`).
            try:
                local.drained = self.supervisor.spawn(
                    f"drain:{local.turn_id}", _drain_snapshots(local, helpers)
                )
            except ShuttingDown:
                # Shutdown began: the turn's last tail still goes out, here.
                await _drain_snapshots(local, helpers)


async def close_opened(started: queue.Started) -> None:
    """Close the first request opened for a turn that is not run here (`Started.opened`),
    and open none for it from now on."""
    started.may_open = False
    opened, started.opened = started.opened, None
    if opened is not None:
        await opened.aclose()


async def _drain_snapshots(local: LocalTurn, helpers: tuple[asyncio.Task[Any], ...]) -> None:
    _done, stuck = await asyncio.wait(helpers, timeout=5)
    if stuck:
        logger.error("turn helpers did not stop in time", extra={"turn_id": local.turn_id})
        for late in stuck:
            late.cancel()
    await snapshots.flush_snapshot(local)


async def _publish_appended(appended: services.Appended, turn: Turn) -> None:
    session = appended.session
    await publish.apublish(
        publish.chat_group(session.channel, session.chat_id),
        services.appended_frame(appended, turn),
    )


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
