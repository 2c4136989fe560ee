"""The embedded mode's channel layer: Channels' in-memory layer without its per-message sweeps.

`channels.layers.InMemoryChannelLayer` (measured against channels 4.3.2) sweeps every channel
and group membership for expired entries at each `group_send` and each `receive`, and starts a
task per recipient of a group message. Here the sweep runs at most once per
`CLEAN_INTERVAL_SECONDS` (expiry is counted in a minute for messages and a day for
memberships, so no client sees the difference) and a group message goes straight into each
member's queue, each its own copy; capacity and expiry are the base's. Beside the stock layer
at 100 streams it halves the CPU per stream (`bench/notes/others.md`). It overrides the
base's private `_clean_expired` and shares its `channels` and `groups`:
`tests/test_memlayer.py` fails if an upgrade changes them (SPEC I2).

A member whose channel is full (a connection `capacity` messages behind) misses a group
message, as in Channels; each miss is counted (`dropped`, shown by `/healthz`) and logged, at
most once per `DROP_LOG_INTERVAL_SECONDS`. The client that missed a snapshot tail sees a gap
in the next one and is sent a full snapshot (`ChannelConnection.relay_snapshot`); one that
missed a history delta sees a gap in the revisions and asks for the history (D3).
"""

from __future__ import annotations

import asyncio
import logging
import time
from copy import deepcopy
from typing import Any

from channels.exceptions import ChannelFull
from channels.layers import InMemoryChannelLayer

CLEAN_INTERVAL_SECONDS = 1.0
DROP_LOG_INTERVAL_SECONDS = 10.0

logger = logging.getLogger(__name__)

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
    # Group messages missed by full channels since the layer was made, and since last logged.
    dropped = 0
    _dropped_unlogged = 0
    _dropped_logged_at = -DROP_LOG_INTERVAL_SECONDS

    def _clean_expired(self) -> None:
        now = time.monotonic()
        if now - self._cleaned_at < CLEAN_INTERVAL_SECONDS:
            return
        self._cleaned_at = now
        super()._clean_expired()

    async def flush(self) -> None:
        await super().flush()
        self._cleaned_at = 0.0

    async def receive(self, channel: str) -> dict[str, Any]:
        """As the base, without building a spare queue at every call (the base's `setdefault`
        makes one each time); a channel's queue still goes when it is empty, so the channels
        of closed connections do not stay behind."""
        self.require_valid_channel_name(channel)
        self._clean_expired()
        queue = self.channels.get(channel)
        if queue is None:
            queue = self.channels[channel] = asyncio.Queue(maxsize=self.get_capacity(channel))
        try:
            _expires, message = await queue.get()
        finally:
            if queue.empty() and self.channels.get(channel) is queue:
                del self.channels[channel]
        return message

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
                self._missed(group, channel)

    def _missed(self, group: str, channel: str) -> None:
        self.dropped += 1
        self._dropped_unlogged += 1
        now = time.monotonic()
        if now - self._dropped_logged_at < DROP_LOG_INTERVAL_SECONDS:
            return
        logger.warning(
            "channel layer: %d group message(s) missed by full channels (%d since start; "
            "latest: group %s, channel %s, %d unread)",
            self._dropped_unlogged,
            self.dropped,
            group,
            channel,
            self.channels[channel].qsize(),
        )
        self._dropped_logged_at = now
        self._dropped_unlogged = 0
