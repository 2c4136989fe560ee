"""The database threads: where async code runs its ORM calls (F7, G6).

Django's async ORM story (`sync_to_async` with its default `thread_sensitive=True`) runs every
call of the process on one thread, so one dialog's slow history read or a storage write
waiting out a lock holds up `/stop`, admission and every other dialog behind it. Async code
here runs its database work through `on_db(fn)(...)` instead: a small pool of threads
(`CHAT["DB_THREADS"]`, a `concurrent.futures.ThreadPoolExecutor` handed to asgiref's
`sync_to_async`), so calls of independent dialogs run side by side, in the order they came.
Calls of one dialog still run one after another, because the coroutine that makes them
awaits each. (A pool of the project's own that ran a started turn's build ahead of the calls
waiting measured no better end to end: `bench/notes/others.md`.)

Connections: every thread keeps its own. On SQLite it stays open (`CONN_MAX_AGE=None`: opening
one costs more than most queries); on PostgreSQL it goes back to Django's connection pool
(`OPTIONS["pool"]`, psycopg's pool) after each call, so the pool, not the thread count, is
what bounds the server's connections. A connection left broken by an error is dropped either
way, so the next call connects again (G5). A call never leaves a transaction open behind it.
A call that may run twice (`on_db_idempotent`: a read, a last-used stamp) also outlives a
connection the server ended under it: it runs once more on a fresh one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Generic, ParamSpec, TypeVar

from asgiref.sync import AsyncToSync, sync_to_async
from django.conf import settings
from django.db import InterfaceError, OperationalError, connections

from chatcore.common.errors import Overloaded

P = ParamSpec("P")
T = TypeVar("T")
I = TypeVar("I")  # noqa: E741 (an item)
R = TypeVar("R")

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def thread_count() -> int:
    return max(1, int(settings.CHAT.get("DB_THREADS", 6)))


def executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's database threads (created on first use)."""
    global _executor
    if _executor is None:
        with _lock:
            if _executor is None:
                _executor = concurrent.futures.ThreadPoolExecutor(
                    thread_count(), thread_name_prefix="chat-db"
                )
    return _executor


def under_sync_caller() -> bool:
    """Whether this runs under `async_to_sync` called from synchronous code (an admin action,
    a management command, a Celery task), whose thread may hold a connection and an open
    transaction. asgiref (measured: 3.13.0) keeps that caller's executor in
    `AsyncToSync.executors.current`, which it does not document; `tests/test_dbthreads.py`
    fails if an upgrade changes it (SPEC I2)."""
    return getattr(AsyncToSync.executors, "current", None) is not None


def on_db(fn: Callable[P, T]) -> Callable[P, Coroutine[Any, Any, T]]:
    """`fn` as a coroutine function that runs on one of the database threads.

    Called under `async_to_sync` from a synchronous caller (an admin action, a management
    command, a Celery task), it runs on that caller's thread instead, as Django's own
    `sync_to_async` does: the call then sees the caller's connection and open transaction."""
    if under_sync_caller():
        return sync_to_async(fn, thread_sensitive=True)
    return sync_to_async(functools.partial(_call, fn), thread_sensitive=False, executor=executor())


