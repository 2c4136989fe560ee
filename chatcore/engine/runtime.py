"""The process-wide engine runtime: started once per server process inside its event loop.

`start_in_current_loop()` is called by the `serve` command when Daphne is ready and, as a
fallback for other ASGI servers, by the ASGI app on its first connection.
"""

from __future__ import annotations

import asyncio
import logging

from . import publish

logger = logging.getLogger(__name__)

_started_loop: asyncio.AbstractEventLoop | None = None


def start_in_current_loop() -> None:
    """Bind this process's engine to the running loop (idempotent)."""
    global _started_loop
    loop = asyncio.get_running_loop()
    if _started_loop is loop:
        return
    _started_loop = loop
    publish.bind_loop(loop)
    logger.info("engine runtime started")
