"""The scaled mode's channel layer (`chatcore.common.redislayer`; SPEC D1, D2, G5, G6, I1-I3):
channels_redis's pub/sub layer with a process's publishes batched on redis-py's pipeline and
its own consumers' frames delivered directly. A real Redis (and, for its failures, a server
that accepts and never answers): a burst goes in a few round trips and in order; a publish
whose caller gave up still goes; a lost connection or a silent server fails the batch's
callers within the timeout, and the next publish goes on a new connection; the outbox and each
consumer's queue are bounded; a lost subscription comes back with every channel.

Measured against channels_redis 4.3.0 and redis-py 8.2.0 (the layer uses their public API:
the pub/sub layer's methods, the pipeline; a group's Redis channel name is channels_redis's,
which the cross-process tests here pin)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from channels.exceptions import ChannelFull
from redis.asyncio.client import Pipeline

from chatcore.common import redislayer
from chatcore.common.redislayer import Inbox, RedisPubSubLayer

pytestmark = [pytest.mark.redis]


def _layers(host: str | dict[str, Any], **kwargs: Any) -> tuple[RedisPubSubLayer, ...]:
    """A sending and a receiving layer, as two processes have (a prefix of this test's)."""
    prefix = f"rl{uuid.uuid4().hex[:8]}"
    return (
        RedisPubSubLayer(hosts=[host], prefix=prefix, **kwargs),
        RedisPubSubLayer(hosts=[host], prefix=prefix, **kwargs),
    )


async def _flushed(*layers: RedisPubSubLayer) -> None:
    for layer in layers:
        await layer.flush()


async def test_a_burst_of_publishes_goes_in_a_few_round_trips_and_in_order(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: D1, D2, G6 (frames of one process reach a subscriber in the order sent; the
    # publishes made while one round trip is out go together in the next)
    sender, receiver = _layers(redis_url)
    trips: list[int] = []
    real_execute = Pipeline.execute

    async def execute(self: Pipeline, raise_on_error: bool = True) -> list[Any]:
        trips.append(len(self.command_stack))
        return await real_execute(self, raise_on_error)

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
        assert len(trips) < 20
    finally:
        await _flushed(sender, receiver)


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
        await _flushed(sender, receiver)


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
        publisher = layer._publisher()
        publisher_id = await publisher._client.client_id()  # its one pooled connection
        # Redis holds the batch unanswered; its connection is then ended under it.
        await admin.execute_command("CLIENT", "PAUSE", 5000, "WRITE")
        try:
            sends = [
                asyncio.ensure_future(layer.group_send("sess.lost", {"type": "x", "n": i}))
                for i in range(1, 6)
            ]
            await asyncio.sleep(0.2)
            assert not any(send.done() for send in sends)
            await admin.client_kill_filter(_id=publisher_id)
            results = await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), 5)
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
        assert all(isinstance(r, aioredis.ConnectionError) for r in results), results
        await layer.group_send("sess.lost", {"type": "x", "n": 6})
        assert (await asyncio.wait_for(receiver.receive(channel), 5))["n"] == 6
        assert await publisher._client.client_id() != publisher_id
    finally:
        await admin.aclose()
        await _flushed(layer, receiver)


@pytest.fixture
async def silent_server() -> AsyncIterator[str]:
    """A server that accepts connections, reads what it is sent and never answers: a Redis
    stalled without closing its connections (a host gone, a half-open socket)."""
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_redis_that_never_answers_fails_publishes_within_the_timeout(
    silent_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: I3 (a stalled Redis fails its publishers within the host's reply timeout,
    # instead of holding every publisher of the process; past the outbox's bound a publish
    # fails at once rather than wait)
    host = {"address": silent_server, "socket_timeout": 0.3, "socket_connect_timeout": 0.3}
    (layer,) = _layers(host)[:1]
    monkeypatch.setattr(redislayer, "OUTBOX_MAX", 3)
    try:
        started = time.monotonic()
        with pytest.raises(aioredis.RedisError):
            await layer.group_send("sess.silent", {"type": "x"})
        assert time.monotonic() - started < 2.0
        waiting = [
            asyncio.ensure_future(layer.group_send("sess.silent", {"type": "x", "n": n}))
            for n in range(3)
        ]
        await asyncio.sleep(0)
        with pytest.raises(ChannelFull):
            await layer.group_send("sess.silent", {"type": "x", "n": 3})
        results = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 5)
        assert all(isinstance(r, aioredis.RedisError) for r in results), results
    finally:
        await layer.flush()


async def test_a_lost_subscription_comes_back_with_every_channel(redis_url: str) -> None:
    # covers: G5 (frames published while the subscription is down are lost, and every
    # channel and group of the process hears again once it is back: channels_redis's
    # receiving task opens it again and subscribes to all it had)
    name = f"rl{uuid.uuid4().hex[:8]}"
    sender, receiver = _layers({"address": redis_url, "client_name": name})
    admin = aioredis.Redis.from_url(redis_url)
    try:
        mine = await receiver.new_channel()
        grouped = await receiver.new_channel()
        await receiver.group_add("sess.back", grouped)
        await sender.send(mine, {"type": "x", "n": 0})
        assert (await asyncio.wait_for(receiver.receive(mine), 5))["n"] == 0
        subscribed = [
            c for c in await admin.client_list() if c["name"] == name and int(c["sub"]) > 0
        ]
        assert len(subscribed) == 1
        await admin.client_kill_filter(_id=subscribed[0]["id"])
        # One receive stays open: a cancelled one drops the channel's subscription.
        received = asyncio.ensure_future(receiver.receive(mine))
        deadline = time.monotonic() + 10
        while not received.done():
            assert time.monotonic() < deadline, "the subscription never came back"
            await sender.send(mine, {"type": "x", "n": 2})
            await asyncio.wait([received], timeout=0.2)
        assert received.result()["n"] == 2
        await sender.group_send("sess.back", {"type": "x", "n": 3})
        assert (await asyncio.wait_for(receiver.receive(grouped), 5))["n"] == 3
    finally:
        await admin.aclose()
        await _flushed(sender, receiver)


async def test_a_publish_the_server_refuses_says_why_and_the_layer_goes_on(
    redis_url: str,
) -> None:
    # covers: G5 (a layer whose Redis refuses its connection's setup fails its publishes with
    # Redis's reason, the same as one whose connection is lost; nothing is half sent)
    address = redis_url.rpartition("/")[0]
    (wrong,) = _layers(f"{address}/99999")[:1]  # no such database
    try:
        for _ in range(2):
            with pytest.raises(aioredis.ResponseError, match="DB index"):
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
        assert isinstance(here.channels[mine], Inbox)
        await here.group_add("sess.local", mine)
        await there.group_add("sess.local", theirs)
        await here.group_send("sess.local", {"type": "x", "n": 0})  # both subscribed
        assert (await asyncio.wait_for(there.receive(theirs), 5))["n"] == 0
        assert (await here.receive(mine))["n"] == 0

        held = asyncio.Event()
        real_execute = Pipeline.execute

        async def execute(self: Pipeline, raise_on_error: bool = True) -> list[Any]:
            await held.wait()  # Redis is slow: nothing published is back yet
            return await real_execute(self, raise_on_error)

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
        await _flushed(here, there)


async def test_the_watchs_ping_crosses_redis_and_older_layers_frames_arrive(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: G5 (the layer watch's ping to its own channel still tests Redis's delivery);
    # a frame of a layer without origin tags (a rolling deploy) is delivered as it is
    from channels_redis.pubsub import RedisPubSubChannelLayer

    layer, _other = _layers(redis_url)
    older = RedisPubSubChannelLayer(hosts=[redis_url], prefix=layer.prefix)
    published: list[str] = []
    real_publish = Pipeline.publish

    def publish(self: Pipeline, channel: str, message: bytes) -> Any:
        published.append(channel)
        return real_publish(self, channel, message)

    monkeypatch.setattr(Pipeline, "publish", publish)
    try:
        channel = await layer.new_channel()
        await layer.group_add("sess.mixed", channel)
        await layer.send_by_server(channel, {"type": "watch.ping", "seq": 1})
        assert (await asyncio.wait_for(layer.receive(channel), 5))["seq"] == 1
        assert published == [channel]
        await older.group_send("sess.mixed", {"type": "x", "n": 7})
        assert (await asyncio.wait_for(layer.receive(channel), 5))["n"] == 7
    finally:
        await _flushed(layer, _other)
        await older.flush()


async def test_a_consumer_that_stops_reading_holds_a_bounded_queue(redis_url: str) -> None:
    # covers: I3, D1 (a consumer's queue holds `capacity` frames; the next are dropped and
    # counted, and a send to it is refused, while other consumers get every frame)
    here, there = _layers(redis_url)
    here.capacity = 3
    try:
        stalled = await here.new_channel()
        reading = await there.new_channel()
        for layer, channel in ((here, stalled), (there, reading)):
            await layer.group_add("sess.full", channel)
        for n in range(5):
            await here.group_send("sess.full", {"type": "x", "n": n})
        got = [(await asyncio.wait_for(there.receive(reading), 5))["n"] for _ in range(5)]
        assert got == list(range(5))
        assert here.dropped == 2
        with pytest.raises(ChannelFull):
            await here.send(stalled, {"type": "x", "n": 5})
        assert [(await here.receive(stalled))["n"] for _ in range(3)] == [0, 1, 2]
    finally:
        await _flushed(here, there)


def test_one_host_is_taken() -> None:
    # covers: I2 (publishes are not sharded: more hosts than one are refused, not ignored)
    with pytest.raises(ValueError, match="one Redis host"):
        RedisPubSubLayer(hosts=["redis://127.0.0.1:6379/0", "redis://127.0.0.1:6380/0"])
    with pytest.raises(ValueError, match="one Redis host"):
        RedisPubSubLayer(hosts=[{"host": "127.0.0.1", "port": 6379}])


@pytest.mark.django_db
def test_the_health_page_reports_the_scaled_layer(redis_url: str, client: Any) -> None:
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


async def test_a_sockets_frames_wait_in_a_light_inbox_whose_listeners_hear_them(
    redis_url: str,
) -> None:
    # covers: D3, G1 (issue 57: an idle socket's queue is the embedded layer's light inbox;
    # the process's caches hear of every frame a socket's queue takes, sent here or by
    # another process, as it arrives)
    from chatcore.common import memlayer

    sender, receiver = _layers(redis_url)
    heard: list[str] = []

    class Listener:
        def heard(self, group: str) -> None:
            raise AssertionError("the Redis layer tells of frames by the channel taking them")

        def heard_on(self, channel: str) -> None:
            heard.append(channel)

        def lost(self) -> None:
            heard.append("LOST")

    receiver.add_group_listener(Listener())
    try:
        channel = await receiver.new_channel()
        inbox = receiver.channels[channel]
        assert isinstance(inbox, memlayer.Inbox) and inbox.items is None
        await receiver.group_add("g.one", channel)
        await asyncio.sleep(0.2)  # subscribed on the server
        await sender.group_send("g.one", {"type": "chat.event", "n": 1})  # another process
        assert (await asyncio.wait_for(receiver.receive(channel), 5))["n"] == 1
        assert heard == [channel]
        await receiver.group_send("g.one", {"type": "chat.event", "n": 2})  # this one
        assert (await asyncio.wait_for(receiver.receive(channel), 5))["n"] == 2
        await asyncio.sleep(0.2)  # its echo through Redis is dropped, not heard again
        assert heard == [channel, channel] and inbox.empty()
    finally:
        await sender.flush()
        await receiver.flush()


async def test_a_processs_channels_share_one_subscription_and_any_process_reaches_them(
    redis_url: str,
) -> None:
    # covers: D1, G5, I2 (issue 57: a storm of sockets subscribes nothing per socket; one
    # pattern per process covers their channels, which another process, a stock
    # channels_redis layer among them, still reaches by name; after a flush the next channel
    # subscribes again). Pins the channels_redis 4.3.0 shard internals `new_channel` uses.
    from channels_redis.pubsub import RedisPubSubChannelLayer, RedisSingleShardConnection

    for name in ("_lock", "_pubsub", "_ensure_redis", "_ensure_receiver", "_receive_message"):
        assert hasattr(RedisSingleShardConnection(redis_url, None), name), name
    name = f"rl{uuid.uuid4().hex[:8]}"
    sender, receiver = _layers({"address": redis_url, "client_name": name})
    stock = RedisPubSubChannelLayer(hosts=[redis_url], prefix=receiver.prefix)
    admin = aioredis.Redis.from_url(redis_url)

    async def subscriptions() -> list[tuple[int, int]]:
        clients = await admin.client_list()
        return [(int(c["sub"]), int(c["psub"])) for c in clients if c["name"] == name]

    try:
        channels = [await receiver.new_channel() for _ in range(50)]
        assert await admin.pubsub_channels(f"{receiver.prefix}*") == []
        assert (0, 1) in await subscriptions()
        assert sum(sub + psub for sub, psub in await subscriptions()) == 1
        for n, channel in enumerate(channels):
            await (stock if n % 2 else sender).send(channel, {"type": "x", "n": n})
        got = [(await asyncio.wait_for(receiver.receive(c), 5))["n"] for c in channels]
        assert got == list(range(50))
        await receiver.flush()
        assert (0, 1) not in await subscriptions()
        again = await receiver.new_channel()
        await sender.send(again, {"type": "x", "n": 99})
        assert (await asyncio.wait_for(receiver.receive(again), 5))["n"] == 99
    finally:
        await admin.aclose()
        await stock.flush()
        await _flushed(sender, receiver)
