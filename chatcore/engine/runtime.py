"""The process-wide engine: one per server process, living in the server's event loop.

`start_in_current_loop()` is called by the `serve` command when Daphne is ready and, as a
fallback for other ASGI servers, by the ASGI app on its first connection. It also starts the
services of `CHAT["ENGINE_SERVICES"]` with the engine (the chat apps' adapters). Channels reach the
engine through `get_engine()`.
"""

from __future__ import annotations

import asyncio
import logging

from django.conf import settings
from django.utils.module_loading import import_string

from chatcore.common import publish

from .engine import Engine

logger = logging.getLogger(__name__)

_engine: Engine | None = None
_started_loop: asyncio.AbstractEventLoop | None = None
_start_task: asyncio.Task[None] | None = None


def start_in_current_loop() -> None:
    """Create and start this process's engine in the running loop (idempotent)."""
    global _engine, _started_loop, _start_task
    loop = asyncio.get_running_loop()
    if _started_loop is loop:
        return
    _started_loop = loop
    publish.bind_loop(loop)
    _engine = Engine()
    _start_task = loop.create_task(_engine.start())
    for path in settings.CHAT.get("ENGINE_SERVICES", ()):
        # E.g. the chat apps' adapters: tasks on the engine's supervisor, stopped with it.
        import_string(path)(_engine)
    logger.info("engine started")


async def get_engine() -> Engine:
    """The engine of this process, started in the current loop."""
    start_in_current_loop()
    assert _engine is not None
    if _start_task is not None and not _start_task.done():
        await _start_task
    return _engine


def current_engine() -> Engine | None:
    """This process's engine when one was created here, else None (no start)."""
    return _engine


def set_engine(engine: Engine | None) -> None:
    """Install an engine (tests, the terminal channel) as this process's engine."""
    global _engine, _started_loop, _start_task
    _engine = engine
    _start_task = None
    _started_loop = engine.loop if engine is not None else None


async def shutdown() -> None:
    if _engine is not None:
        await _engine.shutdown()
