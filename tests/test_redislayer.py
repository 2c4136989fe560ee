"""The scaled mode's channel layer (issue 10 items 3 and 4): channels_redis's pub/sub layer
with its publishes pipelined on a connection of their own. A real Redis: many publishes at
once go in a few round trips, in the order they were made, each to its subscribers; one whose
caller gave up still goes; a connection lost under a batch fails its callers, and the next
publish goes on a new one."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

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
    real_send = PipelinedShardConnection._send_batch

    async def send_batch(self: PipelinedShardConnection, batch: list[tuple[str, bytes]]) -> None:
        trips.append(len(batch))
        await real_send(self, batch)

    monkeypatch.setattr(PipelinedShardConnection, "_send_batch", send_batch)
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


async def test_every_caller_of_a_batch_whose_connection_is_lost_gets_the_error(
    redis_url: str,
) -> None:
    # covers: G5 (a publish that did not go out says so; `publish.apublish` logs and counts
    # it), A4 (the next publish goes on a new connection)
    layer, receiver = _layers(redis_url)
    admin = aioredis.Redis.from_url(redis_url)
    try:
        channel = await receiver.new_channel()
        await receiver.group_add("sess.lost", channel)
        await layer.group_send("sess.lost", {"type": "x", "n": 0})
        assert (await asyncio.wait_for(receiver.receive(channel), 5))["n"] == 0
        shard = layer._get_layer()._shards[0]
        assert isinstance(shard, PipelinedShardConnection) and shard._publisher is not None
        publisher_id = await shard._publisher.command("CLIENT", "ID")
        # Redis holds the batch unanswered; its connection is then ended under it.
        await admin.execute_command("CLIENT", "PAUSE", 5000, "WRITE")
        try:
            sends = [
                asyncio.ensure_future(layer.group_send("sess.lost", {"type": "x", "n": i}))
                for i in range(1, 6)
            ]
            await asyncio.sleep(0.2)
            assert not any(send.done() for send in sends)
            await admin.execute_command("CLIENT", "KILL", "ID", publisher_id)
            results = await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), 5)
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
        assert all(isinstance(r, ConnectionError) for r in results), results
        await layer.group_send("sess.lost", {"type": "x", "n": 6})
        assert (await asyncio.wait_for(receiver.receive(channel), 5))["n"] == 6
        assert await shard._publisher.command("CLIENT", "ID") != publisher_id
    finally:
        await admin.aclose()
        await layer.flush()
        await receiver.flush()


async def test_a_lost_subscription_comes_back_a_second_later_with_every_channel(
    redis_url: str,
) -> None:
    # covers: G5 (frames published while the subscription is down are lost, the layer watch's
    # pings among them: a socket that joins meanwhile does not bring the subscription back
    # early; then every channel and group of the process hears again, the new one too)
    from chatcore.common.redislayer import RESUBSCRIBE_SECONDS

    sender, receiver = _layers(redis_url)
    admin = aioredis.Redis.from_url(redis_url)
    try:
        mine = await receiver.new_channel()
        grouped = await receiver.new_channel()
        await receiver.group_add("sess.back", grouped)
        await sender.send(mine, {"type": "x", "n": 0})
        assert (await asyncio.wait_for(receiver.receive(mine), 5))["n"] == 0
        shard = receiver._get_layer()._shards[0]
        assert isinstance(shard, PipelinedShardConnection) and shard._subscriber is not None
        lost = shard._subscriber
        host, port = lost._transport.get_extra_info("sockname")[:2]  # type: ignore[union-attr]
        await admin.execute_command("CLIENT", "KILL", "ADDR", f"{host}:{port}")
        for _ in range(50):
            if not lost.usable:
                break
            await asyncio.sleep(0.01)
        assert not lost.usable
        await sender.send(mine, {"type": "x", "n": 1})  # nobody hears it: lost
        joined = await receiver.new_channel()  # a socket connecting during the outage
        assert shard._subscriber is None
        await asyncio.sleep(RESUBSCRIBE_SECONDS + 0.5)
        assert shard._subscriber is not None and shard._subscriber is not lost
        await sender.send(mine, {"type": "x", "n": 2})
        await sender.group_send("sess.back", {"type": "x", "n": 3})
        await sender.send(joined, {"type": "x", "n": 4})
        assert (await asyncio.wait_for(receiver.receive(mine), 5))["n"] == 2
        assert (await asyncio.wait_for(receiver.receive(grouped), 5))["n"] == 3
        assert (await asyncio.wait_for(receiver.receive(joined), 5))["n"] == 4
    finally:
        await admin.aclose()
        await sender.flush()
        await receiver.flush()


async def test_a_publish_the_server_refuses_says_why_and_the_layer_goes_on(
    redis_url: str,
) -> None:
    # covers: G5 (a layer that cannot sign in fails its publishes with Redis's reason, the
    # same as one whose connection is lost; nothing is half sent)
    address, _, database = redis_url.rpartition("/")
    wrong = RedisPubSubLayer(
        hosts=[f"{address.replace('redis://', 'redis://:not-the-password@')}/{database}"],
        prefix=f"rl{uuid.uuid4().hex[:8]}",
    )
    try:
        with pytest.raises(ConnectionError, match="AUTH"):
            await wrong.group_send("sess.refused", {"type": "x"})
        with pytest.raises(ConnectionError, match="AUTH"):
            await wrong.group_send("sess.refused", {"type": "x"})
    finally:
        await wrong.flush()


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
        real_send = PipelinedShardConnection._send_batch

        async def send_batch(
            self: PipelinedShardConnection, batch: list[tuple[str, bytes]]
        ) -> None:
            await held.wait()  # Redis is slow: nothing published is back yet
            await real_send(self, batch)

        monkeypatch.setattr(PipelinedShardConnection, "_send_batch", send_batch)
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


async def test_a_socket_joins_its_groups_in_one_command_and_listeners_hear_them(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: D3, G1 (issue 57: a socket's groups joined in one go, its frames waiting in an
    # inbox; the process's caches hear every group message, sent here or by another process)
    from chatcore.common.memlayer import Inbox

    sender, receiver = _layers(redis_url)
    heard: list[str] = []

    class Listener:
        def heard(self, group: str) -> None:
            heard.append(group)

        def lost(self) -> None:
            heard.append("LOST")

    receiver.add_group_listener(Listener())
    commands: list[tuple[str, ...]] = []
    real_subscribe = PipelinedShardConnection.subscribe_many

    async def subscribe_many(self: PipelinedShardConnection, channels: list[str]) -> None:
        commands.append(tuple(channels))
        await real_subscribe(self, channels)

    monkeypatch.setattr(PipelinedShardConnection, "subscribe_many", subscribe_many)
    try:
        channel = await receiver.new_channel()
        # Its frames wait in an inbox (channels_redis's `_subscribe_to_channel`, overridden).
        assert isinstance(receiver._get_layer().channels[channel], Inbox)
        await receiver.group_add_many(["g.one", "g.two", "g.three"], channel)
        assert len(commands) == 2 and len(commands[1]) == 3  # the channel, then the groups
        await asyncio.sleep(0.2)  # subscribed on the server
        await sender.group_send("g.two", {"type": "chat.event", "n": 1})
        assert (await asyncio.wait_for(receiver.receive(channel), 5))["n"] == 1
        assert heard == ["g.two"]
        await receiver.group_send("g.one", {"type": "chat.event", "n": 2})  # sent here
        assert (await asyncio.wait_for(receiver.receive(channel), 5))["n"] == 2
        assert heard == ["g.two", "g.one"]
        await receiver.group_discard_many(["g.one", "g.two", "g.three"], channel)
        assert not receiver._get_layer().groups
    finally:
        await sender.flush()
        await receiver.flush()
