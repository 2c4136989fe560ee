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
