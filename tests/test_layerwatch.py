"""The channel layer watch (G5): a lost frame closes this process's sockets once so they
resync; a frame that is only late (a busy event loop) closes nothing."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from chatcore.common.memlayer import LocalChannelLayer
from chatcore.engine.layerwatch import LayerWatch


class DroppingLayer(LocalChannelLayer):
    """The process's layer, losing the next message when told to, as Redis pub/sub does
    while a subscription is being restored."""

    drop_next = False

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        if self.drop_next:
            self.drop_next = False
            return
        await super().send(channel, message)


async def _watching(layer: DroppingLayer) -> tuple[LayerWatch, list[str], asyncio.Task[None]]:
    watch = LayerWatch(interval=0.05, timeout=0.2, give_up=10)
    closed: list[str] = []

    async def close() -> None:
        closed.append("4012")

    watch.register(close)
    task = asyncio.ensure_future(watch.run(layer))
    await asyncio.sleep(0.3)
    return watch, closed, task


async def test_a_stalled_loop_is_not_an_outage() -> None:
    # covers: G5, F7 (an overloaded process does not close every socket)
    layer = DroppingLayer()
    watch, closed, task = await _watching(layer)
    try:
        # The loop is held far past the ping's timeout (a hundred streams, say): the ping
        # comes back late, in order, and nothing is closed.
        asyncio.get_running_loop().call_soon(time.sleep, 0.8)
        await asyncio.sleep(1.0)
        assert closed == [] and watch.outages == 0 and watch.healthy
    finally:
        task.cancel()


async def test_a_lost_ping_closes_the_sockets_once() -> None:
    # covers: G5, D1 (lost frames: clients resync instead of waiting silently)
    layer = DroppingLayer()
    watch, closed, task = await _watching(layer)
    try:
        layer.drop_next = True
        for _ in range(100):
            if closed:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # later pings come back: the outage is over, no new close
        assert closed == ["4012"] and watch.outages == 1 and watch.healthy
    finally:
        task.cancel()
