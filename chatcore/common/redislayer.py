"""The scaled mode's channel layer: channels_redis's pub/sub layer, with a process's publishes
batched and its own consumers' frames delivered without a round trip through Redis.

Groups, their subscriptions and receiving are channels_redis's (`RedisPubSubChannelLayer`),
as are the connections' options: the host's URL and keyword options (settings give every
Redis client connect and reply timeouts, `settings.REDIS_OPTIONS`; a URL's own options win).

A consumer's own channel: channels_redis subscribes each one (a SUBSCRIBE when a socket
opens, an UNSUBSCRIBE when it closes: 10,000 of each for a reconnect storm, issue 57). Here
its name carries its loop's tag, and one pattern subscription per loop, on channels_redis's
subscriber connection, covers them all (`new_channel`); any process reaches it by name.

Publishes: channels_redis sends every publish of a process through one connection under a
lock, a round trip each; a hundred streaming answers queued behind it. Here a publish joins
an outbox, and a task sends all that waits as one redis-py pipeline (one round trip), then
the next batch, in order. Each caller waits for its own batch and gets its error; a caller
cancelled meanwhile does not take its publish back (a turn's last snapshot still goes). The
outbox is bounded (`OUTBOX_MAX`): past it a publish fails at once with `ChannelFull`, as a
full channel does.

Local frames: a group send puts the frame in the queue of every member of the group on this
loop's layer at once, then publishes it for the other processes; a send to a channel of this
loop's layer is not published at all. Every publish carries this loop's origin tag, and the
queue of a channel made here (`Inbox`) drops a frame that comes back with its own tag: it was
delivered when sent. The layer watch's ping goes through Redis even to this process's own
channel (`send_by_server`). A frame without a tag (a layer of an older release) is delivered
as it comes. Each `Inbox` holds at most `capacity` frames; one more is dropped and counted
(`dropped`, shown on `/healthz`), as the embedded layer does: a consumer that stopped reading
never grows the process without end, and its client sees the gap and resyncs (D1, D2).

Delivery across processes is Redis pub/sub's: at most once; a frame lost with a connection
is the layer watch's business (`engine/layerwatch.py`).

Each `Inbox` is the embedded layer's light queue (`memlayer.Inbox`: an asyncio queue cost an
idle socket 3 KiB, issue 57), and tells the layer's `GroupListener`s of every frame it takes
(`heard_on`, by channel): the process's caches of what its sockets are sent (`engine.lists`)
are dropped when a frame for one of their sockets arrives, not when the socket gets to it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import weakref
from collections import deque
from typing import Any

from channels.exceptions import ChannelFull
from channels_redis.pubsub import RedisPubSubChannelLayer
from redis import asyncio as aioredis

from .memlayer import Inbox as LightInbox
from .publish import GroupListener

logger = logging.getLogger(__name__)

# Publishes sent in one pipeline at most (a larger outbox goes in several, in order).
MAX_BATCH = 256
# Publishes waiting to be sent, per loop, at most (I3).
OUTBOX_MAX = 10_000
# Frames waiting in one consumer's queue at most (the embedded layer's capacity).
CAPACITY = 1000
# A dropped frame is logged at most this often, with the count since the last line.
DROP_LOG_SECONDS = 10.0

# A tagged frame: this marker (0xc1, a byte msgpack never uses; the serializer's encrypted
# form is base64 text), the sending loop's 16-byte origin, then the serialized message.
MARK = b"\xc1"
TAG_LENGTH = 1 + 16
# The origin of frames that must come back even to the loop that sent them.
NOBODY = MARK + bytes(16)


class Inbox(LightInbox):
    """A consumer's queue on this layer: a frame tagged with its own loop's origin is dropped
    (delivered when sent), another's tag is taken off, and past `maxsize` a frame is dropped
    and counted rather than raising in channels_redis's receiving task; every frame taken
    is told to the layer's listeners (`heard_on`)."""

    __slots__ = ("_origin", "_layer", "name")

    def __init__(self, origin: bytes, layer: RedisPubSubLayer, name: str) -> None:
        super().__init__(layer.capacity)
        self._origin = origin
        self._layer = layer
        self.name = name

    def put_nowait(self, item: bytes) -> None:
        if item[:1] == MARK:
            if item[:TAG_LENGTH] == self._origin:
                return
            item = item[TAG_LENGTH:]
        for listener in self._layer.listeners:
            listener.heard_on(self.name)
        if self.full():
            self._layer.count_drop()
            return
        super().put_nowait(item)


