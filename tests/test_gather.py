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


async def test_calls_of_one_key_go_in_order_and_a_batch_holds_one_per_distinct_value() -> None:
    # covers: G6, C1, F7 (a dialog's sends are admitted one at a time in the order they came,
    # whether alone or in a batch; a batch holds at most one send per sender)
    tasks: list[asyncio.Task[None]] = []
    calls = Calls()
    # An item: dialog * 100 + sender * 10 + n; key = its dialog, distinct = its sender.
    gathered: Gathered[int, int] = Gathered(
        "test calls",
        calls.together,
        spawn=_spawn(tasks),
        alone_limit=1,
        key=lambda item: item // 100,
        distinct=lambda item: item // 10 % 10,
    )
    first = asyncio.create_task(gathered(110, calls.made_alone(110)))
    while calls.alone != [110]:
        await asyncio.sleep(0.01)
    # Dialog 1's second call waits for its first; dialogs 2 and 3 share sender 2; dialog
    # 4's two calls come one after the other.
    items = [111, 220, 320, 430, 431]
    rest = [asyncio.create_task(gathered(i, calls.made_alone(i))) for i in items]
    await asyncio.sleep(0.05)
    assert calls.batches == []
    calls.gate.set()
    assert await first == 220
    assert await asyncio.gather(*rest) == [i * 2 for i in items]
    # The first batch: one per dialog and per sender (dialog 1's first call had ended when it
    # formed). Then 320, whose sender was in it; 431 only once 430's caller was done.
    assert calls.batches == [[111, 220, 430], [320], [431]]


async def test_a_key_stays_held_while_its_call_goes_alone_after_its_batch() -> None:
    # covers: C1 (a send the batch left to its own admission is still the dialog's send
    # under way: the dialog's next send waits for it, never overtakes it)
    tasks: list[asyncio.Task[None]] = []
    calls = Calls()
    gates = {item: threading.Event() for item in (1, 107, 108)}

    def made_alone(item: int) -> Any:
        async def call() -> int:
            calls.alone.append(item)
            await asyncio.to_thread(gates[item].wait, 10)
            return item * 2

        return call

    gathered: Gathered[int, int] = Gathered(
        "test calls", calls.together, spawn=_spawn(tasks), alone_limit=1, key=lambda i: i // 100
    )
    first = asyncio.create_task(gathered(1, made_alone(1)))
    while calls.alone != [1]:
        await asyncio.sleep(0.01)
    left = asyncio.create_task(gathered(107, made_alone(107)))  # its batch leaves it
    await asyncio.sleep(0.05)
    gates[1].set()
    assert await first == 2
    while calls.alone != [1, 107]:  # after its batch, on its own, held at its gate
        await asyncio.sleep(0.01)
    after = asyncio.create_task(gathered(108, made_alone(108)))  # the same key
    await asyncio.sleep(0.05)
    assert calls.batches == [[107]]
    assert calls.alone == [1, 107]  # 108 waits for 107's own call
    gates[107].set()
    gates[108].set()
    assert await left == 214
    assert await after == 216
    assert calls.batches == [[107], [108]]


def _refusing_spawn(name: str, coro: Coroutine[Any, Any, None]) -> None:
    coro.close()
    raise RuntimeError("shutting down")


async def test_at_shutdown_waiting_calls_are_refused_when_asked_and_else_go_alone() -> None:
    # covers: F1, A4 (a send that waits for a batch when the engine shuts down is refused,
    # with nothing written; a turn's end that waits goes alone and still commits)
    for refuse in (True, False):
        calls = Calls()
        gathered: Gathered[int, int] = Gathered(
            "test calls",
            calls.together,
            spawn=_refusing_spawn,
            alone_limit=1,
            refuse_at_shutdown=refuse,
        )
        first = asyncio.create_task(gathered(1, calls.made_alone(1)))
        while calls.alone != [1]:
            await asyncio.sleep(0.01)
        waiting = [asyncio.create_task(gathered(i, calls.made_alone(i))) for i in (2, 3)]
        await asyncio.sleep(0.05)
        calls.gate.set()
        assert await first == 2
        results = await asyncio.gather(*waiting, return_exceptions=True)
        if refuse:
            assert [str(r) for r in results] == ["shutting down", "shutting down"]
            assert calls.alone == [1]
        else:
            assert results == [4, 6]
            assert sorted(calls.alone) == [1, 2, 3]
        assert calls.batches == []
