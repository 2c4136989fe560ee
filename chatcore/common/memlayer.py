"""The embedded mode's channel layer: Channels' in-memory layer without its per-message sweeps.

`channels.layers.InMemoryChannelLayer` (measured against channels 4.3.2) sweeps every channel
and group membership for expired entries at each `group_send` and each `receive`, and starts a
task per recipient of a group message. Here the sweep runs at most once per
`CLEAN_INTERVAL_SECONDS` (expiry is counted in a minute for messages and a day for
memberships, so no client sees the difference) and a group message goes straight into each
member's inbox, each its own copy; capacity and expiry are the base's. Beside the stock layer
at 100 streams it halves the CPU per stream (`bench/notes/others.md`). It shares the base's
`groups` (a channel's join time per group) and `channels`, whose values are its own:
`tests/test_memlayer.py` fails if an upgrade changes what it builds on (SPEC I2).

A member whose channel is full (a connection `capacity` messages behind) misses a group
message, as in Channels; each miss is counted (`dropped`, shown by `/healthz`) and logged, at
most once per `DROP_LOG_INTERVAL_SECONDS`. The client that missed a snapshot tail sees a gap
in the next one and is sent a full snapshot (`ChannelConnection.relay_snapshot`); one that
missed a history delta sees a gap in the revisions and asks for the history (D3).

A connection joins and leaves its groups in one call (`group_add_many`, `group_discard_many`),
and the process's caches of what connections are sent hear every group message as it is sent
(`add_group_listener`, `publish.GroupListener`).

A channel's unread messages wait in an `Inbox`, not an `asyncio.Queue`: every open socket's
reader waits on its channel all its life, and a queue (four deques, an event) cost an idle
socket 3 KiB, more than the rest of its own state (issue 57; measured beside it:
`bench/notes/reconnect.md`). The inbox keeps the queue's behaviour here (first in, first out,
a capacity, one reader at a time woken per message).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable
from copy import deepcopy
from typing import Any

from channels.exceptions import ChannelFull
from channels.layers import InMemoryChannelLayer

from .publish import GroupListener

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


class Inbox:
    """A channel's unread messages in order (here `(expires, message)`; the Redis layer's
    serialized frames), at most `maxsize` (0: no bound); a reader awaiting `get` holds a
    future only while it waits (and the inbox no container while nothing is in it)."""

    __slots__ = ("items", "maxsize", "waiters")

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self.items: deque[Any] | None = None
        self.waiters: list[asyncio.Future[None]] | None = None

    def qsize(self) -> int:
        return len(self.items) if self.items is not None else 0

    def empty(self) -> bool:
        return not self.items

    def full(self) -> bool:
        return 0 < self.maxsize <= self.qsize()

    def put_nowait(self, item: Any) -> None:
        if self.items is None:
            self.items = deque()
        self.items.append(item)
        self._wake_next()

    def get_nowait(self) -> Any:
        assert self.items, "the inbox is empty"
        item = self.items.popleft()
        if not self.items:
            self.items = None
        return item

    async def get(self) -> Any:
        while not self.items:
            waiter = asyncio.get_running_loop().create_future()
            if self.waiters is None:
                self.waiters = []
            self.waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if not waiter.cancelled() and self.items:
                    self._wake_next()  # woken, then cancelled: another reader takes it
                raise
            finally:
                if self.waiters is not None:
                    if waiter in self.waiters:
                        self.waiters.remove(waiter)
                    if not self.waiters:
                        self.waiters = None
        return self.get_nowait()

    def _wake_next(self) -> None:
        """Wake the reader that waits longest (one per message, as asyncio.Queue does)."""
        while self.waiters:
            waiter = self.waiters.pop(0)
            if not waiter.done():
                waiter.set_result(None)
                return


class LocalChannelLayer(InMemoryChannelLayer):
    """`InMemoryChannelLayer` with amortised expiry cleanup and a direct group fan-out."""

    _cleaned_at = 0.0
    # Group messages missed by full channels since the layer was made, and since last logged.
    dropped = 0
    _dropped_unlogged = 0
    _dropped_logged_at = -DROP_LOG_INTERVAL_SECONDS
    # Told of every group message sent (`add_group_listener`).
    listeners: tuple[GroupListener, ...] = ()

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._names = itertools.count(1)
        # Group names checked once each (a storm joins the same chats' groups again and again).
        self._valid_groups: set[str] = set()

    def _clean_expired(self) -> None:
        """Channels' sweep, on the inboxes: unread messages past their expiry dropped (their
        channel leaves its groups, as a reader that is gone), memberships past theirs."""
        now = time.monotonic()
        if now - self._cleaned_at < CLEAN_INTERVAL_SECONDS:
            return
        self._cleaned_at = now
        wall = time.time()
        for channel, inbox in list(self.channels.items()):
            while not inbox.empty() and inbox.items is not None and inbox.items[0][0] < wall:
                inbox.get_nowait()
                for members in self.groups.values():  # a reader that is gone leaves its groups
                    members.pop(channel, None)
                if inbox.empty():
                    self.channels.pop(channel, None)
        timeout = int(wall) - self.group_expiry
        for members in self.groups.values():
            for name, joined in list(members.items()):
                if joined and joined < timeout:
                    members.pop(name, None)

    async def flush(self) -> None:
        await super().flush()
        self._cleaned_at = 0.0

    async def new_channel(self, prefix: str = "specific.") -> str:
        """A name no other channel of this layer has (channels' draws twelve random letters
        one call each; nothing outside the process ever sees these names)."""
        return f"{prefix}.inmemory!{next(self._names)}"

    async def receive(self, channel: str) -> dict[str, Any]:
        """As the base, without building a spare queue at every call (the base's `setdefault`
        makes one each time); a channel's queue still goes when it is empty, so the channels
        of closed connections do not stay behind."""
        self.require_valid_channel_name(channel)
        self._clean_expired()
        inbox = self.channels.get(channel)
        if inbox is None:
            inbox = self.channels[channel] = Inbox(self.get_capacity(channel))
        try:
            _expires, message = await inbox.get()
        finally:
            if inbox.empty() and inbox.waiters is None and self.channels.get(channel) is inbox:
                del self.channels[channel]
        return message

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        assert isinstance(message, dict), "message is not a dict"
        self.require_valid_channel_name(channel)
        assert "__asgi_channel__" not in message
        self._put(channel, message)

    def _put(self, channel: str, message: dict[str, Any]) -> None:
        inbox = self.channels.get(channel)
        if inbox is None:
            inbox = self.channels[channel] = Inbox(self.get_capacity(channel))
        if inbox.full():
            raise ChannelFull(channel)
        inbox.put_nowait((time.time() + self.expiry, copy_message(message)))

    async def group_add(self, group: str, channel: str) -> None:
        await self.group_add_many((group,), channel)

    async def group_add_many(self, groups: Iterable[str], channel: str) -> None:
        """`group_add` of each group (joined now: memberships expire `group_expiry` later)."""
        self.require_valid_channel_name(channel)
        joined = time.time()
        for group in groups:
            if group not in self._valid_groups:
                self.require_valid_group_name(group)
                if len(self._valid_groups) < 100_000:
                    self._valid_groups.add(group)
            members = self.groups.get(group)
            if members is None:
                members = self.groups[group] = {}
            members[channel] = joined

    async def group_discard_many(self, groups: Iterable[str], channel: str) -> None:
        for group in groups:
            members = self.groups.get(group)
            if members is not None:
                members.pop(channel, None)
                if not members:
                    del self.groups[group]

    def add_group_listener(self, listener: GroupListener) -> None:
        self.listeners = (*self.listeners, listener)

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        """Every member gets its own copy; a full member misses this one (as in the base)."""
        assert isinstance(message, dict), "Message is not a dict"
        self.require_valid_group_name(group)
        for listener in self.listeners:
            listener.heard(group)
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
