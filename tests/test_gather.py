"""Calls of one kind that come faster than they finish, made together (SPEC G6;
`chatcore.engine.gather`): alone while few are under way, else in the next batch; whatever a
batch leaves (`ALONE`) or a batch that fails goes alone, and each caller gets its own result
or error."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

import pytest

from chatcore.engine.gather import ALONE, Gathered


def _spawn(tasks: list[asyncio.Task[None]]) -> Any:
    def spawn(name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        tasks.append(task)
        return task

    return spawn


class Calls:
    """The calls made: each alone, or each batch's items; a gate holds the alone calls."""

    def __init__(self) -> None:
        self.alone: list[int] = []
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.lock = threading.Lock()

    def together(self, items: list[int]) -> list[Any]:
        with self.lock:
            self.batches.append(list(items))
        return [
            ALONE if item % 10 == 7 else ValueError(item) if item % 10 == 9 else item * 2
            for item in items
        ]

    def made_alone(self, item: int) -> Any:
        async def call() -> int:
            self.alone.append(item)
            await asyncio.to_thread(self.gate.wait, 10)
            return item * 2

        return call


async def test_calls_beyond_the_limit_go_together_and_each_gets_its_own_outcome() -> None:
    # covers: G6 (one call at a time goes alone at once; while the limit is under way, the
    # next ones gather into one batch; what the batch leaves goes alone, and an error of one
    # item is that caller's alone)
    tasks: list[asyncio.Task[None]] = []
    calls = Calls()
    gathered: Gathered[int, int] = Gathered(
        "test calls", calls.together, spawn=_spawn(tasks), alone_limit=1
    )
    first = asyncio.create_task(gathered(1, calls.made_alone(1)))
    while calls.alone != [1]:
        await asyncio.sleep(0.01)
    rest = [asyncio.create_task(gathered(i, calls.made_alone(i))) for i in (2, 7, 9, 4)]
    await asyncio.sleep(0.05)
    assert calls.batches == []  # they wait for the call under way
    calls.gate.set()
    assert await first == 2
    results = await asyncio.gather(*rest, return_exceptions=True)
    assert results[0] == 4 and results[1] == 14 and results[3] == 8
    assert isinstance(results[2], ValueError) and results[2].args == (9,)
    assert calls.batches == [[2, 7, 9, 4]]
    assert calls.alone == [1, 7]  # the one the batch left, after it


async def test_a_batch_that_fails_sends_each_call_alone_and_a_caller_gone_is_never_made() -> None:
    # covers: G6, A4 (no call is lost to a failed batch: each is made on its own, with its
    # own retries; a caller that went away before its batch ran asks for nothing)
    tasks: list[asyncio.Task[None]] = []
    calls = Calls()

    def failing(items: list[int]) -> list[Any]:
        calls.batches.append(list(items))
        raise RuntimeError("the batch's trip failed")

    gathered: Gathered[int, int] = Gathered(
        "test calls", failing, spawn=_spawn(tasks), alone_limit=1
    )
    first = asyncio.create_task(gathered(1, calls.made_alone(1)))
    while calls.alone != [1]:
        await asyncio.sleep(0.01)
    gone = asyncio.create_task(gathered(5, calls.made_alone(5)))
    rest = [asyncio.create_task(gathered(i, calls.made_alone(i))) for i in (2, 3)]
    await asyncio.sleep(0.05)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    calls.gate.set()
    assert await first == 2
    assert await asyncio.gather(*rest) == [4, 6]
    assert calls.batches == [[2, 3]]
    assert sorted(calls.alone) == [1, 2, 3]


async def test_a_batch_cancelled_at_shutdown_ends_its_callers_waits_and_the_rest_go_on() -> None:
    # covers: F1, G6 (the engine's supervisor cancels a batch's task when it shuts down: its
    # callers' waits end with it, never hang; calls still waiting are not left behind)
    tasks: list[asyncio.Task[None]] = []
    calls = Calls()
    in_batch, release = threading.Event(), threading.Event()

    def slow(items: list[int]) -> list[Any]:
        calls.batches.append(list(items))
        if len(calls.batches) == 1:
            in_batch.set()
            release.wait(10)
        return [item * 2 for item in items]

    gathered: Gathered[int, int] = Gathered(
        "test calls", slow, spawn=_spawn(tasks), alone_limit=1, max_batch=2
    )
    first = asyncio.create_task(gathered(1, calls.made_alone(1)))
    while calls.alone != [1]:
        await asyncio.sleep(0.01)
    waiting = [asyncio.create_task(gathered(i, calls.made_alone(i))) for i in (2, 3, 4)]
    await asyncio.sleep(0.05)
    calls.gate.set()
    assert await first == 2
    assert await asyncio.to_thread(in_batch.wait, 10)
    tasks[0].cancel()  # the batch of 2 and 3, its thread still at work
    results = await asyncio.gather(*waiting, return_exceptions=True)
    release.set()
    assert isinstance(results[0], asyncio.CancelledError)
    assert isinstance(results[1], asyncio.CancelledError)
    assert results[2] == 8  # 4 went on, in a batch of its own
    assert calls.batches == [[2, 3], [4]]