class Publisher:
    """One loop's publishes: an outbox sent a redis-py pipeline per round trip, on a client
    of its own (channels_redis's connection for publishes is taken under the lock that its
    subscriptions also take)."""

    def __init__(self, host: dict[str, Any], prefix: str) -> None:
        self.origin = MARK + uuid.uuid4().bytes
        # What the names of this loop's channels carry (`RedisPubSubLayer.new_channel`).
        self.tag = self.origin[1:7].hex()
        self.pattern = f"{prefix}*{self.tag}!*"
        # The subscriber (channels_redis's shard's redis-py `PubSub`) that subscribed to
        # `pattern`; a new one after a `flush` subscribes again.
        self.heard_on: Any = None
        options = dict(host)
        self._client = aioredis.Redis.from_url(options.pop("address"), **options)
        self._outbox: deque[tuple[str, bytes, asyncio.Future[None]]] = deque()
        self._flusher: asyncio.Task[None] | None = None

    async def publish(self, channel: str, data: bytes) -> None:
        if len(self._outbox) >= OUTBOX_MAX:
            raise ChannelFull(f"{OUTBOX_MAX} publishes wait for Redis already")
        loop = asyncio.get_running_loop()
        sent: asyncio.Future[None] = loop.create_future()
        self._outbox.append((channel, data, sent))
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush(), name="redis-layer-publish")
        await sent

    async def _flush(self) -> None:
        while self._outbox:
            batch = [self._outbox.popleft() for _ in range(min(MAX_BATCH, len(self._outbox)))]
            pipe = self._client.pipeline(transaction=False)
            for channel, data, _sent in batch:
                pipe.publish(channel, data)
            try:
                await pipe.execute()
            except Exception as exc:
                for _channel, _data, sent in batch:
                    if not sent.done():
                        sent.set_exception(exc)
                continue
            for _channel, _data, sent in batch:
                if not sent.done():
                    sent.set_result(None)

    async def aclose(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        for _channel, _data, sent in self._outbox:
            sent.cancel()
        self._outbox.clear()
        await self._client.aclose(close_connection_pool=True)


class RedisPubSubLayer(RedisPubSubChannelLayer):
    """`RedisPubSubChannelLayer` whose publishes are batched and whose own consumers' frames
    are delivered directly. One Redis host: publishes are not sharded."""

    def __init__(
        self,
        hosts: list[str | dict[str, Any]],
        prefix: str = "asgi",
        capacity: int = CAPACITY,
        **kwargs: Any,
    ) -> None:
        if len(hosts) != 1 or not (
            isinstance(hosts[0], str) or (isinstance(hosts[0], dict) and "address" in hosts[0])
        ):
            raise ValueError(
                f"{type(self).__name__} takes one Redis host, a URL or a dict of options with"
                f" its URL as 'address', not {hosts!r}"
            )
        super().__init__(hosts=hosts, prefix=prefix, **kwargs)
        self.host = {"address": hosts[0]} if isinstance(hosts[0], str) else hosts[0]
        self.prefix = prefix
        self.capacity = capacity
        self.dropped = 0
        self._dropped_unlogged = 0
        self._dropped_logged_at = -DROP_LOG_SECONDS
        self._publishers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Publisher] = (
            weakref.WeakKeyDictionary()
        )
        self.listeners: tuple[GroupListener, ...] = ()

    def add_group_listener(self, listener: GroupListener) -> None:
        """`listener` is told of every frame an `Inbox` of this layer takes (`heard_on`)."""
        self.listeners = (*self.listeners, listener)

    def _publisher(self) -> Publisher:
        loop = asyncio.get_running_loop()
        publisher = self._publishers.get(loop)
        if publisher is None:
            publisher = self._publishers[loop] = Publisher(self.host, self.prefix)
        return publisher

    def group_channel(self, group: str) -> str:
        """The Redis channel of `group`: channels_redis's name for it, which its subscribers
        listen on (`tests/test_redislayer.py` checks that a stock layer hears it)."""
        return f"{self.prefix}__group__{group}"

    def deserialize(self, message: bytes) -> Any:
        # A tagged frame in a queue that is not an `Inbox` (a channel channels_redis
        # subscribed by itself, on a `receive`): the tag is taken off here.
        if message[:1] == MARK:
            message = message[TAG_LENGTH:]
        return super().deserialize(message)

    async def new_channel(self, prefix: str = "specific.") -> str:
        """A channel of this loop's. Its name carries the loop's tag (`Publisher.tag`), and
        one pattern subscription per loop covers every such name (`_hear_own`): a socket's
        channel costs no SUBSCRIBE of its own, nor its end an UNSUBSCRIBE (issue 57: 10,000
        sockets back at once made 10,000 of each). Any process still reaches it by name."""
        publisher = self._publisher()
        name = f"{self.prefix}{prefix}{publisher.tag}!{uuid.uuid4().hex}"
        loop_layer = self._get_layer()
        # Nothing is published to a name before it exists: the queue is still empty.
        loop_layer.channels[name] = Inbox(publisher.origin, self, name)
        await self._hear_own(loop_layer, publisher)
        return name

    async def _hear_own(self, loop_layer: Any, publisher: Publisher) -> None:
        """The loop's pattern subscription, made on its first channel and again after a
        `flush`, on channels_redis's own subscriber connection (whose receiving task puts a
        pattern's frame in the queue of the channel it names, as a channel's; redis-py
        subscribes to it again on a new connection). Uses channels_redis's shard internals,
        pinned by `tests/test_redislayer.py`."""
        shard = loop_layer._get_shard(publisher.pattern)
        if shard._pubsub is not None and shard._pubsub is publisher.heard_on:
            return
        async with shard._lock:
            shard._ensure_redis()
            shard._ensure_receiver()
            if shard._pubsub is not publisher.heard_on:
                await shard._pubsub.psubscribe(publisher.pattern)
                publisher.heard_on = shard._pubsub

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        data = self.serialize(message)
        queue = self.channels.get(channel)
        if isinstance(queue, Inbox):
            if queue.full():
                raise ChannelFull(channel)
            queue.put_nowait(data)
            return
        publisher = self._publisher()
        await publisher.publish(channel, publisher.origin + data)

    async def send_by_server(self, channel: str, message: dict[str, Any]) -> None:
        """`send` through Redis even to a channel of this layer (the layer watch's ping)."""
        await self._publisher().publish(channel, NOBODY + self.serialize(message))

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        name = self.group_channel(group)
        data = self.serialize(message)
        channels = self.channels
        for member in self.groups.get(name, ()):
            queue = channels.get(member)
            if isinstance(queue, Inbox):
                queue.put_nowait(data)
        publisher = self._publisher()
        await publisher.publish(name, publisher.origin + data)

    async def flush(self) -> None:
        publisher = self._publishers.pop(asyncio.get_running_loop(), None)
        if publisher is not None:
            await publisher.aclose()
        await super().__getattr__("flush")()

    def count_drop(self) -> None:
        """A frame a full `Inbox` dropped: counted, and logged at most every
        `DROP_LOG_SECONDS` with the count since the last line."""
        self.dropped += 1
        self._dropped_unlogged += 1
        now = asyncio.get_running_loop().time()
        if now - self._dropped_logged_at >= DROP_LOG_SECONDS:
            logger.warning(
                "channel layer: %d frame(s) dropped for consumers %d behind",
                self._dropped_unlogged,
                self.capacity,
            )
            self._dropped_unlogged = 0
            self._dropped_logged_at = now
