"""Database calls that come faster than they finish, made together (G6).

A hundred answers streamed together end together: each turn's last step boundary reads
whether anything is staged for it (`take_staged`), then its commit writes the answer
(`commit_outcome`). One at a time each is a trip to the database threads of its own; a
hundred at once queued on those threads, and the burst's last `turn_updated` waited
200-300 ms for its turn's trips, on a server that was otherwise idle between deltas
(`bench/README.md`). So, as with a burst's admissions (`admissions`), while `alone_limit`
calls of a kind are under way the next ones wait and then go together, as many as have
gathered (at most `max_batch`), as one call that does all of them on one connection
(`together`). One call at a time never waits: it goes alone at once, as before.

`together` gets the items and returns, for each in order, its result, its own exception, or
`ALONE`: that item is made on its own after the batch (its usual call, with its retries),
which is how a batch leaves anything unusual (a lost lease, a dialog cleared, a row another
transaction holds) to the path that handles it. An error of the batch itself sends every
item alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

from chatcore.common.dbthreads import on_db

logger = logging.getLogger(__name__)

I = TypeVar("I")  # noqa: E741 (an item)
R = TypeVar("R")


class _Alone:
    def __repr__(self) -> str:
        return "ALONE"


# An item a batch leaves to its own call.
ALONE: Any = _Alone()


class Gathered(Generic[I, R]):
    """Calls of one kind (`name`), made alone or together. `together` runs on a database
    thread; `spawn` starts a batch's task (the engine's supervisor, F1)."""

    def __init__(
        self,
        name: str,
        together: Callable[[list[I]], list[Any]],
        *,
        spawn: Callable[[str, Coroutine[Any, Any, None]], object],
        alone_limit: int,
        max_batch: int = 32,
    ) -> None:
        self.name = name
        self._together = together
        self._spawn = spawn
        self.alone_limit = max(1, alone_limit)
        self.max_batch = max(1, max_batch)
        self._under_way = 0  # calls alone and batches, on the database threads now
        self._waiting: list[tuple[I, asyncio.Future[Any]]] = []

    async def __call__(self, item: I, alone: Callable[[], Awaitable[R]]) -> R:
        """`item`'s result: `alone()` when fewer than `alone_limit` calls are under way and
        none waits; otherwise from the next batch, or `alone()` after it."""
        if self._under_way < self.alone_limit and not self._waiting:
            self._under_way += 1
            try:
                return await alone()
            finally:
                self._under_way -= 1
                self._next()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        self._next()
        outcome = await future
        if outcome is ALONE:
            return await alone()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _next(self) -> None:
        # An item whose caller went away before its batch is dropped, never made.
        self._waiting = [(i, f) for i, f in self._waiting if not f.done()]
        if not self._waiting or self._under_way >= self.alone_limit:
            return
        batch, self._waiting = (
            self._waiting[: self.max_batch],
            self._waiting[self.max_batch :],
        )
        run = self._run(batch)
        try:
            self._spawn(f"{self.name}-batch", run)
        except Exception:  # shutting down: each goes alone, which refuses or runs it
            run.close()
            for _item, future in batch:
                future.set_result(ALONE)
            return
        self._under_way += 1

    async def _run(self, batch: list[tuple[I, asyncio.Future[Any]]]) -> None:
        try:
            outcomes = await on_db(self._together)([item for item, _f in batch])
        except Exception as exc:  # the batch itself failed: each goes alone
            logger.warning(
                "a batch of %d %s did not run; each goes alone: %s", len(batch), self.name, exc
            )
            outcomes = [ALONE] * len(batch)
        except BaseException:  # shutting down: the callers' waits end with it
            self._under_way -= 1
            for _item, future in batch:
                future.cancel()
            self._next()  # the calls still waiting go on (alone, once shutdown refuses)
            raise
        self._under_way -= 1
        for (_item, future), outcome in zip(batch, outcomes, strict=True):
            if not future.done():  # else its caller went away: nothing waits for it
                future.set_result(outcome)
        self._next()
