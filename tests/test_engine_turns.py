"""The turn engine against a fake OpenAI-compatible server: FIFO, stop, steer, inject, retry,
overflow, staleness, persistence failures, provider errors, tools, snapshots (SPEC C, D1)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import override_settings

from chatcore.common import publish
from chatcore.common.errors import BadRequest, Overloaded, QueueFull, RateLimited, TooLarge
from sessions_app.models import StagedInput, Turn
from tests.engine_helpers import chat_group_of, history, make_dialog, send
from tests.fakemodel import Reply, user_texts

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


def chat_cfg(**changes: Any) -> Any:
    return override_settings(CHAT={**settings.CHAT, **changes})


async def wait_for(pred, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (
        not await sync_to_async(pred)()
        if not asyncio.iscoroutinefunction(pred)
        else not await pred()
    ):
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def streamed(snaps, needle: str, timeout: float = 10.0) -> str:
    """Rebuild the answer from snapshot tails until it contains `needle`."""
    text = ""

    def grows(frame: dict[str, Any]) -> bool:
        nonlocal text
        if frame["type"] == "turn_snapshot":
            text = text[: frame["text_offset"]] + frame["text"]
        return needle in text

    await snaps.until(grows, timeout)
    return text


async def drain(rec, quiet: float = 0.3) -> list[dict[str, Any]]:
    frames = []
    while True:
        try:
            frames.append(await rec.next(timeout=quiet))
        except TimeoutError:
            return frames


async def terminals(rec, turn_ids: list[str], timeout: float = 20.0) -> dict[str, dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}

    def done(frame: dict[str, Any]) -> bool:
        if frame["type"] == "turn_updated" and frame["turn_id"] in turn_ids:
            assert frame["turn_id"] not in seen, "a second terminal for one turn"
            seen[frame["turn_id"]] = frame
        return len(seen) == len(turn_ids)

    await rec.until(done, timeout)
    return seen


# --- C1 / C3: one send, one turn, FIFO --------------------------------------------------------


async def test_sends_from_one_task_are_separate_fifo_turns(make_engine, fake_model, recorder, user):
    # covers: C1, C3
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    gate = threading.Event()
    fake_model.script(
        Reply(text="answer A", gate=gate), Reply(text="answer B"), Reply(text="answer C")
    )
    acks = [await send(engine, session, f"m{i}") for i in range(3)]
    assert [a.position for a in acks] == [0, 1, 2]
    gate.set()
    done = await terminals(rec, [a.turn_id for a in acks])
    assert all(f["status"] == "completed" for f in done.values())
    reqs = fake_model.turn_requests()
    assert len(reqs) == 3
    assert [user_texts(r) for r in reqs] == [["m0"], ["m0", "m1"], ["m0", "m1", "m2"]]
    # B's request sees A's final answer (C3).
    assert any(m["role"] == "assistant" and m["content"] == "answer A" for m in reqs[1].messages)


async def test_sends_from_adjacent_tasks_are_never_merged(make_engine, fake_model, recorder, user):
    # covers: C1
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    acks = await asyncio.gather(*(send(engine, session, f"p{i}") for i in range(5)))
    await terminals(rec, [a.turn_id for a in acks])
    reqs = fake_model.turn_requests()
    assert len(reqs) == 5
    numbers = await sync_to_async(
        lambda: list(
            Turn.objects.filter(session_id=session.pk)
            .order_by("number")
            .values_list("content", flat=True)
        )
    )()
    # Each request adds exactly one new user message, in queue order.
    for i, req in enumerate(reqs):
        assert user_texts(req) == numbers[: i + 1]


async def test_send_from_a_reentrant_listener_gets_its_own_turn(
    make_engine, fake_model, recorder, user
):
    # covers: C1
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    first = await send(engine, session, "first")
    follow_up = None
    frames = await rec.until(
        lambda f: f["type"] == "history_delta" and f["turn_id"] == first.turn_id
    )
    # Reacting to the user-message delta of turn 1, while it runs, send again.
    follow_up = await send(engine, session, "second")
    assert frames and follow_up.turn_id != first.turn_id
    await terminals(rec, [first.turn_id, follow_up.turn_id])
    assert [user_texts(r)[-1] for r in fake_model.turn_requests()] == ["first", "second"]


async def test_slow_dialog_never_blocks_another(make_engine, fake_model, recorder, user):
    # covers: C3, B3
    engine = await make_engine()
    slow = await make_dialog(user, "slow")
    fast = await make_dialog(user, "fast")
    rec = await recorder(chat_group_of(fast))
    fake_model.script(Reply(text="...", endless=True))
    await send(engine, slow, "take your time")
    await fake_model.requests_made(1)
    ack = await send(engine, fast, "quick one")
    done = await terminals(rec, [ack.turn_id])
    assert done[ack.turn_id]["status"] == "completed"
    assert await sync_to_async(lambda: Turn.objects.get(session_id=slow.pk).status)() == "running"
    await engine.stop(slow)


# --- C2 / F3: admission ------------------------------------------------------------------------


async def test_refused_sends_change_nothing(make_engine, user):
    # covers: C2, F3
    engine = await make_engine()
    session = await make_dialog(user)
    with pytest.raises(BadRequest):
        await send(engine, session, "   ")
    with pytest.raises(TooLarge):
        await send(engine, session, "x" * (settings.CHAT["CONTENT_LIMIT"] + 1))
    with pytest.raises(BadRequest):
        await send(engine, session, "a NUL \x00 byte")
    with pytest.raises(BadRequest):
        await send(engine, session, "a lone surrogate \ud800")
    assert await sync_to_async(Turn.objects.count)() == 0
    assert len(await history(session)) == 1


async def test_queue_capacity_and_global_bound(make_engine, fake_model, user):
    # covers: C1, F3
    with chat_cfg(QUEUE_CAPACITY=2):
        engine = await make_engine()
        session = await make_dialog(user)
        fake_model.script(Reply(text=".", endless=True))
        await send(engine, session, "running")
        await fake_model.requests_made(1)
        await send(engine, session, "q1")
        await send(engine, session, "q2")
        with pytest.raises(QueueFull):
            await send(engine, session, "q3")
        assert await sync_to_async(Turn.objects.count)() == 3
    with chat_cfg(GLOBAL_ADMISSION_BOUND=2):
        other = await make_dialog(user, "other")
        engine2 = await make_engine()
        with pytest.raises(Overloaded):
            await send(engine2, other, "no room")
    await engine.stop(session)


@pytest.mark.usefixtures("within_a_minute")
async def test_rate_limit_per_user(make_engine, fake_model, user):
    # covers: F3
    from django.core.cache import cache

    await sync_to_async(cache.clear)()
    with chat_cfg(RATE_LIMIT_PER_MINUTE=2):
        engine = await make_engine()
        session = await make_dialog(user)
        await send(engine, session, "one")
        await send(engine, session, "two")
        with pytest.raises(RateLimited) as info:
            await send(engine, session, "three")
        assert info.value.retry_after and info.value.retry_after > 0
    await engine.wait_idle()
    assert await sync_to_async(Turn.objects.count)() == 2


# --- C6: stop and retry ---------------------------------------------------------------------


async def test_stop_mid_stream_closes_connection_and_keeps_partial(
    make_engine, fake_model, recorder, user
):
    # covers: C6, C9
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    snaps = await recorder(publish.session_group(session.pk))
    fake_model.script(Reply(text="Once upon a time", chunk=4, endless=True))
    ack = await send(engine, session, "tell me a story")
    await streamed(snaps, "time")
    result = await engine.stop(session)
    assert result.stopped_running
    req = (await fake_model.requests_made(1))[0]
    assert await asyncio.to_thread(req.aborted.wait, 10), "the provider connection was not closed"
    done = await terminals(rec, [ack.turn_id])
    assert done[ack.turn_id]["status"] == "cancelled" and done[ack.turn_id]["reason"] == "stopped"
    rows = await history(session)
    partial = rows[-1]
    assert partial.role == "assistant" and partial.status == "cancelled"
    assert partial.content.startswith("Once upon a time")
    # Exactly one terminal: nothing more arrives for this turn.
    with pytest.raises(asyncio.TimeoutError):
        await rec.until(lambda f: f["type"] == "turn_updated", timeout=0.5)


async def test_a_stop_before_the_first_token_frees_the_model_call_at_once(
    make_engine, fake_model, recorder, user, make_user
):
    # covers: C6, F7, G6 (a stop while the model has not answered yet ends the request and
    # gives its model slot back: with one slot, another user's send is answered next; on
    # PostgreSQL that request went out as the admission committed, before the worker ran)
    never = threading.Event()
    fake_model.script(Reply(text="", gate=never), Reply(text="the other answer"))
    with chat_cfg(MODEL_CALLS_MAX=1):
        engine = await make_engine()
    session = await make_dialog(user)
    other = await make_dialog(await sync_to_async(make_user)())
    rec = await recorder(chat_group_of(session))
    other_rec = await recorder(chat_group_of(other))
    ack = await send(engine, session, "a question the model sits on")
    await fake_model.requests_made(1)
    result = await engine.stop(session)
    assert result.stopped_running
    done = await terminals(rec, [ack.turn_id])
    assert done[ack.turn_id]["status"] == "cancelled" and done[ack.turn_id]["reason"] == "stopped"
    other_ack = await send(engine, other, "and mine?")
    answered = await terminals(other_rec, [other_ack.turn_id])
    assert answered[other_ack.turn_id]["status"] == "completed"
    assert (await history(other))[-1].content == "the other answer"
    assert len(fake_model.requests) == 2
    never.set()


async def test_a_send_started_at_admission_asks_the_model_what_a_queued_one_asks(
    make_engine, fake_model, recorder, user
):
    # covers: G6, E5, C8 (the first request sent as the admission commits carries the same
    # tools, answer limit and stream options as one its worker makes; one request a turn)
    gate = threading.Event()
    fake_model.script(Reply(text="first", gate=gate), Reply(text="second"))
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    started = await send(engine, session, "one")
    await fake_model.requests_made(1)
    queued = await send(engine, session, "two")
    assert queued.position == 1
    gate.set()
    done = await terminals(rec, [started.turn_id, queued.turn_id])
    assert {done[t]["status"] for t in done} == {"completed"}
    first, second = (r.body for r in fake_model.requests)
    assert len(fake_model.requests) == 2
    assert sorted(first) == sorted(second)
    assert first["tools"] == second["tools"] and first["tools"]
    assert first["stream_options"] == second["stream_options"]
    limit = next(k for k in ("max_tokens", "max_completion_tokens") if k in first)
    assert 0 < first[limit] and 0 < second[limit] <= first[limit]


async def test_stop_drops_queued_sends_and_staged_steers(make_engine, fake_model, recorder, user):
    # covers: C6, C2
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="...", endless=True))
    running = await send(engine, session, "long")
    await fake_model.requests_made(1)
    q1 = await send(engine, session, "queued one")
    q2 = await send(engine, session, "queued two")
    await send(engine, session, "steer me", mode="steer")
    await engine.stop(session)
    done = await terminals(rec, [running.turn_id, q1.turn_id, q2.turn_id])
    assert done[q1.turn_id]["status"] == "cancelled" and done[q1.turn_id]["reason"] == "dropped"
    assert done[q2.turn_id]["reason"] == "dropped"
    assert done[running.turn_id]["reason"] == "stopped"
    await engine.wait_idle()
    assert len(fake_model.turn_requests()) == 1
    assert (
        await sync_to_async(
            lambda: StagedInput.objects.filter(status="dropped", mode="steer").count()
        )()
        == 1
    )
    contents = [m.content for m in await history(session)]
    assert "queued one" not in contents and "steer me" not in contents


async def test_stop_from_another_engine_reaches_the_running_turn(
    make_engine, fake_model, recorder, user
):
    # covers: C6 (cross-process through the channel layer)
    runner_engine = await make_engine(name="proc-a")
    other_engine = await make_engine(name="proc-b")
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="streaming on", endless=True))
    ack = await send(runner_engine, session, "go")
    req = (await fake_model.requests_made(1))[0]
    result = await other_engine.stop(session)
    assert result.stopped_running
    assert await asyncio.to_thread(req.aborted.wait, 10)
    done = await terminals(rec, [ack.turn_id])
    assert done[ack.turn_id]["status"] == "cancelled"


async def test_retry_reruns_without_duplicating_the_user_message(
    make_engine, fake_model, recorder, user
):
    # covers: C6
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(
        Reply(status=400, error={"error": {"message": "bad things"}}), Reply(text="second try")
    )
    first = await send(engine, session, "hello")
    done = await terminals(rec, [first.turn_id])
    assert done[first.turn_id]["status"] == "failed"
    ack = await engine.retry(session, owner=user)
    assert ack.turn_id != first.turn_id and ack.mode == "retry"
    done = await terminals(rec, [ack.turn_id])
    assert done[ack.turn_id]["status"] == "completed"
    second = fake_model.turn_requests()[-1]
    assert user_texts(second) == ["hello"]
    rows = await history(session)
    assert [m.content for m in rows if m.role == "user"] == ["hello"]
    assert rows[-1].content == "second try"


async def test_retry_after_stop_keeps_the_earlier_partial_in_history(
    make_engine, fake_model, recorder, user
):
    # covers: C6
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    snaps = await recorder(publish.session_group(session.pk))
    fake_model.script(Reply(text="partial words", endless=True), Reply(text="full answer"))
    first = await send(engine, session, "question")
    await streamed(snaps, "words")
    await engine.stop(session)
    await terminals(rec, [first.turn_id])
    ack = await engine.retry(session, owner=user)
    await terminals(rec, [ack.turn_id])
    second = fake_model.turn_requests()[-1]
    # The retried turn's own partial is not fed back to the model...
    assert not any(m["role"] == "assistant" and "partial" in m["content"] for m in second.messages)
    # ...but stays in history, marked cancelled.
    rows = await history(session)
    assert [(m.content[:7], m.status) for m in rows if m.role == "assistant"] == [
        ("partial", "cancelled"),
        ("full an", ""),
    ]


async def test_nothing_to_retry_is_a_clear_error(make_engine, user):
    # covers: C6
    from chatcore.common.errors import NothingToRetry

    engine = await make_engine()
    session = await make_dialog(user)
    with pytest.raises(NothingToRetry):
        await engine.retry(session, owner=user)


# --- C4 / C5: steer and inject --------------------------------------------------------------


async def test_steer_is_recorded_at_the_step_boundary(make_engine, fake_model, recorder, user):
    # covers: C4
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    gate = threading.Event()
    fake_model.script(
        Reply(text="Let me check.", gate=gate, tool_calls=[("current_time", {})]),
        Reply(text="Done, in French."),
    )
    ack = await send(engine, session, "what time is it")
    await fake_model.requests_made(1)
    steer = await send(engine, session, "answer in French", mode="steer")
    assert steer.mode == "steer" and steer.turn_id == ack.turn_id
    gate.set()
    await terminals(rec, [ack.turn_id])
    second = fake_model.turn_requests()[1]
    assert [m["role"] for m in second.messages[-3:]] == ["assistant", "tool", "user"]
    assert second.messages[-1]["content"] == "answer in French"
    rows = await history(session)
    assert [(m.role, m.kind) for m in rows[1:]] == [
        ("user", "user_input"),
        ("assistant", "assistant"),
        ("tool", "tool_result"),
        ("user", "steer"),
        ("assistant", "assistant"),
    ]
    s = await sync_to_async(type(session).objects.get)(pk=session.pk)
    assert s.message_count == 2  # the steer is the user's own message too


async def test_steer_after_final_answer_causes_one_more_step(
    make_engine, fake_model, recorder, user
):
    # covers: C4
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    gate = threading.Event()
    fake_model.script(Reply(text="Long answer", gate=gate), Reply(text="Short answer"))
    ack = await send(engine, session, "explain")
    await fake_model.requests_made(1)
    await send(engine, session, "shorter please", mode="steer")
    gate.set()
    await terminals(rec, [ack.turn_id])
    assert len(fake_model.turn_requests()) == 2
    rows = await history(session)
    assert [m.content for m in rows[2:]] == ["Long answer", "shorter please", "Short answer"]


async def test_steer_stays_staged_after_a_failure_and_joins_the_next_send(
    make_engine, fake_model, recorder, user
):
    # covers: C4
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    gate = threading.Event()
    fake_model.script(
        Reply(status=400, gate=gate, error={"error": {"message": "nope"}}), Reply(text="ok now")
    )
    first = await send(engine, session, "try this")
    await fake_model.requests_made(1)
    await send(engine, session, "and consider that", mode="steer")
    gate.set()
    done = await terminals(rec, [first.turn_id])
    assert done[first.turn_id]["status"] == "failed"
    await engine.wait_idle()
    # Staged, not recorded, and it did not wake the dialog.
    assert await sync_to_async(lambda: StagedInput.objects.get().status)() == "staged"
    assert len(fake_model.turn_requests()) == 1
    nxt = await send(engine, session, "next message")
    await terminals(rec, [nxt.turn_id])
    assert user_texts(fake_model.turn_requests()[-1])[-2:] == ["next message", "and consider that"]


async def test_inject_when_idle_appends_without_a_turn(make_engine, fake_model, recorder, user):
    # covers: C5, D2
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    ack = await send(engine, session, "the user is on a phone", mode="inject")
    assert ack.turn_id is None and ack.mode == "inject"
    delta = (await rec.until(lambda f: f["type"] == "history_delta"))[-1]
    assert delta["messages"][0]["content"] == "the user is on a phone"
    assert delta["messages"][0]["source"]["kind"] == "inject"
    assert fake_model.requests == []
    assert await sync_to_async(Turn.objects.count)() == 0


async def test_inject_mid_turn_is_context_without_an_extra_step(
    make_engine, fake_model, recorder, user
):
    # covers: C5
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    gate = threading.Event()
    fake_model.script(Reply(text="answer", gate=gate))
    ack = await send(engine, session, "q")
    await fake_model.requests_made(1)
    await send(engine, session, "context: user prefers metric", mode="inject")
    gate.set()
    await terminals(rec, [ack.turn_id])
    assert len(fake_model.turn_requests()) == 1
    rows = await history(session)
    assert [(m.role, m.content) for m in rows[2:]] == [
        ("assistant", "answer"),
        ("user", "context: user prefers metric"),
    ]