def on_db_idempotent(fn: Callable[P, T]) -> Callable[P, Coroutine[Any, Any, T]]:
    """`on_db` for a call that may run twice with the same effect (a read; a write that only
    stamps a time): when the server ended its connection under it (a restart, an ended
    backend, a pooled connection lost between the pool's check and the first query; A4), the
    broken connection is dropped and the call runs once more on a fresh one, so the request
    it serves does not fail for it. Any other error, a second loss, or a loss inside the
    caller's own transaction (a synchronous caller) is raised as it is."""

    @functools.wraps(fn)
    def again_if_lost(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except (OperationalError, InterfaceError) as exc:
            if not _connection_lost():
                raise
            logger.warning("a database connection was lost under a call; running it again: %s", exc)
            release_connections()
        return fn(*args, **kwargs)

    return on_db(again_if_lost)


def _connection_lost() -> bool:
    """After an error: did it come from a connection that no longer works (and that no open
    transaction of the caller's depends on)?"""
    opened = connections.all(initialized_only=True)
    if any(conn.in_atomic_block for conn in opened):
        return False
    return any(conn.connection is not None and not conn.is_usable() for conn in opened)


def start_on_db(fn: Callable[[], T]) -> concurrent.futures.Future[T] | None:
    """`fn` handed to a database thread now, not when the caller next awaits: for work
    meant to run beside the call under way (a started turn's build while its admission
    commits). The thread's own future: the loop waits on it through `asyncio.wrap_future`,
    or takes its result once done. None for a synchronous caller, whose calls run on its own
    thread one after another."""
    if under_sync_caller():
        return None
    return executor().submit(contextvars.copy_context().run, _call, fn)


def _call(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    try:
        return fn(*args, **kwargs)
    finally:
        release_connections()


def release_connections() -> None:
    """After a call: hand a pooled connection back, drop a broken one, keep the rest."""
    for conn in connections.all(initialized_only=True):
        if conn.connection is None or conn.in_atomic_block:
            continue
        # A pooled connection has a close time (now: CONN_MAX_AGE=0); a kept one has none.
        if conn.errors_occurred or conn.close_at is not None:
            conn.close_if_unusable_or_obsolete()


class Lane:
    """Calls that take turns anyway (SQLite's writes: one at a time per database) go to the
    database threads in one trip per batch instead of one trip each: those made while a
    trip of the lane is under way wait for it and go together in the next (at most
    `max_batch`), each in its caller's context (so `storage`'s per-attempt flag holds) and with
    its own result or error. A burst of sends then costs a few trips, not one each: no thread
    hop per send, and no database threads queueing on the write lock while they hold the GIL
    the event loop needs. Calls of a lane run one after another; readers are not held up (they
    use `on_db`)."""

    def __init__(self, name: str, *, max_batch: int = 32) -> None:
        self.name = name
        self.max_batch = max_batch
        self._pending: list[tuple[Callable[[], Any], contextvars.Context, asyncio.Future[Any]]] = []
        self._drainer: asyncio.Task[None] | None = None

    async def run(self, fn: Callable[[], T]) -> T:
        if under_sync_caller():
            return await on_db(fn)()  # a synchronous caller's thread and transaction
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._pending.append((fn, contextvars.copy_context(), future))
        if self._drainer is None or self._drainer.done():
            self._drainer = loop.create_task(self._drain(), name=f"lane:{self.name}")
        return await future

    async def _drain(self) -> None:
        while self._pending:
            batch = self._pending[: self.max_batch]
            del self._pending[: self.max_batch]
            try:
                outcomes = await on_db(_run_each)([(fn, ctx) for fn, ctx, _f in batch])
            except BaseException as exc:  # the trip itself failed (shutdown): tell everyone
                for _fn, _ctx, future in batch:
                    _settle(future, False, exc)
                raise
            for (_fn, _ctx, future), (ok, value) in zip(batch, outcomes, strict=True):
                _settle(future, ok, value)


class Batch(Generic[I, R]):
    """Items asked for while one of its trips is under way go together in the next trip
    (at most `max_batch`): `run_many(items)` on a thread of its own, which takes the next
    trip as soon as one is back, one result per item, in order; its error is every item's.
    For work whose per-call cost dwarfs the per-item one (a round trip to a cache server): a
    burst of calls costs a few trips, not one each (the send-rate charges made from the
    loop, `rates.acharge`). Its trips never wait for a database thread, nor for the event
    loop: `start` hands back the trip thread's own future, which a database thread may wait
    on, and which is settled the moment the trip is back, however busy the loop is."""

    def __init__(
        self,
        name: str,
        run_many: Callable[[list[I]], list[R]],
        *,
        max_batch: int = 256,
        max_waiting: int = 10_000,
    ) -> None:
        self.name = name
        self.run_many = run_many
        self.max_batch = max_batch
        # I3: items waiting for a trip at most (a server that answers slowly holds each trip
        # up to its timeout); past it an item is refused with `Overloaded`.
        self.max_waiting = max_waiting
        self._items: list[tuple[I, concurrent.futures.Future[R]]] = []
        self._ready = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None

    async def run(self, item: I) -> R:
        if under_sync_caller():
            return (await on_db(self.run_many)([item]))[0]  # a synchronous caller's thread
        return await asyncio.wrap_future(self.start(item))

    def start(self, item: I) -> concurrent.futures.Future[R]:
        """The item on its way (in the trip under way's successor); its result or error is
        set on the trip's thread."""
        future: concurrent.futures.Future[R] = concurrent.futures.Future()
        with self._ready:
            if len(self._items) >= self.max_waiting:
                raise Overloaded()
            self._items.append((item, future))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._trips, name=f"chat-{self.name}", daemon=True
                )
                self._thread.start()
            self._ready.notify()
        return future

    def _trips(self) -> None:
        while True:
            with self._ready:
                while not self._items:
                    self._ready.wait()
                batch = self._items[: self.max_batch]
                del self._items[: self.max_batch]
            # An item whose caller gave up still goes (a charge is counted all the same);
            # only its result has nowhere to go.
            wanted = [future.set_running_or_notify_cancel() for _item, future in batch]
            try:
                results = self.run_many([item for item, _f in batch])
            except BaseException as exc:  # every item's error; the thread takes the next trip
                for (_item, future), waited in zip(batch, wanted, strict=True):
                    if waited:
                        future.set_exception(exc)
                continue
            for (_item, future), waited, result in zip(batch, wanted, results, strict=True):
                if waited:
                    future.set_result(result)
            del batch, results


def _run_each(calls: list[tuple[Callable[[], Any], contextvars.Context]]) -> list[tuple[bool, Any]]:
    """Run a lane's batch, each call in its caller's context; the results go back together
    (the turns they start begin streaming after the batch, not between its writes)."""
    out: list[tuple[bool, Any]] = []
    for fn, ctx in calls:
        try:
            out.append((True, ctx.run(fn)))
        except Exception as exc:
            out.append((False, exc))
        finally:
            # One call's broken connection is not the next one's (G5).
            release_connections()
    return out


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():
        return  # its caller went away; the call ran all the same
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def on_every_thread(fn: Callable[[], object]) -> None:
    """Run `fn` once on each database thread and wait (closing connections before the test
    database is dropped; installing a statement wrapper in a test). Blocks: call it from
    synchronous code or through `asyncio.to_thread`."""
    count = thread_count()
    barrier = threading.Barrier(count, timeout=10)

    def run_here() -> None:
        fn()
        # Hold this thread until every thread has run `fn`, so each one runs it once.
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            pass

    for future in [executor().submit(run_here) for _ in range(count)]:
        future.result(timeout=15)


def close_all() -> None:
    """Close every database thread's connection (before the test database is dropped)."""
    if _executor is not None:
        on_every_thread(connections.close_all)
