"""Sends that come faster than their admissions finish, admitted together (G6, PostgreSQL).

A send to an idle dialog is admitted and its turn started in one transaction of its own
(`queue.admit_and_start`): a few statements, two round trips and a COMMIT, and the thread
hop there, mostly the process's CPU under its one interpreter lock. In a burst of a hundred
sends that CPU is what the last first token waits for, and together it is less than half
(`bench/admission_bench.py`). So while `alone_limit` admissions are under way,
the sends that arrive wait and then go together, as many as have gathered (at most
`max_batch`, one per sender and dialog), in one transaction (`queue.admit_and_start_many`):
one round trip for the locks and counts of all of them, their writes sent with the one
COMMIT. One send at a time never waits: it goes alone at once, as before.

A dialog's sends are admitted in the order they reached this process (C1): while one of its
sends is being admitted (alone, in a batch, or alone after a batch that did not start it),
the next waits for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from chatcore.common.dbthreads import on_db

from . import queue
from .ingress import Ack
from .sessions import SessionStates

logger = logging.getLogger(__name__)

Admitted = tuple[Ack, queue.Started | None]
_Waiting = tuple[queue.Admission, asyncio.Future[queue.AdmissionOutcome]]


class AdmissionBatches:
    """The admissions of one process's sends that may start their turn (`Engine.submit`).
    `states`: the process's dialog histories, which a started turn's user message joins;
    `spawn`: how a batch's task is started (the engine's supervisor, F1)."""

    def __init__(
        self,
        cfg: dict[str, Any],
        *,
        states: SessionStates,
        alone_limit: int,
        spawn: Callable[[str, Coroutine[Any, Any, None]], object],
        max_batch: int = 32,
    ) -> None:
        self.cfg = cfg
        self.states = states
        self.alone_limit = max(1, alone_limit)
        self.max_batch = max_batch
        self._spawn = spawn
        self._under_way = 0  # admissions alone and batches, on the database threads now
        self._waiting: list[_Waiting] = []
        # Dialogs with a send being admitted now, and how many.
        self._admitting: Counter[str] = Counter()

    async def admit(
        self, admission: queue.Admission, alone: Callable[[], Awaitable[Admitted]]
    ) -> Admitted:
        """`admission`'s outcome: alone (`alone()`, the usual admission with its retries)
        when fewer than `alone_limit` admissions are under way and none waits; otherwise in
        the next batch, or alone after it (a send the batch did not start)."""
        dialog = str(admission.session.pk)
        if (
            self._under_way < self.alone_limit
            and not self._waiting
            and dialog not in self._admitting
        ):
            self._under_way += 1
            self._admitting[dialog] += 1
            try:
                return await alone()
            finally:
                self._under_way -= 1
                self._done(dialog)
        future: asyncio.Future[queue.AdmissionOutcome] = asyncio.get_running_loop().create_future()
        self._waiting.append((admission, future))
        self._next()
        try:
            outcome = await future
        except BaseException:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._done(dialog)  # its batch ran; its result goes nowhere
            raise
        try:
            if outcome is queue.ALONE:
                return await alone()
            if isinstance(outcome, BaseException):
                raise outcome
            assert isinstance(outcome, tuple)
            return outcome
        finally:
            self._done(dialog)

    def _done(self, dialog: str) -> None:
        self._admitting[dialog] -= 1
        if self._admitting[dialog] <= 0:
            del self._admitting[dialog]
        self._next()

    def _next(self) -> None:
        """Start the next batch if there is room for it: the waiting sends, in order, at
        most one per sender and per dialog, none of a dialog being admitted now."""
        # Sends whose caller went away before their batch are dropped, never admitted.
        self._waiting = [(a, f) for a, f in self._waiting if not f.done()]
        if not self._waiting or self._under_way >= self.alone_limit:
            return
        batch: list[_Waiting] = []
        rest: list[_Waiting] = []
        senders: set[int] = set()
        dialogs: set[str] = set(self._admitting)
        for admission, future in self._waiting:
            sender, dialog = admission.inbound.owner.pk, str(admission.session.pk)
            if len(batch) < self.max_batch and sender not in senders and dialog not in dialogs:
                batch.append((admission, future))
                senders.add(sender)
            else:
                rest.append((admission, future))
            dialogs.add(dialog)  # a later send of the dialog waits for this one
        if not batch:
            return
        try:
            self._spawn("admission-batch", self._run(batch))
        except Exception as exc:  # shutting down: they are refused, and nothing is written
            for _admission, future in batch:
                future.set_exception(exc)
            self._waiting = [(a, f) for a, f in self._waiting if not f.done()]
            return
        self._waiting = rest
        self._under_way += 1
        for admission, _future in batch:
            self._admitting[str(admission.session.pk)] += 1

    async def _run(self, batch: list[_Waiting]) -> None:
        try:
            outcomes = await on_db(queue.admit_and_start_many)(
                [admission for admission, _f in batch], cfg=self.cfg, states=self.states
            )
        except Exception as exc:  # the trip itself failed: each send goes alone
            logger.warning("a batch of admissions did not run; each goes alone: %s", exc)
            outcomes = [queue.ALONE] * len(batch)
        except BaseException:  # shutting down: the senders' waits end with it
            for admission, future in batch:
                future.cancel()
                self._done(str(admission.session.pk))
            raise
        finally:
            self._under_way -= 1
        for (admission, future), outcome in zip(batch, outcomes, strict=True):
            if future.done():  # its caller went away: nothing waits for the outcome
                self._done(str(admission.session.pk))
            else:
                future.set_result(outcome)  # its caller ends the dialog's admission
        self._next()
