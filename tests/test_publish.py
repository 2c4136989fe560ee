"""The sender and the frame shapes (`chatcore.common.publish`, `chatcore.common.events`):
every frame survives a JSON round trip, and a send started from sync code on the engine's loop
is a task of the engine's supervisor (F1, STYLE 4)."""

from __future__ import annotations

import datetime
import decimal
import json
import uuid
from types import SimpleNamespace

import pytest
from django.utils import timezone
from django.utils.translation import gettext_lazy

from chatcore.common import events, publish
from chatcore.common.errors import RateLimited
from chatcore.engine.turns.outcome import FailureKind
from sessions_app.models import MessageKind, Role

pytestmark = [pytest.mark.django_db(transaction=True)]


def _message(**kw: object) -> SimpleNamespace:
    base = dict(
        id="m-1",
        seq=3,
        role="assistant",
        content="hi",
        created_at=timezone.now(),
        tool_calls=None,
        tool_call_id=None,
        tool_name=None,
        status="truncated",
        source={"from_user_id": "42", "from_channel": "web", "reply_to": "c-1"},
        turn_id="t-1",
    )
    base.update(kw)
    return SimpleNamespace(**base)


def _json_text(frame: object) -> str:
    return json.dumps(frame, ensure_ascii=False, separators=(",", ":"), default=str)


def test_every_frame_shape_survives_a_json_round_trip() -> None:
    # covers: D1-D3, STYLE 4
    session = SimpleNamespace(
        session_id="web:u1:default",
        dialog_id="default",
        title="T",
        last_seq=3,
        last_active_at=timezone.now(),
        message_count=1,
        channel="web",
        chat_id="u1",
        effective_model="gpt-4o-mini",
        system_prompt="",
    )
    turn = SimpleNamespace(pk="t-2", mode="send", client_msg_id="", content="x" * 100)
    error = RateLimited(retry_after=1.234)
    frames = [
        events.history_delta_frame(
            session_id="s", turn_id="t-1", base_revision=2, messages=[_message()]
        ),
        events.turn_updated_frame(session_id="s", turn_id="t", status="completed"),
        events.session_updated_frame(session=session, compacted_through=3),
        events.notification_frame(session_id="s", level="info", content="c"),
        events.sessions_changed_frame(session_id="s", change="deleted"),
        events.turn_snapshot_frame(session_id="s", turn_id="t", text="ab", tools=[], frame=1),
        events.queued_frame(session_id="s", turn_id="t", position=0, mode="send"),
        events.sessions_frame(current=session, items=[events.session_item(session)]),
        events.session_history_frame(
            session=session,
            messages=[_message()],
            has_more=False,
            active_turn=None,
            queue=[events.queue_item(turn)],
        ),
        events.command_result_frame(command="help", ok=True, content="Commands:"),
        events.error_frame(**error.as_dict(), retry_after=error.retry_after),
    ]
    for frame in frames:
        assert json.loads(json.dumps(frame)) == frame
        # What a socket is sent: the same text the json module writes, compact.
        assert events.frame_text(frame) == _json_text(frame)
    # Sender ids stay private (A1); the rest of the source is shown.
    shown = frames[0]["messages"][0]
    assert "from_user_id" not in shown["source"] and shown["source"]["reply_to"] == "c-1"
    assert frames[-1]["retry_after"] == 1.2 and frames[-1]["code"] == "rate_limited"
    assert frames[6]["client_msg_id"] is None and frames[8]["queue"][0]["preview"] == "x" * 80


@pytest.mark.parametrize(
    "frame",
    [
        # Non-ASCII text as it is, escapes only where JSON needs them (D1: every character).
        {
            "type": "turn_snapshot",
            "text": 'caf\u00e9 \U0001f600 \u4e2d\u6587 "q" \\ \n\t\u2028\x00',
        },
        # What json's `default=str` wrote: datetimes, dates, times, UUIDs, decimals, enums,
        # dataclasses, lazy translations.
        {"at": datetime.datetime(2026, 12, 4, 15, 30, 1, 5, tzinfo=datetime.UTC)},
        {"day": datetime.date(2026, 12, 4), "time": datetime.time(15, 30)},
        {"id": uuid.UUID(int=7), "amount": decimal.Decimal("1.50"), "kind": FailureKind.TIMEOUT},
        {"point": SimpleNamespace(x=1), "text": gettext_lazy("Stop")},
        {"source": MessageKind.WELCOME, "role": Role.ASSISTANT},
        # What orjson refuses and the json module writes.
        {1: "a key that is no string", "n": 2**70, "lone": "\ud83d"},
        # Nesting, empties, literals.
        {"n": 12, "f": 1.2, "t": True, "none": None, "l": [[], {}, (1, 2)]},
    ],
)
def test_a_frame_s_text_is_the_json_module_s_compact_text(frame: dict) -> None:
    # covers: D1-D3, STYLE 4 (frames are encoded in C; clients read the same text as before)
    assert events.frame_text(frame) == _json_text(frame)


def test_a_frame_s_numbers_read_back_as_the_same_values() -> None:
    # covers: D1-D3 (a float's exponent may be written without its padding zero: 1.5e-7)
    frame = {"f": 0.1, "g": -1.5e-7, "big": 1e300, "i": -(2**63), "third": 1 / 3}
    assert json.loads(events.frame_text(frame)) == frame == json.loads(_json_text(frame))


async def test_a_sync_publish_on_the_engine_loop_is_a_supervised_task(make_engine, recorder):
    # covers: F1 (issue 12: every task `publish` starts is supervised)
    engine = await make_engine()
    rec = await recorder("test.group")
    before = len(engine.supervisor)
    publish.publish("test.group", events.sessions_changed_frame(session_id="s", change="deleted"))
    assert len(engine.supervisor) == before + 1
    frame = await rec.next()
    assert frame == {"type": "sessions_changed", "session_id": "s", "change": "deleted"}


async def test_frames_that_did_not_get_through_are_counted_on_the_health_page(
    async_client, monkeypatch
) -> None:
    # covers: F4, D1 (issue 10 item 4: a frame the layer drops or refuses is never silent)
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    before = (await async_client.get("/healthz")).json()["channel_layer"]
    # A connection that stopped reading: its channel is full, so it misses a group message.
    stuck = await layer.new_channel()
    await layer.group_add("sess.stuck", stuck)
    for i in range(layer.get_capacity(stuck)):
        await layer.send(stuck, {"type": "chat.event", "n": i})
    await publish.apublish("sess.stuck", {"type": "turn_snapshot"})

    # A layer that refuses a publish (its server is away).
    async def refuse(group: str, message: object) -> None:
        raise ConnectionError("layer down")

    monkeypatch.setattr(layer, "group_send", refuse)
    await publish.apublish("sess.other", {"type": "turn_snapshot"})
    monkeypatch.undo()
    after = (await async_client.get("/healthz")).json()["channel_layer"]
    assert after["dropped"] == before["dropped"] + 1
    assert after["failed_publishes"] == before["failed_publishes"] + 1
    await layer.flush()
