"""The turn engine end to end against a fake model server (C1-C3, C9, D2)."""

from __future__ import annotations

import pytest

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
