"""The turn engine end to end against a fake model server (C1-C3, C9, D2)."""

from __future__ import annotations

import pytest

from chatcore.common import publish
from tests.engine_helpers import chat_group_of, history, make_dialog, send, turn
from tests.fakemodel import Reply, user_texts

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


async def test_one_send_one_turn_with_frames_in_order(make_engine, fake_model, recorder, user):
    # covers: C1, C2, C3, D2
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="Hello there, friend!", chunk=3))
    ack = await send(engine, session, "hi", client_msg_id="c1")
    assert ack.turn_id and ack.position == 0
    frames = await rec.until(lambda f: f["type"] == "turn_updated")
    kinds = [f["type"] for f in frames]
    assert kinds == ["history_delta", "history_delta", "turn_updated"]
    user_delta, answer_delta, done = frames
    assert user_delta["messages"][0]["content"] == "hi"
    assert user_delta["base_revision"] == 1 and user_delta["history_revision"] == 2
    assert answer_delta["base_revision"] == 2
    assert answer_delta["messages"][-1]["content"] == "Hello there, friend!"
    assert done["status"] == "completed" and done["client_msg_id"] == "c1"
    rows = await history(session)
    assert [m.role for m in rows] == ["system", "user", "assistant"]
    assert (await turn(ack.turn_id)).status == "completed"
    assert user_texts(fake_model.turn_requests()[0]) == ["hi"]


async def test_a_turns_end_never_holds_a_database_thread_on_the_channel_layer(
    make_engine, fake_model, recorder, user, monkeypatch
):
    # covers: C3, D2, F7
    # The answer's history_delta is held in the channel layer. Meanwhile every database
    # thread must be free for other dialogs: the commit publishes nothing from its thread.
    import asyncio
    import threading

    from chatcore.common import dbthreads
    from chatcore.common.dbthreads import on_db

    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    held, release = asyncio.Event(), asyncio.Event()

    async def hold(message: dict) -> None:
        for frame in _frames(message):
            roles = [m["role"] for m in frame.get("messages", [])]
            if frame.get("type") == "history_delta" and "assistant" in roles:
                held.set()
                await release.wait()

    _before_each_publish(monkeypatch, hold)
    fake_model.script(Reply(text="The whole answer.", chunk=4))
    await send(engine, session, "hi")
    await asyncio.wait_for(held.wait(), 10)

    count = dbthreads.thread_count()
    barrier = threading.Barrier(count, timeout=2)
    # Each call holds its thread until all of them run at once: only free threads can.
    await asyncio.gather(*(on_db(barrier.wait)() for _ in range(count)))

    release.set()
    frames = await rec.until(lambda f: f["type"] == "turn_updated")
    kinds = [f["type"] for f in frames]
    assert kinds == ["history_delta", "history_delta", "turn_updated"]
    assert frames[1]["messages"][-1]["content"] == "The whole answer."


async def test_a_turns_answer_and_terminal_are_one_publish(
    make_engine, fake_model, recorder, user, monkeypatch
):
    # covers: D2 (a turn's end costs one message on the layer, its frames in order)
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    sent: list[dict] = []

    async def record(message: dict) -> None:
        sent.append(message)

    _before_each_publish(monkeypatch, record)
    fake_model.script(Reply(text="One answer."))
    ack = await send(engine, session, "hi")
    await rec.terminal(ack.turn_id)
    ends = [m for m in sent if any(f["type"] == "turn_updated" for f in _frames(m))]
    assert len(ends) == 1
    delta, done = _frames(ends[0])
    assert delta["type"] == "history_delta" and delta["messages"][-1]["content"] == "One answer."
    assert done["type"] == "turn_updated" and done["turn_id"] == ack.turn_id


def _frames(message: dict) -> list[dict]:
    return [one["frame"] for one in publish.unfold(message)]


def _before_each_publish(monkeypatch, hook) -> None:
    """Run `hook(message)` before each group message goes on the channel layer."""
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    real_send = layer.group_send

    async def group_send(group: str, message: dict) -> None:
        await hook(message)
        await real_send(group, message)

    monkeypatch.setattr(layer, "group_send", group_send)
