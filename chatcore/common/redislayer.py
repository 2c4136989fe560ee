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

Delivery is unchanged: Redis pub/sub, at most once; a frame lost with a connection is the
layer watch's business (`engine/layerwatch.py`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from channels_redis.pubsub import (
    RedisPubSubChannelLayer,
    RedisPubSubLoopLayer,
    RedisSingleShardConnection,
)
from channels_redis.utils import _wrap_close, decode_hosts

# Publishes sent in one pipeline at most (a larger outbox goes in several, in order).
MAX_BATCH = 256


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


class PipelinedLoopLayer(RedisPubSubLoopLayer):
    def __init__(self, hosts: Any = None, **kwargs: Any) -> None:
        super().__init__(hosts, **kwargs)
        self._shards = [PipelinedShardConnection(host, self) for host in decode_hosts(hosts)]


class RedisPubSubLayer(RedisPubSubChannelLayer):
    """`RedisPubSubChannelLayer` whose per-loop layers pipeline their publishes."""

    def _get_layer(self) -> PipelinedLoopLayer:
        loop = asyncio.get_running_loop()
        try:
            return self._layers[loop]
        except KeyError:
            layer = PipelinedLoopLayer(*self._args, **self._kwargs, channel_layer=self)
            self._layers[loop] = layer
            _wrap_close(self, loop)
            return layer
