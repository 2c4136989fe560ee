"""Model provider fidelity (SPEC E5) against the fake OpenAI-compatible server: finish reasons
(`length`, `content_filter`) marked and shown, Continue, no empty assistant text stored or
replayed, mid-stream SSE errors classified and logged scrubbed, nested usage kept, the answer
token limit sent, and the words of a non-retryable failure."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chatcore.common.errors import NothingToContinue
from chatcore.engine.provider_errors import classify_stream_error
from chatcore.engine.turn_controls import CONTINUE_INSTRUCTION
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


async def test_every_request_of_a_dialog_carries_its_history_exactly_as_stored(
    make_engine, fake_model, recorder, user
):
    # covers: A5, E5, F7
    # A stored message's JSON is kept once built and joined into later requests' bodies: each
    # turn's request must still be the dialog as stored, text of any script, quotes and all.
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    said = ['über "quoted"\n\tnext line', "日本語のテキスト 😀", "back\\slash </script>"]
    answers_given = ["Antwort: ß", "答え 😀", 'a "reply"']
    fake_model.script(*[Reply(text=a) for a in answers_given])
    for text in said:
        ack = await send(engine, session, text)
        assert (await finish(rec, ack.turn_id))["status"] == "completed"
    requests = fake_model.turn_requests()
    assert model_view(requests[-1]) == [
        ("user", said[0]),
        ("assistant", answers_given[0]),
        ("user", said[1]),
        ("assistant", answers_given[1]),
        ("user", said[2]),
    ]
    # The first turns' requests were not changed by what came after them.
    assert model_view(requests[0]) == [("user", said[0])]
    assert model_view(requests[1])[:2] == [("user", said[0]), ("assistant", answers_given[0])]


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
