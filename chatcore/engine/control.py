"""The engine's housekeeping loops: the control channel (stop, snapshot requests, eviction
and kicks from other processes, C6, D1, A6) and the sweep (dialogs with work and no live
lease, C11; idle state and retention in embedded mode, A6, A7)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from django.conf import settings

from audit.trail import audit_purge_expired
from chatcore.common import publish
from chatcore.common.dbthreads import on_db
from sessions_app import files, services, storage

from . import recovery

logger = logging.getLogger(__name__)


class ControlHandler(Protocol):
    """What the control loop and the sweep call on the engine."""

    cfg: dict[str, Any]
    scope: Callable[[Any], Any] | None

    def cancel_local(self, turn_id: str) -> None: ...
    def active_snapshot(self, turn_id: str) -> dict[str, Any] | None: ...
    def evict_idle(self) -> int: ...
    def kick(self, session_pk: str) -> Awaitable[None]: ...
    def refresh_sockets(self) -> None: ...


async def control_loop(layer: Any, channel: str, engine: ControlHandler) -> None:
    while True:
        try:
            message = await layer.receive(channel)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("control channel receive failed")
            await asyncio.sleep(1)
            continue
        try:
            await handle_control(layer, message, engine)
        except asyncio.CancelledError:
            raise
        except Exception:
            # One bad message must not end cross-process stop and snapshot requests.
            logger.exception("control message failed: %s", message.get("type"))


async def handle_control(layer: Any, message: dict[str, Any], engine: ControlHandler) -> None:
    kind = message.get("type")
    if kind == "engine.cancel":
        engine.cancel_local(str(message.get("turn_id")))
    elif kind == "engine.snapshot_request":
        frame = engine.active_snapshot(str(message.get("turn_id")))
        reply = message.get("reply_channel")
        if frame is not None and reply:
            await layer.send(reply, {"type": publish.EVENT_TYPE, "frame": frame})
    elif kind == "engine.evict":
        engine.evict_idle()
    elif kind == "engine.kick":
        await engine.kick(str(message.get("session_pk")))


async def sweep_loop(engine: ControlHandler) -> None:
    """Pick up dialogs with work and no live lease (recovery after a crash, C11). In embedded
    mode also evict idle session state (A6) and purge dialogs past retention (A7); in scaled
    mode Celery beat schedules those."""
    cfg = engine.cfg
    interval = max(1.0, cfg["LEASE_SECONDS"] / 3)
    last_evict = time.monotonic()
    while True:
        try:
            for pk in await on_db(recovery.orphaned_sessions)(scope=engine.scope, cfg=cfg):
                await engine.kick(pk)
            if settings.SCALED:
                await on_db(engine.refresh_sockets)()
            if (
                not settings.SCALED
                and time.monotonic() - last_evict >= cfg["CLEANUP_INTERVAL_SECONDS"]
            ):
                last_evict = time.monotonic()
                engine.evict_idle()
                await on_db(services.sessions_purge_expired)()
                await on_db(audit_purge_expired)()  # H5
                await on_db(files.files_sweep_unused)()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("sweep failed")
            await storage.areset_broken_connection()
        await asyncio.sleep(interval)
