"""Delivery to an external platform's streaming message (D4), through the real engine with a
scripted test sink: the five cases of the design notes plus target-not-found and progress."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import OperationalError
from django.test import override_settings

from chatcore.common import publish
from chatcore.engine.delivery import DeliveryError, TargetNotFound, Terminal
from sessions_app import services
from tests.engine_helpers import (
    chat_group_of,
    send,
    unwrap_engine_statements,
    wrap_engine_statements,
)
from tests.fakemodel import Reply
from tests.storage_helpers import writes
from tests.test_engine_turns import streamed, terminals

pytestmark = [pytest.mark.django_db(transaction=True)]


@dataclass
class SinkScript:
    open_fails: bool = False
    finish_failures: int = 0  # how many finish calls fail before one succeeds (-1: all)
    finish_error: type[Exception] = DeliveryError
    opened: list[dict[str, Any]] = field(default_factory=list)
    updates: list[str] = field(default_factory=list)
    finishes: list[Terminal] = field(default_factory=list)
    plain: list[str] = field(default_factory=list)
    finish_gate: asyncio.Event | None = None  # finish waits for it (a stuck platform)
    update_gate: asyncio.Event | None = None  # update waits for it (a stuck platform)


SCRIPT = SinkScript()


class ScriptedSink:
    async def open(self, target: dict[str, Any]) -> Any:
        if SCRIPT.open_fails:
            raise DeliveryError("platform refused")
        SCRIPT.opened.append(target)
        return {"message_id": "m-1"}

    async def update(self, handle: Any, text: str) -> None:
        if SCRIPT.update_gate is not None:
            await SCRIPT.update_gate.wait()
        SCRIPT.updates.append(text)

    async def finish(self, handle: Any, terminal: Terminal) -> None:
        if SCRIPT.finish_gate is not None:
            await SCRIPT.finish_gate.wait()
        SCRIPT.finishes.append(terminal)
        if SCRIPT.finish_failures == -1 or len(SCRIPT.finishes) <= SCRIPT.finish_failures:
            raise SCRIPT.finish_error("edit failed")

    async def send_plain(self, target: dict[str, Any], text: str) -> None:
        SCRIPT.plain.append(text)


@pytest.fixture
def sink() -> Any:
    global SCRIPT
    SCRIPT = SinkScript()
    cfg = {
        **settings.CHAT,
        "SINKS": {"testsink": "tests.test_delivery.ScriptedSink"},
        "SINK_BACKOFF_SECONDS": 0.01,
    }
    with override_settings(CHAT=cfg):
        yield SCRIPT


async def platform_dialog(user: Any) -> Any:
    return await sync_to_async(services.session_create)(
        owner=user, channel="testsink", chat_id="room-1", dialog_id="default"
    )


async def run_one(make_engine, fake_model, recorder, user, reply: Reply) -> dict[str, Any]:
    engine = await make_engine()
    session = await platform_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(reply)
    ack = await send(engine, session, "hi", channel_context={"thread": "t-9"})
    done = (await terminals(rec, [ack.turn_id]))[ack.turn_id]
    await engine.wait_idle()  # the sink's terminal follows the published one
    return done


async def test_open_failure_sends_one_plain_terminal(sink, make_engine, fake_model, recorder, user):
    # covers: D4
    sink.open_fails = True
    done = await run_one(make_engine, fake_model, recorder, user, Reply(text="the answer"))
    assert done["status"] == "completed"
    assert sink.plain == ["the answer"] and sink.finishes == []


async def test_permanent_finish_failure_falls_back_exactly_once(
    sink, make_engine, fake_model, recorder, user, caplog
):
    # covers: D4
    sink.finish_failures = -1
    await run_one(make_engine, fake_model, recorder, user, Reply(text="the answer"))
    assert len(sink.finishes) == settings.CHAT["SINK_RETRIES"] + 1
    assert sink.plain == ["the answer"]
    assert any("falling back" in r.getMessage() for r in caplog.records)
    # The platform context reached the sink (D5).
    assert sink.opened[0]["thread"] == "t-9"


async def test_transient_finish_failure_then_success_sends_no_fallback(
    sink, make_engine, fake_model, recorder, user
):
    # covers: D4
    sink.finish_failures = 1
    await run_one(make_engine, fake_model, recorder, user, Reply(text="the answer"))
    assert len(sink.finishes) == 2 and sink.plain == []
    assert sink.finishes[-1] == Terminal(status="completed", text="the answer")


async def test_a_stuck_sink_does_not_hold_up_the_next_turn(
    sink, make_engine, fake_model, recorder, user
):
    # covers: D4 (issue 12): the worker does not wait for a sink's terminal; the dialog's next
    # turn runs and ends while the first terminal is still on its way, and the terminals
    # still reach the platform once each, in the order of the turns.
    sink.finish_gate = asyncio.Event()
    engine = await make_engine()
    session = await platform_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="first answer"), Reply(text="second answer"))
    a = await send(engine, session, "one")
    b = await send(engine, session, "two")
    done = await terminals(rec, [a.turn_id, b.turn_id])
    assert done[a.turn_id]["status"] == done[b.turn_id]["status"] == "completed"
    assert sink.finishes == []
    sink.finish_gate.set()
    await engine.wait_idle()
    assert [t.text for t in sink.finishes] == ["first answer", "second answer"]
    assert sink.plain == []


async def test_a_stuck_sink_update_does_not_hold_up_the_snapshots(
    sink, make_engine, fake_model, recorder, user
):
    # covers: D1, D4 (issue 12): the sink's progress runs in its own task; web clients of
    # the dialog keep getting the answer while the platform's edit hangs.
    sink.update_gate = asyncio.Event()
    model_gate = threading.Event()
    with override_settings(CHAT={**settings.CHAT, "SINK_TIMEOUT_SECONDS": 120}):
        engine = await make_engine()
    session = await platform_dialog(user)
    rec = await recorder(chat_group_of(session))
    snaps = await recorder(publish.session_group(session.pk))
    text = "one two three four five six seven eight nine ten"
    fake_model.script(Reply(text=text, chunk=3, delay=0.05, gate=model_gate))
    ack = await send(engine, session, "count")
    try:
        assert await streamed(snaps, "nine ten", timeout=20) == text
    finally:
        model_gate.set()
        sink.update_gate.set()
    done = await terminals(rec, [ack.turn_id])
    assert done[ack.turn_id]["status"] == "completed"
    await engine.wait_idle()
    assert sink.finishes == [Terminal(status="completed", text=text)]
    assert sink.updates and sink.updates[-1] in text


async def test_target_not_found_is_never_success(sink, make_engine, fake_model, recorder, user):
    # covers: D4
    sink.finish_failures = -1
    sink.finish_error = TargetNotFound
    await run_one(make_engine, fake_model, recorder, user, Reply(text="the answer"))
    assert sink.plain == ["the answer"]


async def test_persistence_failure_never_sends_the_answer(
    sink, make_engine, fake_model, recorder, user
):
    # covers: D4, C9
    sink.finish_failures = -1
    state = {"armed": False}

    def fail_writes(execute, sql, params, many, context):
        if state["armed"] and writes(sql, "INSERT", "sessions_app_message"):
            raise OperationalError("injected")
        return execute(sql, params, many, context)

    await wrap_engine_statements(fail_writes)
    try:
        with override_settings(CHAT={**settings.CHAT, "STORAGE_RETRY_DELAYS_MS": [1, 1, 1]}):
            gate = threading.Event()
            engine = await make_engine()
            session = await platform_dialog(user)
            rec = await recorder(chat_group_of(session))
            fake_model.script(Reply(text="secret unsaved answer", gate=gate))
            ack = await send(engine, session, "hi")
            await fake_model.requests_made(1)
            state["armed"] = True
            gate.set()
            done = (await terminals(rec, [ack.turn_id]))[ack.turn_id]
            await engine.wait_idle()
    finally:
        await unwrap_engine_statements(fail_writes)
    assert done["status"] == "failed"
    assert all("secret unsaved answer" not in t.text for t in sink.finishes)
    assert all("secret unsaved answer" not in p for p in sink.plain)
    assert sink.finishes[0].status == "failed"


async def test_cancel_sends_one_terminal_and_only_a_partial_note(
    sink, make_engine, fake_model, recorder, user
):
    # covers: D4, C6
    sink.finish_failures = -1
    engine = await make_engine()
    session = await platform_dialog(user)
    rec = await recorder(chat_group_of(session))
    snaps = await recorder(publish.session_group(session.pk))
    fake_model.script(Reply(text="partial words here", endless=True))
    ack = await send(engine, session, "go")
    await streamed(snaps, "here")
    await engine.stop(session)
    done = (await terminals(rec, [ack.turn_id]))[ack.turn_id]
    await engine.wait_idle()
    assert done["status"] == "cancelled"
    assert {t.status for t in sink.finishes} == {"cancelled"}
    assert len(sink.plain) == 1 and sink.plain[0].startswith("(stopped) partial words here")
    # Progress reached the streaming message while it ran.
    assert sink.updates and "partial words" in sink.updates[-1]


async def test_cancel_without_partial_sends_nothing_plain(
    sink, make_engine, fake_model, recorder, user
):
    # covers: D4
    sink.open_fails = True
    engine = await make_engine()
    session = await platform_dialog(user)
    rec = await recorder(chat_group_of(session))
    gate = threading.Event()
    fake_model.script(Reply(text="", gate=gate))
    ack = await send(engine, session, "go")
    await fake_model.requests_made(1)
    await engine.stop(session)
    await terminals(rec, [ack.turn_id])
    await engine.wait_idle()
    gate.set()
    assert sink.plain == []


async def test_shutdown_produces_one_terminal(sink, make_engine, fake_model, recorder, user):
    # covers: D4, F1
    engine = await make_engine()
    session = await platform_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="never ends", endless=True))
    ack = await send(engine, session, "go")
    await fake_model.requests_made(1)
    await engine.shutdown(grace=1)
    await terminals(rec, [ack.turn_id])
    assert len(sink.finishes) == 1 and sink.finishes[0].status == "failed"
