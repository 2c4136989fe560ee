"""Watching the channel layer of a scaled-mode process (G5).

Redis pub/sub forgets: when Redis restarts, the layer's subscriptions come back by themselves
(redis-py subscribes again on reconnect) but every frame published meanwhile is gone, and no
subscriber is told. So this process sends itself a ping through the layer four times a
second; when a publish fails, or a ping comes back while an older one never did (the layer
keeps their order, so that one was lost), or none comes back for `give_up` seconds, every
connection that registered here is told once per outage, and closes (the client reconnects
and reads the state anew: its `sessions` and `session_history` frames) instead of waiting
silently for frames that will never come.

Publishes reconnect at once when Redis is back, but channels_redis's receiving task opens its
subscription again only a second after it failed, so the frames lost in between include a
ping (unless a socket that connects meanwhile subscribes first: then the clients' own checks
find what was lost, a gap in the snapshot tails (D1) or in the revisions (D2)). A ping that is
only late (a loop busy with a hundred streams, a slow Redis) is not an outage: closing every
socket then would only add a hundred reconnects to the load.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

Listener = Callable[[], Awaitable[None]]


class LayerWatch:
    def __init__(
        self, *, interval: float = 0.25, timeout: float = 3.0, give_up: float = 30.0
    ) -> None:
        self.interval = interval
        self.timeout = timeout
        self.give_up = give_up
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
        loop = asyncio.get_running_loop()
        # Pings sent and not back yet, with when they were sent. The layer keeps their order,
        # so a ping that arrives while an older one is still missing proves the older one
        # lost; a ping that is only late (a busy loop, a slow Redis) is not an outage.
        missing: dict[int, float] = {}
        seq = 0
        # The ping must cross the layer's server even though its channel is this process's
        # (the Redis layer delivers its own consumers' frames directly otherwise).
        send = getattr(layer, "send_by_server", layer.send)
        while True:
            seq += 1
            try:
                await asyncio.wait_for(
                    send(channel, {"type": "watch.ping", "seq": seq}), self.timeout
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("channel layer publish failed: %s", type(exc).__name__)
                await self._observe(False)
                await asyncio.sleep(self.interval)
                continue
            missing[seq] = loop.time()
            lost = False
            deadline = loop.time() + self.timeout
            while seq in missing and not lost and loop.time() < deadline:
                if pending is None:
                    pending = asyncio.ensure_future(layer.receive(channel))
                done, _ = await asyncio.wait({pending}, timeout=deadline - loop.time())
                if not done:
                    break
                message, pending = pending, None
                try:
                    got = int(message.result().get("seq", 0))
                except Exception:
                    break
                missing.pop(got, None)
                older = [k for k in missing if k < got]
                for k in older:
                    del missing[k]
                lost = bool(older)
            if lost:
                await self._observe(False)
            elif not missing:
                await self._observe(True)
            elif loop.time() - min(missing.values()) > self.give_up:
                # Nothing came back for long: the subscription is gone for good.
                missing.clear()
                await self._observe(False)
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
