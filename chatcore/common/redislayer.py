"""The scaled mode's channel layer: channels_redis's pub/sub layer, its publishes pipelined.

`channels_redis.pubsub` sends every publish of a process through one connection per Redis
shard, one at a time under a lock: each waits for the previous one's round trip, and each
round trip for the event loop to read the reply. With a hundred answers streaming (twenty
snapshot frames a second each, plus history deltas and terminals) the publishes queued up
behind that lock: first tokens waited for the queue, and a publish still queued at a turn's
end risked its cancellation. Here a publish joins an outbox; a flusher sends all that waits
in one pipeline (one round trip), then the next batch. Order is kept (the outbox is sent in
the order it was filled, batch after batch), each publish's caller still waits for its own
to be sent and gets its own error, and a publish is on its way the moment it is made: a
caller cancelled meanwhile does not take it back. Subscriptions keep the shard's lock, which
a batch takes once.

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
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from channels_redis.pubsub import (
    RedisPubSubChannelLayer,
    RedisPubSubLoopLayer,
    RedisSingleShardConnection,
)
from channels_redis.utils import _wrap_close, decode_hosts

# Publishes sent in one pipeline at most (a larger outbox goes in several, in order).
MAX_BATCH = 256

# A tagged frame: this marker (0xc1, a byte msgpack never uses; the serializer's encrypted
# form is base64 text), the sending layer's 16-byte origin, then the serialized message.
_MARK = b"\xc1"
_TAG_LENGTH = 1 + 16
# The origin of frames that must be delivered even to the layer that sent them.
_NOBODY = _MARK + bytes(16)


class PipelinedShardConnection(RedisSingleShardConnection):
    def __init__(self, host: Any, channel_layer: Any) -> None:
        super().__init__(host, channel_layer)
        self._outbox: list[tuple[str, bytes, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None

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
                async with self._lock:
                    self._ensure_redis()
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for channel, message, _sent in batch:
                            pipe.publish(channel, message)
                        await pipe.execute()
            except Exception as exc:
                for _channel, _message, sent in batch:
                    if not sent.done():
                        sent.set_exception(exc)
                continue
            for _channel, _message, sent in batch:
                if not sent.done():
                    sent.set_result(None)

    def _receive_message(self, message: Any) -> None:
        if message is None:
            return
        data = message["data"]
        if isinstance(data, bytes) and data[:1] == _MARK:
            if data[:_TAG_LENGTH] == self.channel_layer.origin:
                return  # sent by this layer, which delivered it to its own consumers then
            message["data"] = data[_TAG_LENGTH:]
        super()._receive_message(message)


class PipelinedLoopLayer(RedisPubSubLoopLayer):
    def __init__(self, hosts: Any = None, **kwargs: Any) -> None:
        super().__init__(hosts, **kwargs)
        self._shards = [PipelinedShardConnection(host, self) for host in decode_hosts(hosts)]
        # Per loop layer, not per process: another loop's layer of this process has its own
        # consumers, which hear this one's frames through Redis.
        self.origin = _MARK + uuid.uuid4().bytes

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
        for name in self.groups.get(group_channel, ()):
            queue = self.channels.get(name)
            if queue is not None:
                queue.put_nowait(data)
        await self._get_shard(group_channel).publish(group_channel, self.origin + data)


class RedisPubSubLayer(RedisPubSubChannelLayer):
    """`RedisPubSubChannelLayer` whose per-loop layers pipeline their publishes and deliver
    their own consumers' frames directly."""

    async def send_by_server(self, channel: str, message: dict[str, Any]) -> None:
        await self._get_layer().send_by_server(channel, message)

    def _get_layer(self) -> PipelinedLoopLayer:
        loop = asyncio.get_running_loop()
        try:
            return self._layers[loop]
        except KeyError:
            layer = PipelinedLoopLayer(*self._args, **self._kwargs, channel_layer=self)
            self._layers[loop] = layer
            _wrap_close(self, loop)
            return layer
