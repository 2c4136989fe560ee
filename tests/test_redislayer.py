"""The scaled mode's channel layer (issue 10 items 3 and 4): channels_redis's pub/sub layer
with its publishes pipelined. A real Redis: many publishes at once go in a few round trips,
in the order they were made, each to its subscribers; one whose caller gave up still goes."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio.client import Pipeline

from chatcore.common.redislayer import PipelinedShardConnection, RedisPubSubLayer

pytestmark = [pytest.mark.redis]


def _layers(redis_url: str) -> tuple[RedisPubSubLayer, RedisPubSubLayer]:
    """A sending and a receiving layer, as two processes have (a prefix of this test's)."""
    prefix = f"rl{uuid.uuid4().hex[:8]}"
    return (
        RedisPubSubLayer(hosts=[redis_url], prefix=prefix),
        RedisPubSubLayer(hosts=[redis_url], prefix=prefix),
    )


async def test_a_burst_of_publishes_goes_in_a_few_round_trips_and_in_order(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: D1, D2, G6 (frames of one process reach a subscriber in the order sent)
    sender, receiver = _layers(redis_url)
    trips: list[int] = []
    real_execute = Pipeline.execute

    async def execute(self: Pipeline, *args: object, **kwargs: object) -> object:
        trips.append(len(self.command_stack))
        return await real_execute(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "execute", execute)
    try:
        channel = await receiver.new_channel()
        await receiver.group_add("sess.burst", channel)
        await asyncio.gather(
            *(sender.group_send("sess.burst", {"type": "chat.event", "n": i}) for i in range(200))
        )
        got = [(await asyncio.wait_for(receiver.receive(channel), 5))["n"] for _ in range(200)]
        assert got == list(range(200))
        assert sum(trips) == 200
        assert len(trips) < 20  # the publishes made while one trip was out went together
    finally:
        await sender.flush()
        await receiver.flush()


async def test_a_publish_whose_caller_gave_up_is_still_sent(redis_url: str) -> None:
    # covers: D1 (a turn's last snapshot, its publish cancelled at the turn's end, still
    # reaches the clients: it was on its way the moment it was made)
    sender, receiver = _layers(redis_url)
    try:
        channel = await receiver.new_channel()
        await receiver.group_add("sess.gaveup", channel)
        first = asyncio.ensure_future(sender.group_send("sess.gaveup", {"type": "x", "n": 1}))
        second = asyncio.ensure_future(sender.group_send("sess.gaveup", {"type": "x", "n": 2}))
        await asyncio.sleep(0)  # both are in the outbox
        second.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        got = [(await asyncio.wait_for(receiver.receive(channel), 5))["n"] for _ in range(2)]
        assert got == [1, 2]
    finally:
        await sender.flush()
        await receiver.flush()


async def test_every_caller_of_a_failed_batch_gets_the_error(redis_url: str) -> None:
    # covers: G5 (a publish that did not go out says so; `publish.apublish` logs and counts it)
    layer, _other = _layers(redis_url)
    try:
        await layer.group_send("sess.fail", {"type": "warm-up"})
        shard = layer._get_layer()._shards[0]
        assert isinstance(shard, PipelinedShardConnection)

        shard._redis.pipeline = lambda **kwargs: _Broken()  # type: ignore[method-assign]
        results = await asyncio.gather(
            *(layer.group_send("sess.fail", {"type": "x", "n": i}) for i in range(5)),
            return_exceptions=True,
        )
        assert all(isinstance(r, ConnectionError) for r in results)
    finally:
        await layer.flush()


async def test_frames_for_this_layers_consumers_do_not_go_round_through_redis(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: D1, D2, G6 (a process's own clients get its frames without Redis's round trip,
    # once each and in order; the other process gets them through Redis, once each)
    here, there = _layers(redis_url)
    try:
        mine = await here.new_channel()
        theirs = await there.new_channel()
        await here.group_add("sess.local", mine)
        await there.group_add("sess.local", theirs)
        await here.group_send("sess.local", {"type": "x", "n": 0})  # both subscribed
        assert (await asyncio.wait_for(there.receive(theirs), 5))["n"] == 0
        assert (await here.receive(mine))["n"] == 0

        held = asyncio.Event()
        real_execute = Pipeline.execute

        async def execute(self: Pipeline, *args: object, **kwargs: object) -> object:
            await held.wait()  # Redis is slow: nothing published is back yet
            return await real_execute(self, *args, **kwargs)

        monkeypatch.setattr(Pipeline, "execute", execute)
        sends = [
            asyncio.ensure_future(here.group_send("sess.local", {"type": "x", "n": n}))
            for n in (1, 2)
        ]
        direct = asyncio.ensure_future(here.send(mine, {"type": "x", "n": 3}))
        got = [(await asyncio.wait_for(here.receive(mine), 1))["n"] for _ in range(3)]
        assert got == [1, 2, 3]
        held.set()
        await asyncio.gather(*sends, direct)
        got = [(await asyncio.wait_for(there.receive(theirs), 5))["n"] for _ in range(2)]
        assert got == [1, 2]
        # The frames' way back from Redis to the layer that sent them is not a second copy.
        await here.group_send("sess.local", {"type": "x", "n": 4})
        assert (await asyncio.wait_for(there.receive(theirs), 5))["n"] == 4
        assert (await here.receive(mine))["n"] == 4
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(here.receive(mine), 0.3)
    finally:
        await here.flush()
        await there.flush()


async def test_the_watchs_ping_crosses_redis_and_older_layers_frames_arrive(
    redis_url: str,
) -> None:
    # covers: G5 (the layer watch's ping to its own channel still tests Redis's delivery);
    # a frame of a layer without origin tags (a rolling deploy) is delivered as it is
    from channels_redis.pubsub import RedisPubSubChannelLayer

    layer, _other = _layers(redis_url)
    older = RedisPubSubChannelLayer(hosts=[redis_url], prefix=layer._kwargs["prefix"])
    try:
        channel = await layer.new_channel()
        await layer.group_add("sess.mixed", channel)
        shard = layer._get_layer()._shards[0]
        published: list[str] = []
        real_publish = shard.publish

        async def publish(name: str, message: bytes) -> None:
            published.append(name)
            await real_publish(name, message)

        shard.publish = publish  # type: ignore[method-assign]
        await layer.send_by_server(channel, {"type": "watch.ping", "seq": 1})
        assert (await asyncio.wait_for(layer.receive(channel), 5))["seq"] == 1
        assert published == [channel]
        await older.group_send("sess.mixed", {"type": "x", "n": 7})
        assert (await asyncio.wait_for(layer.receive(channel), 5))["n"] == 7
    finally:
        await layer.flush()
        await older.flush()


class _Broken:
    """A pipeline whose server is gone."""

    async def __aenter__(self) -> _Broken:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def publish(self, channel: str, message: bytes) -> None:
        pass

    async def execute(self) -> None:
        raise ConnectionError("redis went away")


@pytest.mark.django_db
def test_the_health_page_reports_the_scaled_layer(redis_url: str, client) -> None:
    # covers: F4 (the page's frame counts never touch the pub/sub layer's per-loop state)
    from channels.layers import channel_layers
    from django.test import override_settings

    layers = {
        "default": {
            "BACKEND": "chatcore.common.redislayer.RedisPubSubLayer",
            "CONFIG": {"hosts": [redis_url], "prefix": f"hz{uuid.uuid4().hex[:8]}"},
        }
    }
    with override_settings(CHANNEL_LAYERS=layers):
        channel_layers.backends.clear()
        try:
            response = client.get("/healthz")
        finally:
            channel_layers.backends.clear()
    assert response.status_code == 200
    layer = response.json()["channel_layer"]
    assert layer["ok"] and layer["backend"] == "RedisPubSubLayer"
    assert layer["dropped"] == 0 and layer["failed_publishes"] >= 0
