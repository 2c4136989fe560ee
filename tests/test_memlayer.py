"""The embedded mode's channel layer behaves as Channels' in-memory layer (fan-out, copies,
capacity, expiry), only without sweeping everything at every message."""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest
from channels.exceptions import ChannelFull
from channels.layers import InMemoryChannelLayer, get_channel_layer

from chatcore.common import memlayer
from chatcore.common.memlayer import LocalChannelLayer


def test_embedded_mode_uses_it() -> None:
    # covers: F7 (embedded mode: the layer without per-message sweeps)
    assert isinstance(get_channel_layer(), LocalChannelLayer)


async def test_group_send_reaches_every_member_with_its_own_copy() -> None:
    # covers: D1, D2 (every connection of a group gets the frame)
    layer = LocalChannelLayer()
    a, b, other = [await layer.new_channel() for _ in range(3)]
    for channel in (a, b):
        await layer.group_add("sess.one", channel)
    await layer.group_add("sess.two", other)
    message = {"type": "chat.event", "frame": {"text": "hi", "tools": [{"name": "x"}]}}
    await layer.group_send("sess.one", message)
    got_a = await layer.receive(a)
    got_b = await layer.receive(b)
    assert got_a == got_b == message
    # A consumer that changes what it received changes nobody else's frame.
    got_a["frame"]["tools"][0]["name"] = "changed"
    assert got_b["frame"]["tools"][0]["name"] == "x"
    assert message["frame"]["tools"][0]["name"] == "x"
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(layer.receive(other), 0.05)


async def test_messages_arrive_in_order() -> None:
    # covers: D1 (snapshot tails apply in order)
    layer = LocalChannelLayer()
    channel = await layer.new_channel()
    await layer.group_add("g", channel)
    for i in range(5):
        await layer.group_send("g", {"type": "chat.event", "n": i})
    assert [(await layer.receive(channel))["n"] for _ in range(5)] == list(range(5))


async def test_a_full_channel_refuses_a_send_and_misses_a_group_send(caplog) -> None:
    # covers: D1 (a full connection misses a frame, as in Channels; issue 10 item 4: the
    # miss is counted and logged, never silent)
    layer = LocalChannelLayer(capacity=2)
    full, free = await layer.new_channel(), await layer.new_channel()
    for channel in (full, free):
        await layer.group_add("g", channel)
    await layer.send(full, {"type": "a"})
    await layer.send(full, {"type": "b"})
    with pytest.raises(ChannelFull):
        await layer.send(full, {"type": "c"})
    with caplog.at_level("WARNING", logger="chatcore.common.memlayer"):
        await layer.group_send("g", {"type": "d"})
        await layer.group_send("g", {"type": "e"})
    assert [(await layer.receive(full))["type"] for _ in range(2)] == ["a", "b"]
    assert [(await layer.receive(free))["type"] for _ in range(2)] == ["d", "e"]
    assert layer.dropped == 2
    # One line for the burst (at most one per interval), naming the group and the channel.
    logged = [r.getMessage() for r in caplog.records if "missed by full channels" in r.message]
    assert len(logged) == 1
    assert "group g" in logged[0] and full in logged[0]


async def test_unread_messages_expire_and_their_channel_leaves_its_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # covers: A6 (nothing kept for a reader that is gone)
    layer = LocalChannelLayer(expiry=60)
    dead, live = await layer.new_channel(), await layer.new_channel()
    for channel in (dead, live):
        await layer.group_add("g", channel)
    await layer.send(dead, {"type": "old"})
    clock = memlayer.time.time()
    monkeypatch.setattr(memlayer.time, "time", lambda: clock + 61)
    monkeypatch.setattr(memlayer, "CLEAN_INTERVAL_SECONDS", 0.0)
    await layer.group_send("g", {"type": "new"})
    assert dead not in layer.groups["g"]
    assert (await layer.receive(live))["type"] == "new"
    assert dead not in layer.channels


async def test_the_parts_of_channels_it_builds_on_are_as_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # covers: I2 (measured against channels 4.3.2: the layer overrides the private
    # `_clean_expired`, puts `(expires_at, message)` in the base's `channels` queues and reads
    # the base's `groups`; an upgrade that changes any of them fails here)
    assert list(inspect.signature(InMemoryChannelLayer._clean_expired).parameters) == ["self"]
    stock = InMemoryChannelLayer(expiry=60, capacity=5)
    channel = await stock.new_channel()
    await stock.group_add("g", channel)
    assert list(stock.groups["g"]) == [channel]
    await stock.send(channel, {"type": "a"})
    queue = stock.channels[channel]
    assert isinstance(queue, asyncio.Queue) and queue.maxsize == 5
    expires_at, message = queue.get_nowait()
    assert message == {"type": "a"} and 59 < expires_at - time.time() <= 60
    # An entry in that shape, past its time, is swept by the base, and its channel leaves
    # its groups.
    queue.put_nowait((expires_at, message))
    monkeypatch.setattr(time, "time", lambda: expires_at + 1)
    stock._clean_expired()
    assert channel not in stock.channels and channel not in stock.groups["g"]
    await stock.flush()
    assert stock.channels == {} and stock.groups == {}
