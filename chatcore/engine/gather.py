"""Database calls that come faster than they finish, made together (G6).

A burst of a hundred sends arrives together, and a hundred answers streamed together end
together. One at a time, each send's admission, each turn's last step-boundary read
(`take_staged`) and each turn's commit (`commit_outcome`) is a trip to the database threads
of its own; a hundred at once queued there, each waiting for the interpreter lock, and the
burst's last first token and its last `turn_updated` waited hundreds of milliseconds for
them (`bench/README.md`). So while `alone_limit` calls of a kind are under way the next ones
wait and then go together, as many as have gathered (at most `max_batch`), as one call that
does all of them on one connection (`together`). One call at a time never waits: it goes
alone at once, as before.

`together` gets the items and returns, for each in order, its result, its own exception, or
`ALONE`: that item is made on its own after the batch (its usual call, with its retries),
which is how a batch leaves anything unusual (a busy dialog, a lost lease, a row another
transaction holds) to the path that handles it. An error of the batch itself sends every
item alone.

Two rules for the items of a kind that must not go together:
- `key`: items of one key are made one at a time, in the order they came (C1: a dialog's
  sends are admitted in the order they reached the process). While one is under way (alone,
  in a batch, or alone after its batch left it), the next waits; a batch holds at most one.
- `distinct`: a batch holds at most one item of each value (F7: a sender's slot counts are
  read once per batch, so two of its sends never start in one).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Hashable
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
    thread; `spawn` starts a batch's task (the engine's supervisor, F1). `key` and `distinct`
    as in the module's notes. `refuse_at_shutdown`: when no batch can start any more (the
    supervisor is shutting down), the waiting calls fail with its error instead of going
    alone (a new send is refused; a turn's end, left to go alone, still commits)."""

    def __init__(
        self,
        name: str,
        together: Callable[[list[I]], list[Any]],
        *,
        spawn: Callable[[str, Coroutine[Any, Any, None]], object],
        alone_limit: int,
        max_batch: int = 32,
        key: Callable[[I], Hashable] | None = None,
        distinct: Callable[[I], Hashable] | None = None,
        refuse_at_shutdown: bool = False,
    ) -> None:
        self.name = name
        self._together = together
        self._spawn = spawn
        self.alone_limit = max(1, alone_limit)
        self.max_batch = max(1, max_batch)
        self._key = key
        self._distinct = distinct
        self._refuse_at_shutdown = refuse_at_shutdown
        self._under_way = 0  # calls alone and batches, on the database threads now
        self._waiting: list[tuple[I, asyncio.Future[Any]]] = []
        # The keys of the items under way, alone or in a batch, and how many.
        self._held: Counter[Hashable] = Counter()

    async def __call__(self, item: I, alone: Callable[[], Awaitable[R]]) -> R:
        """`item`'s result: `alone()` when fewer than `alone_limit` calls are under way, none
        waits and none of its key is under way; otherwise from the next batch, or `alone()`
        after it."""
        key = self._key_of(item)
        if self._under_way < self.alone_limit and not self._waiting and key not in self._held:
            self._under_way += 1
            self._hold(key)
            try:
                return await alone()
            finally:
                self._under_way -= 1
                self._release(key)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        self._next()
        try:
            outcome = await future
        except BaseException:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._release(key)  # its batch ran and held its key; the result goes nowhere
            raise
        try:
            if outcome is ALONE:
                return await alone()
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        finally:
            self._release(key)

    def _key_of(self, item: I) -> Hashable | None:
        return self._key(item) if self._key is not None else None

    def _hold(self, key: Hashable | None) -> None:
        if key is not None:
            self._held[key] += 1

    def _unhold(self, key: Hashable | None) -> None:
        if key is not None:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]

    def _release(self, key: Hashable | None) -> None:
        """A call of `key` is done: the next of its key, or the next batch, may go."""
        self._unhold(key)
        self._next()

    def _next(self) -> None:
        """Start the next batch if there is room for it: the waiting items in order, at most
        `max_batch`, one per `key` and per `distinct`, none of a key under way."""
        if self._under_way >= self.alone_limit:
            return  # no room: every call that comes meanwhile waits (not a walk of them each)
        # An item whose caller went away before its batch is dropped, never made.
        self._waiting = [(i, f) for i, f in self._waiting if not f.done()]
        if not self._waiting:
            return
        batch: list[tuple[I, asyncio.Future[Any]]] = []
        rest: list[tuple[I, asyncio.Future[Any]]] = []
        keys: set[Hashable] = set(self._held)
        values: set[Hashable] = set()
        for item, future in self._waiting:
            key = self._key_of(item)
            value = self._distinct(item) if self._distinct is not None else None
            if len(batch) < self.max_batch and key not in keys and value not in values:
                batch.append((item, future))
                if value is not None:
                    values.add(value)
            else:
                rest.append((item, future))
            if key is not None:
                keys.add(key)  # a later item of the key waits for this one
        if not batch:
            return
        run = self._run(batch)
        try:
            self._spawn(f"{self.name}-batch", run)
        except Exception as exc:  # shutting down: no batch starts any more
            run.close()
            self._waiting = []
            for item, future in batch + rest:
                if self._refuse_at_shutdown:
                    future.set_exception(exc)
                else:
                    self._hold(self._key_of(item))  # released once its own call is done
                    future.set_result(ALONE)  # each goes alone, which refuses or runs it
            return
        self._waiting = rest
        self._under_way += 1
        for item, _future in batch:
            self._hold(self._key_of(item))

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
            for item, future in batch:
                future.cancel()
                self._unhold(self._key_of(item))
            self._next()  # the calls still waiting go on (alone, once shutdown refuses)
            raise
        self._under_way -= 1
        for (item, future), outcome in zip(batch, outcomes, strict=True):
            if future.done():  # its caller went away: nothing waits for the outcome
                self._unhold(self._key_of(item))
            else:
                future.set_result(outcome)  # its caller releases the key once it is done
        self._next()
