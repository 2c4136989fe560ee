"""Supervision of every background asyncio task (F1): named, tracked, cancelled and reaped
within a bounded time on shutdown. Nothing is fire-and-forget."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from chatcore.common.errors import ShuttingDown

logger = logging.getLogger(__name__)


class TaskSupervisor:
    def __init__(self, name: str = "engine") -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._daemons: set[asyncio.Task[Any]] = set()
        self._closing = False

    @property
    def closing(self) -> bool:
        return self._closing

    def __len__(self) -> int:
        return len(self._tasks)

    def close(self) -> None:
        """Refuse new tasks from now on."""
        self._closing = True

    def spawn(
        self, name: str, coro: Coroutine[Any, Any, Any], *, daemon: bool = False
    ) -> asyncio.Task[Any]:
        """Run `coro` as a tracked task. Daemons (housekeeping loops) are cancelled at once on
        shutdown; other tasks get the grace period to finish."""
        if self._closing:
            coro.close()
            raise ShuttingDown()
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}:{name}")
        self._tasks.add(task)
        if daemon:
            self._daemons.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._daemons.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("supervised task %s failed", task.get_name(), exc_info=task.exception())

    async def shutdown(self, *, grace: float) -> None:
        """Refuse new tasks, give running ones `grace` seconds, then cancel and reap them."""
        self.close()
        for task in list(self._daemons):
            task.cancel()
        pending = set(self._tasks)
        if not pending:
            return
        _done, still = await asyncio.wait(pending, timeout=grace)
        for task in still:
            task.cancel()
        if still:
            await asyncio.wait(still, timeout=grace)
            leftover = [t.get_name() for t in still if not t.done()]
            if leftover:
                logger.error("tasks did not stop in time: %s", ", ".join(leftover))
