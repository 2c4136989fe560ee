"""Provider fidelity, continued (E5): nested usage, non-retryable wording, the answer token
limit, and continue through the REST and WebSocket channels."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import cache
from django.test import override_settings
from django.utils import translation

from chatcore.engine.provider import OpenAIProvider
from chatcore.engine.provider_errors import ANSWER_TOKEN_MARGIN
from chatcore.engine.turns.outcome import FailureKind, present_failure
from tests.engine_helpers import chat_group_of, history, make_dialog, send, turn
from tests.fakemodel import Reply
from tests.test_provider_fidelity import (
    answers,
    finish,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


# --- 4. nested usage; non-retryable wording ---------------------------------------------------


async def test_nested_usage_details_are_kept_and_summed(make_engine, fake_model, recorder, user):
    # covers: E5
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))

    def usage(cached: int, reasoning: int) -> dict[str, Any]:
        return {
            "prompt_tokens": 10,
            "completion_tokens": 4,
            "total_tokens": 14,
            "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": reasoning},
        }

    fake_model.script(
        Reply(tool_calls=[("current_time", {})], usage=usage(6, 2)),
        Reply(text="done", usage=usage(8, 1)),
    )
    ack = await send(engine, session, "time")
    await finish(rec, ack.turn_id)
    assert (await turn(ack.turn_id)).usage == {
        "prompt_tokens": 20,
        "completion_tokens": 8,
        "total_tokens": 28,
        "prompt_tokens_details": {"cached_tokens": 14, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 3},
    }


async def test_a_rejected_request_does_not_ask_the_user_to_retry(
    make_engine, fake_model, recorder, user
):
    # covers: E5, C10, F5
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(status=400, error={"error": {"message": "unsupported parameter"}}))
    ack = await send(engine, session, "hi")
    done = await finish(rec, ack.turn_id)
    assert done["status"] == "failed"
    assert "retry" not in done["error"]["message"].lower()
    assert len(fake_model.turn_requests()) == 1
    english = present_failure(FailureKind.PROVIDER, "bad_request")
    with translation.override("zh-hans"):
        chinese = present_failure(FailureKind.PROVIDER, "bad_request")
    assert chinese != english and "重试" not in chinese


# --- 5. max_tokens from a setting ---------------------------------------------------------------


async def test_max_tokens_is_what_the_window_leaves_after_the_input(
    make_engine, fake_model, recorder, user
):
    # covers: E5
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    ack = await send(engine, session, "hello")
    await finish(rec, ack.turn_id)
    body = fake_model.turn_requests()[0].body
    window = settings.LLM["CONTEXT_WINDOW"]
    counter = engine.builder.counter
    estimate = sum(counter.count_message(m) for m in body["messages"])
    expected = window - estimate - max(ANSWER_TOKEN_MARGIN, estimate // 4)
    # The engine counts the runtime block apart from the message it is appended to, which
    # can differ from counting the joined text by a token or two.
    assert abs(body["max_tokens"] - expected) <= 4
    assert "max_completion_tokens" not in body


@pytest.mark.parametrize(
    ("message", "first", "then"),
    [
        # OpenAI: the model's output ceiling, learnt and kept for later requests.
        (
            "max_tokens is too large: 32000. This model supports at most 1000 completion "
            "tokens, whereas you provided 32000.",
            "max_tokens",
            ("max_tokens", 1000),
        ),
        # OpenAI reasoning models want the other field.
        (
            "Unsupported parameter: 'max_tokens' is not supported with this model. "
            "Use 'max_completion_tokens' instead.",
            "max_tokens",
            ("max_completion_tokens", None),
        ),
        # A server that takes no limit field at all.
        ("Unrecognized request argument supplied: max_tokens", "max_tokens", (None, None)),
    ],
)
async def test_a_refused_answer_limit_is_adjusted_once_and_remembered(
    make_engine, fake_model, recorder, user, message, first, then
):
    # covers: E5
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(status=400, error={"error": {"message": message, "code": None}}))
    ack = await send(engine, session, "hi")
    assert (await finish(rec, ack.turn_id))["status"] == "completed"
    nxt = await send(engine, session, "again")
    assert (await finish(rec, nxt.turn_id))["status"] == "completed"
    bodies = [r.body for r in fake_model.turn_requests()]
    assert len(bodies) == 3  # one refused request, then one per turn
    assert first in bodies[0]
    param, value = then
    for body in bodies[1:]:
        sent = {k: v for k, v in body.items() if k in ("max_tokens", "max_completion_tokens")}
        if param is None:
            assert sent == {}
        else:
            assert list(sent) == [param]
            if value is not None:
                assert sent[param] == value


async def test_a_tool_steps_limit_counts_what_the_turn_added_off_the_event_loop(
    make_engine, fake_model, recorder, user
):
    # covers: E5, F7 (what a turn records for its next step is counted in a worker thread,
    # never on the event loop, and the answer that ends the turn is not counted at all)
    import threading

    from chatcore.engine.tokens import TokenCounter, heuristic_count

    engine = await make_engine()
    counted_on: list[tuple[str, str]] = []

    def count(text: str) -> int:
        counted_on.append((threading.current_thread().name, text))
        return heuristic_count(text)

    loop_thread = threading.current_thread().name
    engine.builder._counter = TokenCounter("probe", count)
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(tool_calls=[("current_time", {})]), Reply(text="It is late."))
    ack = await send(engine, session, "what time is it?")
    assert (await finish(rec, ack.turn_id))["status"] == "completed"
    first, second = (r.body for r in fake_model.turn_requests())
    # The second step's limit leaves room for the tool call and the result it carries.
    check = TokenCounter("check", heuristic_count)
    estimate = sum(check.count_message(m) for m in second["messages"])
    window = settings.LLM["CONTEXT_WINDOW"]
    expected = window - estimate - max(ANSWER_TOKEN_MARGIN, estimate // 4)
    assert second["max_tokens"] < first["max_tokens"]
    assert abs(second["max_tokens"] - expected) <= 4
    assert not [text for thread, text in counted_on if thread == loop_thread]
    assert not [text for _thread, text in counted_on if "It is late." in text]


async def test_a_limit_that_does_not_fit_the_window_is_fitted(
    make_engine, fake_model, recorder, user
):
    # covers: E5, C7
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    vllm = (
        "This model's maximum context length is 4096 tokens. However, you requested 5000 "
        "tokens (1200 in the messages, 3800 in the completion). Please reduce the length of "
        "the messages or completion."
    )
    fake_model.script(Reply(status=400, error={"object": "error", "message": vllm, "code": 400}))
    ack = await send(engine, session, "hi")
    assert (await finish(rec, ack.turn_id))["status"] == "completed"
    bodies = [r.body for r in fake_model.turn_requests()]
    assert len(bodies) == 2
    assert bodies[1]["max_tokens"] == 4096 - 1200 - ANSWER_TOKEN_MARGIN
    # Not a history overflow: nothing was rebuilt or compacted for it.
    assert len(bodies[1]["messages"]) == len(bodies[0]["messages"])


async def test_a_limit_refused_again_after_fitting_is_an_overflow_recovered_once(
    make_engine, fake_model, recorder, user
):
    # covers: E5, C7
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    vllm = (
        "This model's maximum context length is 4096 tokens. However, you requested 5000 "
        "tokens (1200 in the messages, 3800 in the completion)."
    )
    refused = Reply(status=400, error={"object": "error", "message": vllm, "code": 400})
    fake_model.script(refused, refused, Reply(text="fits now"))
    ack = await send(engine, session, "hi")
    done = await finish(rec, ack.turn_id)
    assert done["status"] == "completed"
    assert len(fake_model.turn_requests()) == 3
    assert answers(await history(session))[-1].content == "fits now"


async def test_max_tokens_setting_caps_it_under_the_configured_field(
    make_engine, fake_model, recorder, user
):
    # covers: E5
    provider = OpenAIProvider(
        base_url=fake_model.url,
        model="fake",
        retry_base_delay=0.01,
        max_tokens_param="max_completion_tokens",
    )
    engine = await make_engine(provider=provider)
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    with override_settings(LLM={**settings.LLM, "MAX_TOKENS": 300}):
        # The server stops a runaway answer at the limit; the user sees it was cut.
        fake_model.script(Reply(text="words " * 50, finish_reason="length"))
        ack = await send(engine, session, "go on forever")
        done = await finish(rec, ack.turn_id)
    body = fake_model.turn_requests()[0].body
    assert body["max_completion_tokens"] == 300 and "max_tokens" not in body
    assert done["notice"]["kind"] == "truncated"


# --- Continue through the channels: REST and WebSocket ---------------------------------------


async def test_rest_continue_is_202_after_a_cut_and_409_otherwise(engine, fake_model, user):
    # covers: E5, E3
    from tests.api_helpers import bearer_api, error_of

    await sync_to_async(cache.clear)()
    api = await bearer_api(user)
    sid = (await api.create())["session_id"]
    status, data = await api.post(f"/sessions/{sid}/continue")
    error_of(status, data, 409, "bad_request")

    fake_model.script(Reply(text="A long answ", finish_reason="length"))
    sent = await api.send(sid, "long please")
    first = await api.turn_done(sent["turn_id"])
    assert first["reason"] == "truncated" and first["notice"]["kind"] == "truncated"
    assert first["messages"][-1]["status"] == "truncated"

    fake_model.script(Reply(text="er, finished."))
    status, data = await api.post(f"/sessions/{sid}/continue", {"client_msg_id": "k-1"})
    assert status == 202, data
    assert data["mode"] == "continue" and data["position"] == 0
    cont = await api.turn_done(data["turn_id"])
    assert cont["status"] == "completed" and cont["mode"] == "continue"
    assert cont["messages"][-1]["source"]["continues"] == first["messages"][-1]["id"]
    status, page = await api.get(f"/sessions/{sid}/messages")
    assert [
        (m["content"], m.get("status")) for m in page["messages"] if m["role"] == "assistant"
    ] == [
        ("A long answ", "truncated"),
        ("er, finished.", None),
    ]
    status, data = await api.post(f"/sessions/{sid}/continue")
    error_of(status, data, 409, "bad_request")


async def test_ws_continue_frame(engine, fake_model, user):
    # covers: E5
    from tests.ws_helpers import WS, bearer, open_ws

    await make_dialog(user)
    ws, connected = await open_ws(await bearer(user))
    assert connected
    try:
        await ws.until(lambda f: f["type"] == "session_history")
        answer = await ws.ask({"type": "continue", "client_msg_id": "c-0"})
        assert answer["type"] == "error" and answer["code"] == "bad_request"

        fake_model.script(Reply(text="Part one", finish_reason="length"), Reply(text=", two."))
        await ws.send({"type": "send", "content": "hi", "client_msg_id": "s-1"})
        frames = await ws.until(lambda f: f["type"] == "turn_updated")
        assert frames[-1]["notice"]["kind"] == "truncated"
        delta = [f for f in frames if f["type"] == "history_delta"][-1]
        cut = delta["messages"][-1]
        assert cut["status"] == "truncated"

        queued = await ws.ask({"type": "continue", "client_msg_id": "c-1"})
        assert queued["type"] == "queued" and queued["mode"] == "continue"
        frames = await ws.until(lambda f: f["type"] == "turn_updated")
        assert frames[-1]["status"] == "completed"
        added = [f for f in frames if f["type"] == "history_delta"][-1]["messages"]
        assert [m["role"] for m in added] == ["assistant"]
        assert added[0]["content"] == ", two." and added[0]["source"]["continues"] == cut["id"]
    finally:
        assert isinstance(ws, WS)
        await ws.close()


async def test_rest_continue_streams_like_a_send(engine, fake_model, user):
    # covers: E5, E3, D1
    import asyncio

    from tests.api_helpers import BASE, bearer_api, read_stream

    await sync_to_async(cache.clear)()
    api = await bearer_api(user)
    sid = (await api.create())["session_id"]
    fake_model.script(Reply(text="Count: one, two", finish_reason="length"))
    await api.turn_done((await api.send(sid, "count"))["turn_id"])
    fake_model.script(Reply(text=", three.", chunk=2, delay=0.01))
    response = await api.client.post(
        f"{BASE}/sessions/{sid}/continue",
        {"client_msg_id": "k-2"},
        content_type="application/json",
        headers={**api.headers, "Accept": "text/event-stream"},
    )
    assert response.status_code == 200
    events = await asyncio.wait_for(read_stream(response), 20)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "queued" and events[0]["mode"] == "continue"
    assert kinds[-2:] == ["history_delta", "turn_updated"]
    assert "turn_snapshot" in kinds
    assert events[-2]["messages"][-1]["content"] == ", three."
    assert events[-1]["status"] == "completed"


async def test_a_request_made_ahead_is_sent_as_made_unless_the_limits_form_changed(fake_model):
    # covers: E5, F7 (a turn's first request is made where its input is built; the server
    # may have taught the provider another limit field meanwhile, and that one is used)
    provider = OpenAIProvider(base_url=fake_model.url, model="fake", retry_base_delay=0.01)
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "t", "parameters": {}}}]
    try:
        for change in (False, True):
            ahead = provider.prepare_request(messages=messages, tools=tools, max_tokens=70)
            if change:
                provider.max_tokens_param = "max_completion_tokens"
            fake_model.script(Reply(text="ok"))
            events = [
                e
                async for e in provider.stream(
                    messages=messages, tools=tools, max_tokens=70, prepared=ahead
                )
            ]
            assert events[-1].text == "ok"
            body = fake_model.turn_requests()[-1].body
            field = "max_completion_tokens" if change else "max_tokens"
            assert body[field] == 70 and body["messages"] == messages and body["tools"] == tools
            assert ("max_tokens" in body) is not change
    finally:
        await provider.aclose()
