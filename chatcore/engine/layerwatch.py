"""Watching the channel layer of a scaled-mode process (G5).

Redis pub/sub forgets: when Redis restarts, the layer's subscriptions come back by themselves
(redis-py subscribes again on reconnect) but every frame published meanwhile is gone, and no
subscriber is told. So this process sends itself a ping through the layer four times a
second; when a publish fails or a ping does not come back in time, every connection that
registered here is told once per outage, and closes (the client reconnects and reads the state
anew: its `sessions` and `session_history` frames) instead of waiting silently for frames that
will never come.

Publishes reconnect at once when Redis is back, but the subscription comes back only on the
layer's next receive attempt (a second later at the earliest), so the frames lost in between
always include a ping.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

Listener = Callable[[], Awaitable[None]]


class LayerWatch:
    def __init__(self, *, interval: float = 0.25, timeout: float = 3.0) -> None:
        self.interval = interval
        self.timeout = timeout
        self.listeners: set[Listener] = set()
        self.healthy = True
        self.outages = 0

    def register(self, listener: Listener) -> None:
        self.listeners.add(listener)

    def unregister(self, listener: Listener) -> None:
        self.listeners.discard(listener)

    async def run(self, layer: Any) -> None:
        channel = await layer.new_channel("watch.")
        # One receive stays open for the watch's whole life: cancelling a receive on the
        # pub/sub layer drops the channel's subscription.
        pending: asyncio.Future[Any] | None = None
        seq = 0
        while True:
            seq += 1
            ok = True
            try:
                await asyncio.wait_for(
                    layer.send(channel, {"type": "watch.ping", "seq": seq}), self.timeout
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("channel layer publish failed: %s", type(exc).__name__)
                ok = False
            if ok:
                ok = False
                loop = asyncio.get_running_loop()
                deadline = loop.time() + self.timeout
                while loop.time() < deadline:
                    if pending is None:
                        pending = asyncio.ensure_future(layer.receive(channel))
                    done, _ = await asyncio.wait({pending}, timeout=deadline - loop.time())
                    if not done:
                        break
                    message, pending = pending, None
                    try:
                        got = message.result()
                    except Exception:
                        break
                    if got.get("seq") == seq:
                        ok = True
                        break
            await self._observe(ok)
            await asyncio.sleep(self.interval)

    async def _observe(self, ok: bool) -> None:
        if ok:
            if not self.healthy:
                logger.warning("channel layer is back")
            self.healthy = True
            return
        if not self.healthy:
            return
        self.healthy = False
        self.outages += 1
        logger.error(
            "channel layer lost frames; closing %d connections so they resync",
            len(self.listeners),
        )
        for listener in list(self.listeners):
            try:
                await listener()
            except Exception:
                logger.exception("a connection did not close after a layer outage")
