"""Engine turns, continued: input building and overflow recovery (C7), staleness, persistence
failures and provider errors (C9, C10), tools (C8), snapshots (D1)."""

from __future__ import annotations

import logging
import threading

import pytest
from asgiref.sync import sync_to_async
from django.db import OperationalError

from chatcore.common import publish
from chatcore.engine.turns.builder import RUNTIME_MARKER, SYSTEM_PROMPT
from sessions_app import services
from sessions_app.models import MemoryNote
from tests.engine_helpers import (
    chat_group_of,
    history,
    make_dialog,
    send,
    turn,
    unwrap_engine_statements,
    wrap_engine_statements,
)
from tests.fakemodel import Reply
from tests.storage_helpers import writes
from tests.test_engine_turns import (
    chat_cfg,
    drain,
    terminals,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


# --- C7: input building and overflow recovery ------------------------------------------------


def _runtime_count(req) -> int:
    return sum(str(m.get("content", "")).count(RUNTIME_MARKER.strip()) for m in req.messages)


async def test_prompt_and_runtime_context_appended_exactly_once(
    make_engine, fake_model, recorder, user
):
    # covers: C7, C8
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    a = await send(engine, session, "first")
    b = await send(engine, session, "second")
    await terminals(rec, [a.turn_id, b.turn_id])
    for req in fake_model.turn_requests():
        assert req.messages[0]["role"] == "system" and SYSTEM_PROMPT in req.messages[0]["content"]
        assert sum(1 for m in req.messages if SYSTEM_PROMPT in str(m["content"])) == 1
        assert _runtime_count(req) == 1
        assert RUNTIME_MARKER.strip() in req.messages[-1]["content"]
        # The welcome message and sender ids never reach the model.
        assert not any("New dialog" in str(m["content"]) for m in req.messages)
        # (The runtime block, with its date and time, is checked above; it is left out here.)
        said = [str(m["content"]).split(RUNTIME_MARKER)[0] for m in req.messages[1:]]
        assert str(user.pk) not in str(said).replace(f"u{user.pk}", "")


async def test_overflow_recovers_once_through_the_same_builder(
    make_engine, fake_model, recorder, user
):
    # covers: C7
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    overflow = Reply(
        status=400, error={"error": {"code": "context_length_exceeded", "message": "too long"}}
    )
    fake_model.script(overflow, Reply(text="fits now"))
    ack = await send(engine, session, "big question")
    done = await terminals(rec, [ack.turn_id])
    assert done[ack.turn_id]["status"] == "completed"
    reqs = fake_model.turn_requests()
    assert len(reqs) == 2
    assert _runtime_count(reqs[1]) == 1
    assert sum(1 for m in reqs[1].messages if SYSTEM_PROMPT in str(m["content"])) == 1


async def test_second_overflow_in_a_turn_fails_typed(make_engine, fake_model, recorder, user):
    # covers: C7, C9, C10
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    overflow = Reply(
        status=400, error={"error": {"code": "context_length_exceeded", "message": "too long"}}
    )
    fake_model.script(overflow, overflow, Reply(text="never"))
    ack = await send(engine, session, "big question")
    done = await terminals(rec, [ack.turn_id])
    assert done[ack.turn_id]["status"] == "failed"
    assert done[ack.turn_id]["error"]["kind"] == "provider"
    assert len(fake_model.turn_requests()) == 2


# --- C9 / C10: staleness, persistence failures, provider errors -------------------------------


async def test_turn_is_stale_after_delete_and_commits_nothing(
    make_engine, fake_model, recorder, user
):
    # covers: C9, A7
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    gate = threading.Event()
    fake_model.script(Reply(text="answer for a deleted dialog", gate=gate))
    ack = await send(engine, session, "q")
    await fake_model.requests_made(1)
    await sync_to_async(services.session_soft_delete)(session=session)
    gate.set()
    done = await terminals(rec, [ack.turn_id])
    assert done[ack.turn_id]["status"] == "cancelled" and done[ack.turn_id]["reason"] == "stale"
    assert not [m for m in await history(session) if m.role == "assistant"]


async def test_persistence_failure_is_never_reported_as_completed(
    make_engine, fake_model, recorder, user
):
    # covers: C9, C10, A4
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    state = {"armed": False}

    def fail_assistant_writes(execute, sql, params, many, context):
        if state["armed"] and writes(sql, "INSERT", "sessions_app_message"):
            raise OperationalError("injected: disk full")
        return execute(sql, params, many, context)

    # The engine's ORM calls run on the database threads; install the failure there.
    await wrap_engine_statements(fail_assistant_writes)
    try:
        with chat_cfg(STORAGE_RETRY_DELAYS_MS=[1, 1, 1]):
            gate = threading.Event()
            fake_model.script(Reply(text="an answer that cannot be saved", gate=gate))
            ack = await send(engine, session, "q")
            await fake_model.requests_made(1)
            state["armed"] = True
            gate.set()
            frames = await rec.until(lambda f: f["type"] == "turn_updated")
    finally:
        await unwrap_engine_statements(fail_assistant_writes)
    done = frames[-1]
    assert done["turn_id"] == ack.turn_id
    assert done["status"] == "failed" and done["error"]["kind"] == "turn_persistence"
    assert "cannot be saved" not in str(done)
    assert any(f["type"] == "system_notification" and f["level"] == "error" for f in frames)
    assert not [m for m in await history(session) if m.role == "assistant"]
    assert (await turn(ack.turn_id)).status == "failed"


async def test_provider_errors_are_typed_and_secret_free(
    make_engine, fake_model, recorder, user, caplog
):
    # covers: C10, E5, F4
    caplog.set_level(logging.INFO)
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    leak = "Invalid key sk-test-secret-key-123456 at http://admin:hunter2@10.0.0.1/v1"
    fake_model.script(Reply(status=401, error={"error": {"message": leak}}))
    ack = await send(engine, session, "hi")
    done = (await terminals(rec, [ack.turn_id]))[ack.turn_id]
    assert done["status"] == "failed"
    assert done["error"]["kind"] == "provider"
    text = str(done)
    for secret in ("sk-test-secret-key-123456", "hunter2", "10.0.0.1"):
        assert secret not in text
    formatter = logging.getLogger().handlers[0].formatter if logging.getLogger().handlers else None
    rendered = "\n".join(
        (formatter.format(r) if formatter else r.getMessage()) for r in caplog.records
    )
    assert "sk-test-secret-key-123456" not in rendered and "hunter2" not in rendered
    # The key was sent to the model server, as it must be.
    assert fake_model.requests[0].headers["authorization"] == "Bearer sk-test-secret-key-123456"


async def test_server_errors_are_retried_before_the_first_token(
    make_engine, fake_model, recorder, user
):
    # covers: E5
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(status=503), Reply(status=429), Reply(text="third time lucky"))
    ack = await send(engine, session, "hi")
    done = await terminals(rec, [ack.turn_id])
    assert done[ack.turn_id]["status"] == "completed"
    assert len(fake_model.turn_requests()) == 3


