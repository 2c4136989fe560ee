"""Model provider fidelity (SPEC E5) against the fake OpenAI-compatible server: finish reasons
(`length`, `content_filter`) marked and shown, Continue, no empty assistant text stored or
replayed, mid-stream SSE errors classified and logged scrubbed, nested usage kept, the answer
token limit sent, and the words of a non-retryable failure."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import cache
from django.test import override_settings
from django.utils import translation

from chatcore.common.errors import NothingToContinue
from chatcore.engine.provider import OpenAIProvider
from chatcore.engine.provider_errors import ANSWER_TOKEN_MARGIN, classify_stream_error
from chatcore.engine.turns.builder import CONTINUE_INSTRUCTION
from chatcore.engine.turns.outcome import FailureKind, present_failure
from sessions_app import services
from sessions_app.models import MessageKind, Role
from tests.engine_helpers import chat_group_of, history, make_dialog, send, turn
from tests.fakemodel import RecordedRequest, Reply, strip_runtime

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


async def finish(rec: Any, turn_id: str) -> dict[str, Any]:
    return await rec.terminal(turn_id, timeout=20)


def answers(rows: list[Any]) -> list[Any]:
    return [m for m in rows if m.role == "assistant"]


def model_view(request: RecordedRequest) -> list[tuple[str, Any]]:
    """What the model was shown, without the system prompt and the runtime block."""
    out = []
    for m in request.messages[1:]:
        content = m["content"]
        if m["role"] == "user":
            content = strip_runtime(content)
        out.append((m["role"], content))
    return out


# --- 1. finish_reason honoured ---------------------------------------------------------------


async def test_length_stop_is_committed_truncated_with_a_notice(
    make_engine, fake_model, recorder, user
):
    # covers: E5
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="The first half of a long", finish_reason="length"))
    ack = await send(engine, session, "write a long essay")
    frames = await rec.until(lambda f: f["type"] == "turn_updated", 20)
    done = frames[-1]
    assert done["status"] == "completed"
    assert done["reason"] == "truncated"
    assert done["notice"]["kind"] == "truncated"
    assert "length limit" in done["notice"]["message"]
    committed = [f for f in frames if f["type"] == "history_delta"][-1]["messages"]
    assert committed[-1]["status"] == "truncated"
    assert committed[-1]["content"] == "The first half of a long"
    rows = answers(await history(session))
    assert [(m.content, m.status) for m in rows] == [("The first half of a long", "truncated")]
    row = await turn(ack.turn_id)
    assert (row.status, row.reason) == ("completed", "truncated")


async def test_content_filter_with_no_text_commits_no_empty_message(
    make_engine, fake_model, recorder, user
):
    # covers: E5
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="", finish_reason="content_filter"))
    ack = await send(engine, session, "something the filter dislikes")
    done = await finish(rec, ack.turn_id)
    assert done["status"] == "completed"
    assert done["notice"] == {
        "kind": "filtered",
        "message": "The model's content filter stopped the answer.",
    }
    assert answers(await history(session)) == []


async def test_content_filter_after_some_text_keeps_it_marked_filtered(
    make_engine, fake_model, recorder, user
):
    # covers: E5
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="Here is how one", finish_reason="content_filter"))
    ack = await send(engine, session, "tell me")
    done = await finish(rec, ack.turn_id)
    assert done["reason"] == "filtered"
    rows = answers(await history(session))
    assert [(m.content, m.status) for m in rows] == [("Here is how one", "filtered")]


async def test_length_stop_with_cut_tool_calls_runs_no_tool(
    make_engine, fake_model, recorder, user
):
    # covers: E5, C8
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(
        Reply(text="Let me check", tool_calls=[("current_time", {})], finish_reason="length")
    )
    ack = await send(engine, session, "what time is it")
    done = await finish(rec, ack.turn_id)
    assert done["reason"] == "truncated"
    rows = await history(session)
    assert not [m for m in rows if m.role == "tool" or m.tool_calls]
    assert len(fake_model.turn_requests()) == 1


async def test_continue_appends_to_the_cut_answer_and_is_replayed_joined(
    make_engine, fake_model, recorder, user
):
    # covers: E5, B5
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="Roses are red, violets", finish_reason="length"))
    first = await send(engine, session, "a poem please")
    await finish(rec, first.turn_id)
    cut = answers(await history(session))[-1]

    fake_model.script(Reply(text=" are blue."))
    ack = await engine.continue_answer(session, owner=user, client_msg_id="c-1")
    assert ack.mode == "continue" and ack.frame()["mode"] == "continue"
    done = await finish(rec, ack.turn_id)
    assert done["status"] == "completed" and "notice" not in done
    request = fake_model.requests[-1]
    # One text step: no tools offered; the cut answer, then the instruction to go on.
    assert not request.body.get("tools")
    assert model_view(request)[-2:] == [
        ("assistant", "Roses are red, violets"),
        ("user", CONTINUE_INSTRUCTION),
    ]
    rows = await history(session)
    # No user message for the continuation; the cut message is not rewritten (B5).
    assert [m.role for m in rows[1:]] == ["user", "assistant", "assistant"]
    assert rows[-2].content == "Roses are red, violets" and rows[-2].status == "truncated"
    assert rows[-1].content == " are blue." and rows[-1].status == ""
    assert rows[-1].source["continues"] == str(cut.pk)
    assert (await turn(ack.turn_id)).mode == "continue"

    # The next turn sees one joined answer, and no instruction.
    fake_model.script(Reply(text="Thanks!"))
    nxt = await send(engine, session, "nice")
    await finish(rec, nxt.turn_id)
    assert model_view(fake_model.turn_requests()[-1]) == [
        ("user", "a poem please"),
        ("assistant", "Roses are red, violets are blue."),
        ("user", "nice"),
    ]


async def test_a_cut_continuation_can_be_continued_again(make_engine, fake_model, recorder, user):
    # covers: E5
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(
        Reply(text="one, ", finish_reason="length"),
        Reply(text="two, ", finish_reason="length"),
        Reply(text="three."),
    )
    first = await send(engine, session, "count")
    await finish(rec, first.turn_id)
    second = await engine.continue_answer(session, owner=user)
    assert (await finish(rec, second.turn_id))["reason"] == "truncated"
    third = await engine.continue_answer(session, owner=user)
    await finish(rec, third.turn_id)
    assert model_view(fake_model.requests[-1])[-2][1] == "one, two, "
    rows = answers(await history(session))
    assert [m.content for m in rows] == ["one, ", "two, ", "three."]
    assert rows[2].source["continues"] == str(rows[1].pk)
    with pytest.raises(NothingToContinue):
        await engine.continue_answer(session, owner=user)


async def test_a_failed_continuation_is_retried_as_a_continuation(
    make_engine, fake_model, recorder, user
):
    # covers: E5, C6
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="Once upon a", finish_reason="length"))
    first = await send(engine, session, "story")
    await finish(rec, first.turn_id)
    cut = answers(await history(session))[-1]
    fake_model.script(*[Reply(status=500)] * 4)  # the first try and its three retries
    failed = await engine.continue_answer(session, owner=user)
    assert (await finish(rec, failed.turn_id))["status"] == "failed"
    fake_model.script(Reply(text=" time."))
    again = await engine.retry(session, owner=user)
    await finish(rec, again.turn_id)
    assert model_view(fake_model.requests[-1])[-2:] == [
        ("assistant", "Once upon a"),
        ("user", CONTINUE_INSTRUCTION),
    ]
    rows = answers(await history(session))
    assert [m.content for m in rows] == ["Once upon a", " time."]
    assert rows[-1].source["continues"] == str(cut.pk)


async def test_nothing_to_continue_after_a_whole_answer(make_engine, fake_model, recorder, user):
    # covers: E5
    engine = await make_engine()
    session = await make_dialog(user)
    with pytest.raises(NothingToContinue):
        await engine.continue_answer(session, owner=user)
    rec = await recorder(chat_group_of(session))
    ack = await send(engine, session, "hi")
    await finish(rec, ack.turn_id)
    with pytest.raises(NothingToContinue):
        await engine.continue_answer(session, owner=user)
    assert len(await history(session)) == 3  # welcome, user, answer: nothing added


# --- 2. no empty assistant text; null content beside tool calls -----------------------------


async def test_tool_call_messages_carry_null_content_and_empty_answers_are_not_stored(
    make_engine, fake_model, recorder, user
):
    # covers: E5, C8
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(tool_calls=[("current_time", {})]), Reply(text=""))
    ack = await send(engine, session, "time?")
    done = await finish(rec, ack.turn_id)
    assert done["status"] == "completed"
    assert done["notice"]["kind"] == "empty"
    rows = answers(await history(session))
    assert len(rows) == 1 and rows[0].tool_calls  # the call, but no empty final answer
    second = fake_model.turn_requests()[1].messages
    call = next(m for m in second if m.get("tool_calls"))
    assert call["content"] is None

    fake_model.script(Reply(text="ok"))
    nxt = await send(engine, session, "again")
    await finish(rec, nxt.turn_id)
    replay = fake_model.turn_requests()[-1].messages
    assert all(m["content"] for m in replay if m["role"] == "assistant" and not m.get("tool_calls"))
    assert next(m for m in replay if m.get("tool_calls"))["content"] is None


async def test_a_stop_after_only_whitespace_stores_no_partial(
    make_engine, fake_model, recorder, user
):
    # covers: E5, C6
    import threading

    from chatcore.common import publish

    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session), publish.session_group(session.pk))
    gate = threading.Event()
    fake_model.script(Reply(text="\n\n", gate=gate))
    ack = await send(engine, session, "hm")
    await rec.until(lambda f: f["type"] == "turn_snapshot" and f["text"] == "\n\n")
    await engine.stop(session)
    done = await finish(rec, ack.turn_id)
    gate.set()
    assert done["status"] == "cancelled"
    assert answers(await history(session)) == []


async def test_empty_assistant_text_stored_earlier_is_never_replayed(
    make_engine, fake_model, recorder, user
):
    # covers: E5
    engine = await make_engine()
    session = await make_dialog(user)
    await sync_to_async(services.messages_append)(
        session_pk=session.pk,
        session=session,
        messages=[
            services.NewMessage(
                role=Role.USER, content="old question", kind=MessageKind.USER_INPUT
            ),
            services.NewMessage(role=Role.ASSISTANT, content="", kind=MessageKind.ASSISTANT),
            services.NewMessage(role=Role.ASSISTANT, content="  \n", kind=MessageKind.ASSISTANT),
        ],
    )
    rec = await recorder(chat_group_of(session))
    ack = await send(engine, session, "new question")
    await finish(rec, ack.turn_id)
    assert model_view(fake_model.turn_requests()[-1]) == [
        ("user", "old question"),
        ("user", "new question"),
    ]


# --- 3. mid-stream SSE error chunks -------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ({"code": "rate_limit_exceeded", "message": "slow down"}, "rate_limited"),
        ({"type": "RateLimitError", "code": "429", "message": "x"}, "rate_limited"),
        ({"code": 429, "message": "x"}, "rate_limited"),
        ({"code": "invalid_api_key", "message": "x"}, "auth"),
        ({"code": "context_length_exceeded", "message": "x"}, "context_overflow"),
        ({"type": "server_error", "message": "x"}, "server"),
        ({"code": "503", "message": "overloaded"}, "server"),
        ({"code": "content_filter", "message": "x"}, "content_filter"),
        ({"code": "invalid_request_error", "message": "x"}, "bad_request"),
        ({"message": "something broke"}, "server"),
        ("a bare string", "server"),
    ],
)
def test_stream_error_chunks_are_classified_by_their_code(error: Any, kind: str) -> None:
    # covers: E5
    assert classify_stream_error({"error": error}).kind == kind


async def test_mid_stream_error_is_logged_scrubbed_and_classified(
    make_engine, fake_model, recorder, user, caplog
):
    # covers: E5, F4, C10
    caplog.set_level(logging.WARNING, logger="chatcore.engine.provider")
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    secret = "sk-live-abcdef0123456789"
    fake_model.script(
        Reply(
            text="Half an ans",
            stream_error={
                "code": "rate_limit_exceeded",
                "message": f"Rate limit reached for key {secret}",
            },
        )
    )
    ack = await send(engine, session, "hi")
    done = await finish(rec, ack.turn_id)
    assert done["status"] == "failed"
    assert done["error"]["kind"] == "provider"
    assert done["error"]["message"] == present_failure(FailureKind.PROVIDER, "rate_limited")
    # After the first token it is not retried; the partial is kept, marked interrupted.
    assert len(fake_model.turn_requests()) == 1
    assert [(m.content, m.status) for m in answers(await history(session))] == [
        ("Half an ans", "interrupted")
    ]
    logged = [r.getMessage() for r in caplog.records if "mid-stream" in r.getMessage()]
    assert logged and "rate_limit_exceeded" in logged[0]
    assert secret not in "\n".join(r.getMessage() for r in caplog.records)


async def test_rate_limit_error_chunk_before_any_text_is_retried(
    make_engine, fake_model, recorder, user
):
    # covers: E5
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(
        Reply(stream_error={"code": "rate_limit_exceeded", "message": "busy"}),
        Reply(text="second try"),
    )
    ack = await send(engine, session, "hi")
    done = await finish(rec, ack.turn_id)
    assert done["status"] == "completed"
    assert len(fake_model.turn_requests()) == 2
    assert answers(await history(session))[-1].content == "second try"


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
    from tests.test_api import bearer_api, error_of

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
    from tests.test_ws_consumer import WS, bearer, open_ws

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

    from tests.test_api import BASE, bearer_api, read_stream

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
