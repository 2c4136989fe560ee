"""The per-dialog workers of one process (C1, C3, C11): take the dialog's lease, claim its
queued turns one at a time, run each (`turn_run`: builder -> runner) and end it (`turn_end`:
its commit and what goes out then), then read what is left and claim the next or linger.

Turns of one dialog never overlap, across processes too: a worker runs only while it holds
the dialog's lease (`lease.Lease`), renewed every third of its period (one statement for all
the dialogs of the process, `_renew_loop`). Every write of a turn checks the lease's epoch in
its own transaction, and a lost renewal cancels the turn at once (G2).
Delivery to an external sink is handed to the sink relay and never awaited here (D4): a
slow or broken sink does not hold up the dialog's queue.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from chatcore.common import dbthreads
from chatcore.common.dbthreads import Lane, on_db
from chatcore.common.errors import ShuttingDown
from sessions_app import storage
from sessions_app.models import Session, Turn, TurnMode

from . import after_turn, lease, queue, recovery, snapshots
from .delivery import DeliveryCoordinator
from .gather import Gathered
from .lease import Lease, LeaseLost
from .provider_types import ChatProvider
from .scheduler import Scheduler
from .sessions import SessionStates
from .snapshots import LocalTurn
from .supervisor import TaskSupervisor
from .tools import ToolRegistry
from .turn_end import TurnEnds
from .turn_run import TurnRuns, close_opened
from .turns.builder import TurnInputBuilder
from .turns.outcome import TurnOutcome
from .turns.runner import FirstRequest, OpenedRequest

logger = logging.getLogger(__name__)

# How long a worker whose dialog's queue emptied keeps the lease for a follow-up send.
LINGER_SECONDS = 0.1


class Workers:
    """One worker task per dialog with work in this process; `local` holds the turns they run."""

    def __init__(
        self,
        *,
        process_id: str,
        cfg: dict[str, Any],
        supervisor: TaskSupervisor,
        states: SessionStates,
        builder: TurnInputBuilder,
        provider: ChatProvider,
        tools: ToolRegistry,
        delivery: DeliveryCoordinator,
        scheduler: Scheduler,
        scope: Callable[[Any], Any] | None,
        writes: Lane | None = None,
    ) -> None:
        self.process_id = process_id
        self.cfg = cfg
        self.supervisor = supervisor
        self.states = states
        self.builder = builder
        self.provider = provider
        self.tools = tools
        self.scope = scope
        # The write lane the final commits share with the admissions (SQLite), or None.
        self.writes = writes
        self.local: dict[str, LocalTurn] = {}
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self._wakeups: dict[str, asyncio.Event] = {}
        self._leases: dict[str, Lease] = {}
        # Turns started at admission under the lease of the dialog's lingering worker, for
        # that worker to run next (`hand_off`).
        self._handed: dict[str, queue.Started] = {}
        # Dialogs whose worker is between turns (claiming, lingering, releasing): a turn may
        # be started under its lease and handed to it.
        self._between: set[str] = set()
        # Workers whose queue is empty, keeping the lease for a follow-up (`_linger`).
        self.lingering: set[str] = set()
        # Dialogs whose last turn's after-turn read found nothing queued or staged
        # (`after_turn.after_turn_read`): unless a kick came since, their worker claims nothing.
        self._found_empty: set[str] = set()
        # Dialogs whose last turn ended with no other dialog of its party waiting for a
        # slot (the same read): `_wake_waiting` has none to look for.
        self._party_idle: set[str] = set()
        # G6: the answers of a burst end together; their last step boundaries' reads, and
        # on PostgreSQL their commits, go together while others are under way (`gather`).
        alone_limit = max(1, dbthreads.thread_count() // 3)
        self.boundaries: Gathered[Lease, bool] = Gathered(
            "step boundaries",
            functools.partial(lease.confirm_all, waiting=lease.STAGED_INPUTS),
            spawn=supervisor.spawn,
            alone_limit=alone_limit,
        )
        self.runs = TurnRuns(
            cfg=cfg,
            supervisor=supervisor,
            builder=builder,
            provider=provider,
            tools=tools,
            delivery=delivery,
            scheduler=scheduler,
            boundaries=self.boundaries,
            local=self.local,
            finish=self._finish,
        )
        self.ends = TurnEnds(
            states=states,
            supervisor=supervisor,
            delivery=delivery,
            schedule_beside=self.runs.schedule_beside,
            alone_limit=alone_limit,
            writes=writes,
        )

    @property
    def closing(self) -> bool:
        return self.supervisor.closing

    def start(self) -> None:
        """The process's housekeeping, one task each for all its dialogs and turns: lease
        renewal and checkpoints (daemons: they stop with the engine)."""
        self.supervisor.spawn("leases", self._renew_loop(), daemon=True)
        self.supervisor.spawn(
            "checkpoints",
            snapshots.checkpoint_loop(
                self.local,
                interval=self.cfg["CHECKPOINT_SECONDS"],
                reset_db=storage.areset_broken_connection,
            ),
            daemon=True,
        )

    def _acquire(self, session_pk: str) -> Lease | None:
        return queue.acquire_lease(session_pk, owner=self.process_id, cfg=self.cfg)

    async def kick(self, session_pk: str) -> None:
        """Make sure someone runs this dialog's queue: this process if it can take the lease;
        otherwise the lease holder, which re-reads the queue after every turn."""
        if self.closing:
            return
        worker = self.tasks.get(session_pk)
        if worker is not None and not worker.done():
            self._wakeups[session_pk].set()
            return
        held = await on_db(self._acquire)(session_pk)
        if held is None:
            return
        worker = self.tasks.get(session_pk)
        if worker is not None and not worker.done():
            # Another kick of this process won meanwhile; it cannot hold our lease, but be safe.
            self._wakeups[session_pk].set()
            return
        self._wakeups[session_pk] = asyncio.Event()
        self._leases[session_pk] = held
        try:
            self.tasks[session_pk] = self.supervisor.spawn(
                f"worker:{session_pk}", self._worker(session_pk)
            )
        except ShuttingDown:
            self._leases.pop(session_pk, None)
            await on_db(queue.release_lease)(held)

    def running(self, session_pk: str) -> bool:
        """Whether this process has a worker for the dialog now."""
        worker = self.tasks.get(session_pk)
        return worker is not None and not worker.done()

    async def start_claimed(self, started: queue.Started) -> None:
        """Run a turn `admission.admit_and_start` claimed under a lease it took (G6): the model
        request goes out next; the user message's `history_delta` is published by a task of
        its own once that request is on its way (`TurnRuns.run`), never awaited here."""
        session_pk = started.session.pk
        self._wakeups[session_pk] = asyncio.Event()
        self._leases[session_pk] = started.lease
        try:
            self.tasks[session_pk] = self.supervisor.spawn(
                f"worker:{session_pk}", self._worker(session_pk, first=started)
            )
        except ShuttingDown:
            # The turn stays marked running; the next holder of the lease closes it (C11).
            self._leases.pop(session_pk, None)
            self._wakeups.pop(session_pk, None)
            await close_opened(started)
            await on_db(queue.release_lease)(started.lease)

    def lingering_lease(self, session_pk: str) -> Lease | None:
        """The lease of this process's worker of the dialog while it is between turns (from
        the commit of its last turn: its after-turn steps, claiming the next, lingering,
        releasing), for a send to start its turn under (`admission.admit_and_start`). The
        admitting transaction checks that the row still shows it (and that nothing is
        staged), and a release never frees it under such a turn (`lease.release_if_idle`)."""
        if session_pk in self._between and self.running(session_pk):
            return self._leases.get(session_pk)
        return None

    async def hand_off(self, started: queue.Started) -> None:
        """Give a turn started under a lingering worker's lease to that worker, which runs it
        next (G6: no claim of its own); the user message's delta goes out as in
        `start_claimed`, from the worker. Should the worker have ended meanwhile (its lease
        lost, shutdown), the turn is left to the next holder of the lease, which closes it
        (C11), and the delta goes out from here."""
        session_pk = started.session.pk
        if not self.running(session_pk):
            await close_opened(started)
            if started.appended is not None:
                self.runs.announce(started.appended, started.turn)
            logger.warning(
                "the worker a started turn was handed to has ended",
                extra={"session_id": started.session.session_id, "turn_id": str(started.turn.pk)},
            )
            await self.kick(session_pk)
            return
        self._handed[session_pk] = started
        self._wakeups[session_pk].set()

    def open_first_request(self, started: queue.Started) -> None:
        """G6: send a started turn's first model request now, before its worker runs it: on
        the loop, as soon as its admission committed and its input was built (`Engine.submit`
        schedules it from the database thread that finished last). The model works while the
        turn goes back to the loop and on to its worker, which takes the request as its first
        step's (`TurnRunner.opened`). Nothing when the worker is past that point already, the
        input was not built, the process is closing, or the turn is not a plain send."""
        building = started.prepared
        if (
            not started.may_open
            or started.opened is not None
            or self.closing
            or started.turn.mode != TurnMode.SEND
            or building is None
            or not building.done()
            or building.exception() is not None
        ):
            return
        prepared = building.result()
        if prepared is None:
            return
        if started.first_request is not None:
            request, ahead = started.first_request  # made with the input
        else:
            request = FirstRequest.of(
                prepared, builder=self.builder, tools=self.tools, max_steps=self.cfg["MAX_STEPS"]
            )
            ahead = None
        started.opened = OpenedRequest(self.provider, prepared, request, ahead=ahead)

    async def _worker(self, session_pk: str, first: queue.Started | None = None) -> None:
        wake = self._wakeups[session_pk]
        held = self._leases[session_pk]
        try:
            if first is None:
                await on_db(recovery.recover_interrupted)(
                    session_pk, held, states=self.states, running_here=set(self.local)
                )
            else:
                # Claimed in the admitting transaction, which saw no running turn (C11).
                await self.runs.run(first)
                self._wake_waiting(first.turn)
            while not self.closing:
                # Nothing was queued at the last turn's end and no kick came since: no read
                # to claim nothing. (A turn another process queued meanwhile, which could not
                # wake us, is found by the release's check after the linger, as before.)
                empty = session_pk in self._found_empty and not wake.is_set()
                self._found_empty.discard(session_pk)
                wake.clear()
                handed = self._handed.pop(session_pk, None)
                if handed is not None:
                    self._between.discard(session_pk)
                    await self.runs.run(handed)
                    self._wake_waiting(handed.turn)
                    continue
                self._between.add(session_pk)
                turn = (
                    None
                    if empty
                    else await storage.astorage_retry(
                        functools.partial(
                            queue.claim_next, session_pk, held, cfg=self.cfg, states=self.states
                        ),
                        what="claim",
                    )
                )
                if isinstance(turn, queue.Started):
                    self._between.discard(session_pk)
                    await self.runs.run(turn)
                    self._wake_waiting(turn.turn)
                    continue
                if turn is None:
                    if await self._linger(session_pk, wake):
                        continue
                    # Release unless a turn was queued meanwhile (then claim it): one
                    # statement, so a turn queued after it finds the lease free and its
                    # enqueuer's kick takes it (that kick came here if it found us: `wake`).
                    if not await on_db(queue.release_if_idle)(held):
                        continue
                    if wake.is_set():
                        again = await on_db(self._acquire)(session_pk)
                        if again is not None:
                            held = self._leases[session_pk] = again
                            continue
                    # No await from the last check to the pop below (kicks run at awaits).
                    break
                # HELD_BACK (F7): the owner runs the most turns allowed. The queue waits,
                # leaseless, until one of the owner's turns ends (`_start_waiting`, any
                # process) or the sweep; a kick that came meanwhile means a slot may be free.
                self._between.discard(session_pk)
                await on_db(queue.release_lease)(held)
                if wake.is_set():
                    again = await on_db(self._acquire)(session_pk)
                    if again is not None:
                        held = self._leases[session_pk] = again
                        continue
                # No await from the last check to the pop below (kicks run at awaits).
                break
        except LeaseLost:
            # G2: another process took the dialog over; it runs the queue from here on.
            logger.error("lost the lease of a dialog", extra={"session_id": session_pk})
        finally:
            self.tasks.pop(session_pk, None)
            self._between.discard(session_pk)
            unrun = self._handed.pop(session_pk, None)
            if unrun is not None:
                # Left to the next holder of the lease (C11); its message is stored.
                self.runs.announcer(unrun)()
                await close_opened(unrun)
            self._found_empty.discard(session_pk)
            self._party_idle.discard(session_pk)
            self._wakeups.pop(session_pk, None)
            self._leases.pop(session_pk, None)
            if not held.released and not held.lost:
                try:
                    await asyncio.shield(on_db(queue.release_lease)(held))
                except Exception:
                    logger.warning("lease release failed", extra={"session_id": session_pk})

    async def _linger(self, session_pk: str, wake: asyncio.Event) -> bool:
        """The queue is empty: keep the lease a moment (`LINGER_SECONDS`) for a send of this
        process that follows the answer at once (a script, a chat app's burst, the next line
        of a paste). Its kick wakes us and its turn is claimed with one round trip, instead
        of waiting for this lease's release and a new acquisition. False when none came.
        Meanwhile the dialog counts as idle (`busy`)."""
        if self.closing or LINGER_SECONDS <= 0:
            return False
        self.lingering.add(session_pk)
        try:
            # A deadline on this task itself (no task of its own for the wait, as `wait_for`
            # makes): a kick resumes the worker on the loop's next turn.
            async with asyncio.timeout(LINGER_SECONDS):
                await wake.wait()
        except TimeoutError:
            return False
        finally:
            self.lingering.discard(session_pk)
        return not self.closing

    def busy(self) -> set[str]:
        """Dialogs with a turn running or about to run here (A6: their state stays)."""
        return {local.session.pk for local in self.local.values()} | (
            set(self.tasks) - self.lingering
        )

    async def _renew_loop(self) -> None:
        """Every third of the lease period, renew all the leases this process holds in one
        statement (`queue.renew_leases`). A lease found taken over cancels its dialog's local
        turn at once (its upstream stream closes) and its writes fail their fencing check
        (G2). A renewal that fails on the database is tried again at the next beat; a lease is
        lost only when the database says so."""
        interval = self.cfg["LEASE_SECONDS"] / 3
        while True:
            await asyncio.sleep(interval)
            held = [h for h in self._leases.values() if not h.released and not h.lost]
            if not held:
                continue
            try:
                lost = await on_db(queue.renew_leases)(held)
            except Exception:
                logger.exception("lease renewal failed", extra={"leases": len(held)})
                await storage.areset_broken_connection()
                continue
            for gone in lost:
                logger.error("lost the lease of a dialog", extra={"session_id": gone.session_pk})
                if self._leases.get(gone.session_pk) is gone:
                    self._lease_lost(gone.session_pk)

    def _lease_lost(self, session_pk: str) -> None:
        for local in self.local.values():
            if local.session.pk == session_pk:
                local.cancel.set()
        wake = self._wakeups.get(session_pk)
        if wake is not None:
            wake.set()

    def _wake_waiting(self, turn: Turn) -> None:
        """`_start_waiting` as a task of its own: the dialog's next turn is claimed at once,
        not after that query (its place among the party's waiting dialogs is the claim's
        check, `limits.turn_may_start`)."""
        if turn.session_id in self._party_idle:
            self._party_idle.discard(turn.session_id)
            return
        if self.closing:
            return
        try:
            self.supervisor.spawn(f"waiting:{turn.pk}", self._start_waiting(turn))
        except ShuttingDown:
            pass

    async def _start_waiting(self, turn: Turn) -> None:
        """F7: a turn ended; start the dialogs of its party (`limits.party`) held back by the
        cap, oldest first (whichever process takes a dialog's lease runs it)."""
        if self.closing:
            return
        try:
            waiting = await on_db(after_turn.waiting_dialogs)(turn, scope=self.scope, cfg=self.cfg)
        except Exception:
            logger.exception("could not list dialogs waiting for a slot")
            return
        for pk in waiting:
            await self.kick(pk)

    async def _finish(
        self,
        turn: Turn,
        session: Session,
        outcome: TurnOutcome,
        generation: int,
        *,
        local: LocalTurn,
    ) -> None:
        """The turn's end (`turn_end.TurnEnds`: its commit, then what goes out), and what this
        worker does next: what is left after the turn, read in the commit's transaction."""
        fence = local.lease
        assert fence is not None
        # What is left after the turn (staged inputs, queued turns, the party's waiting
        # dialogs) is read in the commit's transaction, on the row it locked (G6: no trip of
        # its own): a client that sends as soon as it sees `turn_updated` finds that read
        # done. A kick from here on (a send queued behind this turn, whose admission waits
        # for the commit's lock) is the worker's to see; one before was for a turn the read
        # finds.
        wake = self._wakeups.get(session.pk)
        if wake is not None:
            wake.clear()
        result = await self.ends.commit(turn, session, outcome, generation, fence)
        if result is None:
            return  # G2: the lease was lost; the dialog's new holder ends the turn
        # The turn has ended in the database: from here a send to the dialog starts its turn
        # under this worker's lease in its admitting transaction and is handed to this worker
        # (`lingering_lease`), which runs it when this one's after-turn steps are done; a
        # client that sends as soon as it sees `turn_updated` never waits for a claim of its
        # own (G6).
        self._between.add(session.pk)
        # A turn that ended without messages to commit (or whose commit failed) reads what is
        # left on its own, while its end goes out.
        found_in_commit = result.after
        left = (
            None
            if isinstance(found_in_commit, after_turn.AfterTurn)
            else asyncio.ensure_future(
                storage.astorage_retry(
                    lambda: after_turn.after_turn_read(turn, fence), what="after_turn"
                )
            )
        )
        await self.ends.announce(turn, session, outcome, result, local)
        try:
            found = await left if left is not None else found_in_commit
            assert isinstance(found, after_turn.AfterTurn)
            if not found.queued:
                self._found_empty.add(session.pk)
            if not found.party_waiting:
                self._party_idle.add(session.pk)
            if found.staged:
                await storage.astorage_retry(
                    lambda: after_turn.after_turn_staged(
                        turn, result, fence, states=self.states, cfg=self.cfg
                    ),
                    what="after_turn",
                )
        except LeaseLost:
            logger.error("lost the lease after a turn", extra={"turn_id": str(turn.pk)})