# --- C8: tools ------------------------------------------------------------------------------


async def test_tool_calls_run_with_progress_in_snapshots_only(
    make_engine, fake_model, recorder, user
):
    # covers: C8, D1
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    snaps = await recorder(publish.session_group(session.pk))
    fake_model.script(
        Reply(
            tool_calls=[
                ("remember", {"note": "likes green tea"}),
                ("plan_update", {"plan": "1. tea"}),
            ]
        ),
        Reply(text="Noted."),
    )
    ack = await send(engine, session, "remember I like green tea")
    frames = await rec.until(lambda f: f["type"] == "turn_updated")
    assert frames[-1]["status"] == "completed"
    # No plain-text tool notifications on the chat: deltas and the terminal only.
    assert {f["type"] for f in frames} == {"history_delta", "turn_updated"}
    snap_frames = await drain(snaps)
    tool_views = [f["tools"] for f in snap_frames if f["tools"]]
    assert tool_views and tool_views[-1][-1]["status"] == "ok"
    assert await sync_to_async(
        lambda: list(MemoryNote.objects.values_list("content", flat=True))
    )() == ["likes green tea"]
    rows = await history(session)
    assert [m.role for m in rows[1:]] == ["user", "assistant", "tool", "tool", "assistant"]
    # Memory and plan reach the next turn's system prompt.
    nxt = await send(engine, session, "what do I like?")
    await terminals(rec, [nxt.turn_id])
    system = fake_model.turn_requests()[-1].messages[0]["content"]
    assert "likes green tea" in system and "1. tea" in system
    assert ack.turn_id


async def test_tool_errors_go_back_to_the_model(make_engine, fake_model, recorder, user):
    # covers: C8
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(tool_calls=[("no_such_tool", {})]), Reply(text="Sorry."))
    ack = await send(engine, session, "do it")
    done = await terminals(rec, [ack.turn_id])
    assert done[ack.turn_id]["status"] == "completed"
    tool_msg = fake_model.turn_requests()[1].messages[-1]
    assert tool_msg["role"] == "tool" and "unknown tool" in tool_msg["content"]


async def test_step_limit_forces_a_final_answer(make_engine, fake_model, recorder, user):
    # covers: C8
    with chat_cfg(MAX_STEPS=2):
        engine = await make_engine()
        session = await make_dialog(user)
        rec = await recorder(chat_group_of(session))
        fake_model.script(Reply(tool_calls=[("current_time", {})]), Reply(text="final"))
        ack = await send(engine, session, "loop")
        await terminals(rec, [ack.turn_id])
    last = fake_model.turn_requests()
    assert len(fake_model.requests) == 2 and len(last) == 1  # the last step offers no tools


# --- D1: snapshots --------------------------------------------------------------------------


async def test_snapshots_are_coalesced_tails_that_rebuild_the_answer(
    make_engine, fake_model, recorder, user
):
    # covers: D1
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    snaps = await recorder(publish.session_group(session.pk))
    answer = "".join(f"word{i} " for i in range(1500))
    fake_model.script(Reply(text=answer, chunk=3, delay=0.0005))
    ack = await send(engine, session, "long please")
    await terminals(rec, [ack.turn_id])
    frames = await drain(snaps)
    assert frames, "no snapshot frames"
    chunks = len(answer) // 3
    assert len(frames) < chunks / 10, f"{len(frames)} frames for {chunks} chunks"
    text = ""
    for f in frames:
        assert f["text_offset"] == len(text)
        text += f["text"]
    assert text == answer
    assert [f["frame"] for f in frames] == sorted(f["frame"] for f in frames)
    # Bytes on the wire grow with the answer, not its square.
    assert sum(len(f["text"]) for f in frames) <= len(answer)
