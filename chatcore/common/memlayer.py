"""The embedded mode's channel layer: Channels' in-memory layer without its per-message sweeps.

`channels.layers.InMemoryChannelLayer` walks every channel and every group membership of the
process at each `group_send` and each `receive` (expiry cleanup), starts a task per recipient
and deep-copies the message for each. With a hundred sockets streaming snapshots that walk is
most of the event loop's time. This layer keeps the same behaviour (same capacity, same expiry
of unread messages and of group memberships, each recipient its own copy of the message) and
does the cleanup at most once per `CLEAN_INTERVAL_SECONDS`: expiry is counted in a minute
(messages) and a day (memberships), so sweeping once a second changes nothing a client sees.
"""

from __future__ import annotations

import asyncio
import time
from copy import deepcopy
from typing import Any

from channels.exceptions import ChannelFull
from channels.layers import InMemoryChannelLayer

CLEAN_INTERVAL_SECONDS = 1.0

_ATOMS = (str, int, float, bool, type(None))


def copy_message(value: Any) -> Any:
    """A copy no recipient shares with another (as `deepcopy`), fast for JSON-shaped data."""
    if isinstance(value, _ATOMS):
        return value
    if type(value) is dict:
        return {k: v if isinstance(v, _ATOMS) else copy_message(v) for k, v in value.items()}
    if type(value) is list:
        return [v if isinstance(v, _ATOMS) else copy_message(v) for v in value]
    return deepcopy(value)


class LocalChannelLayer(InMemoryChannelLayer):
    """`InMemoryChannelLayer` with amortised expiry cleanup and a direct group fan-out."""

    _cleaned_at = 0.0

    def _clean_expired(self) -> None:
        now = time.monotonic()
        if now - self._cleaned_at < CLEAN_INTERVAL_SECONDS:
            return
        self._cleaned_at = now
        super()._clean_expired()

    async def flush(self) -> None:
        await super().flush()
        self._cleaned_at = 0.0

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        assert isinstance(message, dict), "message is not a dict"
        self.require_valid_channel_name(channel)
        assert "__asgi_channel__" not in message
        self._put(channel, message)

    def _put(self, channel: str, message: dict[str, Any]) -> None:
        queue = self.channels.get(channel)
        if queue is None:
            queue = self.channels[channel] = asyncio.Queue(maxsize=self.get_capacity(channel))
        if queue.full():
            raise ChannelFull(channel)
        queue.put_nowait((time.time() + self.expiry, copy_message(message)))

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        """Every member gets its own copy; a full member misses this one (as in the base)."""
        assert isinstance(message, dict), "Message is not a dict"
        self.require_valid_group_name(group)
        self._clean_expired()
        for channel in list(self.groups.get(group, ())):
            try:
                self._put(channel, message)
            except ChannelFull:
                pass
