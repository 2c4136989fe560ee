"""The scaled mode's channel layer: channels_redis's pub/sub layer, its publishes pipelined
on a connection of their own.

`channels_redis.pubsub` sends every publish of a process through one connection per Redis
shard, one at a time under a lock: each waits for the previous one's round trip, and each
round trip for the event loop to read the reply. With a hundred answers streaming (twenty
snapshot frames a second each, plus history deltas and terminals) the publishes queued up
behind that lock: first tokens waited for the queue, and a publish still queued at a turn's
end risked its cancellation. Here a publish joins an outbox; a flusher writes all that waits
at once (one round trip), then the next batch. Order is kept (the outbox is sent in the order
it was filled, batch after batch), each publish's caller still waits for its own to be sent
and gets its own error, and a publish is on its way the moment it is made: a caller
cancelled meanwhile does not take it back.

The publishes go on a connection of the shard's own (`RespConnection`), which speaks
only what they need: the commands packed by hiredis, the replies read by hiredis as the
socket delivers them, one future per command. redis-py's pipeline (a command stack, a retry
wrapper, a timeout and a parse per reply) cost three times as much CPU per publish, on the
event loop every stream shares. The subscriptions have a connection of their own too, whose
pushes are put in the consumers' queues in its protocol's callback, where channels_redis ran
a task that woke for each message through redis-py's `get_message` and its timeout. A lost
subscribing connection is opened again a second later (`RESUBSCRIBE_SECONDS`), subscribed to
every channel the shard had, as channels_redis's retry did.

Frames for this process's own consumers do not go round through Redis: a group send puts
the frame in the queue of every member of the group on this layer at once (then publishes it
for the other processes), and a send to a channel of this layer is delivered without a
publish. Every publish carries the layer's origin tag, and a frame that comes back to the
layer that sent it (it subscribes to the same groups) is dropped: it was delivered when sent.
One consumer's frames keep their order, local and remote alike (each path is in send order);
the layer watch's pings, which exist to cross Redis, go through it (`send_by_server`). A
frame without a tag (a layer of an older release during a rolling deploy) is delivered as it
comes.

Delivery across processes is unchanged: Redis pub/sub, at most once; a frame lost with a
connection is the layer watch's business (`engine/layerwatch.py`).

A connection joins and leaves its groups in one call (`group_add_many`, `group_discard_many`:
one SUBSCRIBE or UNSUBSCRIBE for the groups this process did not follow yet, or no longer
follows). The process's caches of what connections are sent (`engine.lists`) hear of every
group message the layer sends or receives (`add_group_listener`), and of a lost subscribing
connection, when messages may have gone unheard.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from typing import Any

import hiredis
from channels_redis.pubsub import (
    RedisPubSubChannelLayer,
    RedisPubSubLoopLayer,
    RedisSingleShardConnection,
)
from channels_redis.utils import _wrap_close, create_pool, decode_hosts
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection

from .memlayer import Inbox
from .publish import GroupListener

# A lost subscribing connection is opened again after this long, and then once as often.
RESUBSCRIBE_SECONDS = 1.0

logger = logging.getLogger(__name__)

# Publishes sent in one pipeline at most (a larger outbox goes in several, in order).
MAX_BATCH = 256

# A tagged frame: this marker (0xc1, a byte msgpack never uses; the serializer's encrypted
# form is base64 text), the sending layer's 16-byte origin, then the serialized message.
_MARK = b"\xc1"
_TAG_LENGTH = 1 + 16
# The origin of frames that must be delivered even to the layer that sent them.
_NOBODY = _MARK + bytes(16)


class RespConnection(asyncio.Protocol):
    """A shard's connection to Redis, for publishes or for subscriptions: commands written
    packed, replies parsed by hiredis in `data_received` as the socket delivers them. A reply
    settles the oldest command's future (Redis answers in order); on a subscribing
    connection, what comes with no command waiting is a push, handed to `on_push` there and
    then. A lost connection fails every command still waiting and calls `on_lost`."""

    def __init__(
        self,
        on_push: Callable[[Any], None] | None = None,
        on_lost: Callable[[RespConnection], None] | None = None,
    ) -> None:
        self._reader = hiredis.Reader()
        self._waiting: deque[asyncio.Future[Any]] = deque()
        self._transport: asyncio.Transport | None = None
        self._lost: Exception | None = None
        self._on_push = on_push
        self._on_lost = on_lost

    @classmethod
    async def open(
        cls,
        host: dict[str, Any],
        on_push: Callable[[Any], None] | None = None,
        on_lost: Callable[[RespConnection], None] | None = None,
    ) -> RespConnection:
        """Connected to `host` (channels_redis's form: a URL, redis://, rediss:// or unix://,
        with its options), signed in and on its database."""
        pool = create_pool(host)
        options = pool.connection_kwargs
        loop = asyncio.get_running_loop()
        conn = cls(on_push, on_lost)
        if issubclass(pool.connection_class, UnixDomainSocketConnection):
            await loop.create_unix_connection(lambda: conn, options["path"])
        elif issubclass(pool.connection_class, SSLConnection):
            await loop.create_connection(
                lambda: conn,
                options.get("host", "localhost"),
                options.get("port", 6379),
                # redis-py's own TLS context from the URL's options.
                ssl=pool.make_connection().ssl_context.get(),
            )
        elif pool.connection_class.__name__ == "Connection":
            await loop.create_connection(
                lambda: conn, options.get("host", "localhost"), options.get("port", 6379)
            )
        else:
            raise ValueError(
                f"the channel layer's host {host!r} needs {pool.connection_class.__name__}; "
                "give a redis://, rediss:// or unix:// URL"
            )
        try:
            if options.get("password"):
                credentials = [options["password"]]
                if options.get("username"):
                    credentials.insert(0, options["username"])
                await conn.command("AUTH", *credentials)
            if options.get("db"):
                await conn.command("SELECT", options["db"])
        except BaseException:
            conn.close()
            raise
        return conn

    @property
    def usable(self) -> bool:
        return self._lost is None and self._transport is not None

    def send(self, commands: list[tuple[Any, ...]]) -> list[asyncio.Future[Any]]:
        """Write `commands` at once; a future per command, settled with its reply."""
        self.write(commands)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in commands]
        self._waiting.extend(futures)
        return futures

    def write(self, commands: list[tuple[Any, ...]]) -> None:
        """Write `commands` at once, waiting for no reply (what a subscription's pushes
        answer)."""
        if self._transport is None or self._lost is not None:
            raise ConnectionError(f"the channel layer's Redis connection is closed: {self._lost}")
        self._transport.write(b"".join(hiredis.pack_command(command) for command in commands))

    async def command(self, *args: Any) -> Any:
        return await self.send([args])[0]

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while True:
            reply = self._reader.gets()
            if reply is False:
                return
            if not self._waiting:
                if self._on_push is None:
                    self._fail(ConnectionError("the channel layer's Redis sent a reply unasked"))
                    return
                self._on_push(reply)
                continue
            future = self._waiting.popleft()
            if future.done():
                continue
            if isinstance(reply, hiredis.ReplyError):
                future.set_exception(ConnectionError(f"Redis refused a command: {reply}"))
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError("the channel layer's Redis closed the connection"))

    def _fail(self, exc: Exception) -> None:
        first = self._lost is None
        if first:
            self._lost = exc if isinstance(exc, ConnectionError) else ConnectionError(str(exc))
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(self._lost)  # type: ignore[arg-type]
        self.close()
        if first and self._on_lost is not None:
            self._on_lost(self)


class PipelinedShardConnection(RedisSingleShardConnection):
    def __init__(self, host: Any, channel_layer: Any) -> None:
        super().__init__(host, channel_layer)
        self._outbox: list[tuple[str, bytes, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._publisher: RespConnection | None = None
        self._subscriber: RespConnection | None = None
        self._resubscriber: asyncio.Task[None] | None = None

    async def publish(self, channel: str, message: bytes) -> None:
        loop = asyncio.get_running_loop()
        sent: asyncio.Future[None] = loop.create_future()
        self._outbox.append((channel, message, sent))
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush_outbox(), name="redis-layer-publish")
        await sent

    async def _flush_outbox(self) -> None:
        while self._outbox:
            batch = self._outbox[:MAX_BATCH]
            del self._outbox[:MAX_BATCH]
            try:
                await self._send_batch([(channel, message) for channel, message, _s in batch])
            except Exception as exc:
                for _channel, _message, sent in batch:
                    if not sent.done():
                        sent.set_exception(exc)
                continue
            for _channel, _message, sent in batch:
                if not sent.done():
                    sent.set_result(None)

    async def _send_batch(self, batch: list[tuple[str, bytes]]) -> None:
        """One round trip: every publish of `batch` written at once, then their replies."""
        publisher = self._publisher
        if publisher is None or not publisher.usable:
            publisher = self._publisher = await RespConnection.open(self.host)
        replies = publisher.send([("PUBLISH", channel, message) for channel, message in batch])
        try:
            # Every reply is waited for, so none is left with an error nobody reads.
            outcomes = await asyncio.gather(*replies, return_exceptions=True)
        except BaseException:  # cancelled (shutdown): the replies owed go with the connection
            publisher.close()
            self._publisher = None
            raise
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is not None:
            # A refused publish or a lost connection: replies still owed would be read as the
            # next batch's, so this connection goes and the next batch opens another.
            publisher.close()
            self._publisher = None
            raise failed

    # --- subscriptions ------------------------------------------------------------------

    async def subscribe(self, channel: str) -> None:
        await self.subscribe_many([channel])

    async def subscribe_many(self, channels: Iterable[str]) -> None:
        """One SUBSCRIBE for those of `channels` the shard is not subscribed to yet."""
        async with self._lock:
            new = [c for c in dict.fromkeys(channels) if c not in self._subscribed_to]
            if not new:
                return
            self._subscribed_to.update(new)
            if self._resubscriber is not None and not self._resubscriber.done():
                # A lost connection is opened again on its own schedule, with these channels:
                # not at once, or the frames lost meanwhile might hold no ping (G5).
                return
            try:
                if self._subscriber is None or not self._subscriber.usable:
                    await self._open_subscriber()  # subscribes to every channel, these too
                else:
                    self._subscriber.write([("SUBSCRIBE", *new)])
            except BaseException:
                self._subscribed_to.difference_update(new)
                raise

    async def unsubscribe(self, channel: str) -> None:
        await self.unsubscribe_many([channel])

    async def unsubscribe_many(self, channels: Iterable[str]) -> None:
        async with self._lock:
            gone = [c for c in dict.fromkeys(channels) if c in self._subscribed_to]
            if not gone:
                return
            self._subscribed_to.difference_update(gone)
            if self._subscriber is not None and self._subscriber.usable:
                self._subscriber.write([("UNSUBSCRIBE", *gone)])

    async def _open_subscriber(self) -> None:
        """A new subscribing connection, subscribed to every channel of the shard."""
        subscriber = await RespConnection.open(
            self.host, on_push=self._on_push, on_lost=self._subscriber_lost
        )
        if self._subscribed_to:
            subscriber.write([("SUBSCRIBE", *sorted(self._subscribed_to))])
        self._subscriber = subscriber

    def _subscriber_lost(self, lost: RespConnection) -> None:
        if lost is not self._subscriber:
            return  # closed on purpose (`flush`), or already replaced
        self._subscriber = None
        self.channel_layer.channel_layer.lost()
        if self._subscribed_to and (self._resubscriber is None or self._resubscriber.done()):
            self._resubscriber = asyncio.get_running_loop().create_task(
                self._resubscribe(), name="redis-layer-resubscribe"
            )

    async def _resubscribe(self) -> None:
        """After a lost subscribing connection: a new one, tried once a second. Never at once:
        frames published meanwhile are gone, and the layer watch's pings (four a second) must
        be among them for it to see the outage and close the sockets (G5)."""
        while True:
            await asyncio.sleep(RESUBSCRIBE_SECONDS)
            async with self._lock:
                if not self._subscribed_to or (
                    self._subscriber is not None and self._subscriber.usable
                ):
                    return
                try:
                    await self._open_subscriber()
                except Exception as exc:
                    logger.warning("the channel layer cannot subscribe again yet: %s", exc)
                    continue
            logger.info("the channel layer subscribed again after its connection was lost")
            self.channel_layer.channel_layer.lost()  # what was heard meanwhile is unknown
            return

    def _on_push(self, push: Any) -> None:
        """A push on the subscribing connection, in its protocol's callback: a message is put
        in its channel's queue, or in those of its group's members here, there and then."""
        if not (isinstance(push, list) and len(push) == 3 and push[0] == b"message"):
            return  # a (un)subscription's confirmation
        name, data = push[1].decode(), push[2]
        if data[:1] == _MARK:
            if data[:_TAG_LENGTH] == self.channel_layer.origin:
                return  # sent by this layer, which delivered it to its own consumers then
            data = data[_TAG_LENGTH:]
        layer = self.channel_layer
        queue = layer.channels.get(name)
        if queue is not None:
            queue.put_nowait(data)
            return
        if name.startswith(layer.group_prefix):
            layer.channel_layer.heard(name[len(layer.group_prefix) :])
        for member in layer.groups.get(name, ()):
            queue = layer.channels.get(member)
            if queue is not None:
                queue.put_nowait(data)

    async def flush(self) -> None:
        if self._resubscriber is not None:
            self._resubscriber.cancel()
            self._resubscriber = None
        for conn in (self._publisher, self._subscriber):
            if conn is not None:
                conn.close()
        self._publisher = self._subscriber = None
        await super().flush()


class PipelinedLoopLayer(RedisPubSubLoopLayer):
    def __init__(self, hosts: Any = None, **kwargs: Any) -> None:
        super().__init__(hosts, **kwargs)
        self._shards = [PipelinedShardConnection(host, self) for host in decode_hosts(hosts)]
        # Per loop layer, not per process: another loop's layer of this process has its own
        # consumers, which hear this one's frames through Redis.
        self.origin = _MARK + uuid.uuid4().bytes
        self.group_prefix = self._get_group_channel_name("")

    async def _subscribe_to_channel(self, channel: str) -> None:
        """channels_redis's, with the channel's frames waiting in an `Inbox`: an asyncio
        queue per open socket cost it 3 KiB (issue 57)."""
        self.channels[channel] = Inbox(0)
        await self._get_shard(channel).subscribe(channel)

    async def group_add_many(self, groups: Iterable[str], channel: str) -> None:
        """`group_add` of each group: one SUBSCRIBE per shard for those not followed yet."""
        if channel not in self.channels:
            raise RuntimeError("group_add_many() needs a channel of this process")
        by_shard: defaultdict[Any, list[str]] = defaultdict(list)
        for group in groups:
            name = self._get_group_channel_name(group)
            self.groups.setdefault(name, set()).add(channel)
            by_shard[self._get_shard(name)].append(name)
        for shard, names in by_shard.items():
            await shard.subscribe_many(names)

    async def group_discard_many(self, groups: Iterable[str], channel: str) -> None:
        """`group_discard` of each group: one UNSUBSCRIBE per shard for those left empty."""
        by_shard: defaultdict[Any, list[str]] = defaultdict(list)
        for group in groups:
            name = self._get_group_channel_name(group)
            members = self.groups.get(name)
            if members is None or channel not in members:
                continue
            members.discard(channel)
            if not members:
                del self.groups[name]
                by_shard[self._get_shard(name)].append(name)
        for shard, names in by_shard.items():
            await shard.unsubscribe_many(names)

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        data = self.channel_layer.serialize(message)
        queue = self.channels.get(channel)
        if queue is not None:
            queue.put_nowait(data)
            return
        await self._get_shard(channel).publish(channel, self.origin + data)

    async def send_by_server(self, channel: str, message: dict[str, Any]) -> None:
        """`send` through Redis even to a channel of this layer (the layer watch's ping)."""
        data = self.channel_layer.serialize(message)
        await self._get_shard(channel).publish(channel, _NOBODY + data)

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        group_channel = self._get_group_channel_name(group)
        data = self.channel_layer.serialize(message)
        self.channel_layer.heard(group)
        for name in self.groups.get(group_channel, ()):
            queue = self.channels.get(name)
            if queue is not None:
                queue.put_nowait(data)
        await self._get_shard(group_channel).publish(group_channel, self.origin + data)


class RedisPubSubLayer(RedisPubSubChannelLayer):
    """`RedisPubSubChannelLayer` whose per-loop layers pipeline their publishes and deliver
    their own consumers' frames directly."""

    # Told of every group message (`add_group_listener`).
    listeners: tuple[GroupListener, ...] = ()

    async def send_by_server(self, channel: str, message: dict[str, Any]) -> None:
        await self._get_layer().send_by_server(channel, message)

    async def group_add_many(self, groups: Iterable[str], channel: str) -> None:
        await self._get_layer().group_add_many(groups, channel)

    async def group_discard_many(self, groups: Iterable[str], channel: str) -> None:
        await self._get_layer().group_discard_many(groups, channel)

    def add_group_listener(self, listener: GroupListener) -> None:
        self.listeners = (*self.listeners, listener)

    def heard(self, group: str) -> None:
        for listener in self.listeners:
            listener.heard(group)

    def lost(self) -> None:
        for listener in self.listeners:
            listener.lost()

    def _get_layer(self) -> PipelinedLoopLayer:
        loop = asyncio.get_running_loop()
        try:
            return self._layers[loop]
        except KeyError:
            layer = PipelinedLoopLayer(*self._args, **self._kwargs, channel_layer=self)
            self._layers[loop] = layer
            _wrap_close(self, loop)
            return layer
