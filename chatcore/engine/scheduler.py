"""How background jobs (titles B4, compaction B5) are started: the scheduler the engine is
built with (STYLE 15: passed in, no module global).

- `InProcessScheduler` (embedded mode): the job functions of `jobs` run as tasks of the
  engine's supervisor, in the engine's loop, with the engine's provider.
- `CeleryScheduler` (scaled mode): the job is enqueued by task name after commit; Celery
  workers run `sessions_app.tasks`, thin wrappers that call the same job functions by id. The
  tasks module is never imported here: the engine does not depend on its consumers.

Either way one job per kind and dialog is pending at a time: a burst of turns schedules one
title, not ten. The guard lives in the shared cache (Redis in scaled mode); the job clears it
when done.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from django.conf import settings
from django.core.cache import cache
from django.db import transaction

from . import jobs
from .provider_types import ChatProvider

logger = logging.getLogger(__name__)

# Job name -> the Celery task that runs it (`sessions_app.tasks`).
TASK_NAMES = {
    "generate_title": "sessions_app.tasks.generate_title",
    "compact_session": "sessions_app.tasks.compact_session",
}


class Scheduler(Protocol):
    def schedule(self, job: str, **kwargs: Any) -> None:
        """Start `job` (a key of `TASK_NAMES`) off the caller's path. Callable from sync code
        (inside a transaction: the job starts only after commit) and never raises."""

    def warm(self) -> None:
        """Make ready, once at the server's start and off its loop, what the process's first
        `schedule` would otherwise set up while turns stream. Never raises."""


def _take_guard(job: str, session_pk: str) -> bool:
    try:
        if not cache.add(
            jobs.guard_key(job, session_pk), 1, timeout=settings.CELERY_TASK_TIME_LIMIT
        ):
            logger.info("%s already pending", job, extra={"session_id": session_pk})
            return False
    except Exception as exc:
        # G5: Redis is away; the next turn that makes the job due schedules it again.
        logger.warning("%s not scheduled: %s", job, type(exc).__name__)
        return False
    return True


def _drop_guard(job: str, session_pk: str) -> None:
    try:
        cache.delete(jobs.guard_key(job, session_pk))
    except Exception:
        logger.warning("could not clear the %s guard", job)


class CeleryScheduler:
    """Scaled mode: enqueue by task name after the caller's transaction commits."""

    def __init__(self, send_task: Callable[..., Any] | None = None, *, app: Any = None) -> None:
        """`app`: the Celery app to enqueue on (`chatcore.celery.app` by default); `send_task`:
        in its place, a function that takes the task (a test's)."""
        if send_task is not None:
            self._app, self._send_task = None, send_task
            return
        if app is None:
            from chatcore.celery import app
        self._app, self._send_task = app, app.send_task

    def warm(self) -> None:
        """What Celery's first `send_task` in a process does before it sends: import the
        broker's transport and the result backend's, make the producer pool, connect. That
        took about 0.1 s of the interpreter (most of it imports), which the first title or
        summary scheduled during traffic cost every stream of the process. A broker away now
        is no error here: the first send connects, as it would have."""
        if self._app is None:
            return
        try:
            self._app.backend  # noqa: B018 (resolved on first use: an import)
            with self._app.producer_or_acquire() as producer:
                producer.connection.ensure_connection(max_retries=1)
                channel = producer.connection.default_channel
                # Redis: the client the sends use, connected in its turn.
                acquire = getattr(channel, "conn_or_acquire", None)
                if acquire is not None:
                    with acquire() as client:
                        client.ping()
        except Exception as exc:
            logger.warning("could not reach the broker at start: %s", type(exc).__name__)

    def schedule(self, job: str, **kwargs: Any) -> None:
        session_pk = str(kwargs["session_pk"])
        if not _take_guard(job, session_pk):
            return

        def enqueue() -> None:
            try:
                self._send_task(TASK_NAMES[job], kwargs=kwargs)
            except Exception as exc:
                logger.warning("%s not enqueued: %s", job, type(exc).__name__)
                _drop_guard(job, session_pk)

        transaction.on_commit(enqueue)


class InProcessScheduler:
    """Embedded mode: run the job under `spawn` (the engine's supervisor) in `loop`."""

    RUNNERS: dict[str, Callable[..., Coroutine[Any, Any, Any]]] = {
        "generate_title": jobs.generate_title,
        "compact_session": jobs.compact_session,
    }

    def __init__(
        self,
        *,
        spawn: Callable[[str, Coroutine[Any, Any, Any]], Any],
        provider: ChatProvider,
        loop: Callable[[], asyncio.AbstractEventLoop | None],
        closing: Callable[[], bool],
    ) -> None:
        self._spawn = spawn
        self._provider = provider
        self._loop = loop
        self._closing = closing

    def schedule(self, job: str, **kwargs: Any) -> None:
        session_pk = str(kwargs["session_pk"])
        loop = self._loop()
        if loop is None or self._closing():
            logger.info("no engine to run %s in-process; skipped", job)
            return
        if not _take_guard(job, session_pk):
            return
        runner = self.RUNNERS[job]

        def spawn() -> None:
            coro = runner(provider=self._provider, **kwargs)
            try:
                self._spawn(f"{job}:{session_pk}", coro)
            except Exception:
                # The engine is shutting down: the job is dropped, the guard with it.
                coro.close()
                _drop_guard(job, session_pk)

        # A fresh context: the caller's (a sync_to_async worker) must not leak into the job, or
        # asgiref would take the job's own sync_to_async calls for nested ones and refuse them.
        loop.call_soon_threadsafe(spawn, context=contextvars.Context())

    def warm(self) -> None:
        """Nothing to make ready: the jobs run in this process."""


class NoScheduler:
    """No engine in this process and no Celery (embedded mode outside the server): the job
    is skipped; the next turn that makes it due schedules it again."""

    def schedule(self, job: str, **kwargs: Any) -> None:
        logger.info("no engine to run %s in-process; skipped", job)

    def warm(self) -> None:
        """Nothing to make ready."""
