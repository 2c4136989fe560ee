"""The turn runner (`chatcore.engine.turns.runner`) on its own: the agent loop over the fake
model server with real tools, builder and database (C4, C7, C8, D1, E5)."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chatcore.engine.provider import OpenAIProvider
from chatcore.engine.sessions import SessionStates
from chatcore.engine.tools import Tool, ToolContext, ToolRegistry
from chatcore.engine.turns.builder import RuntimeInfo, TurnInputBuilder
from chatcore.engine.turns.outcome import Completed, Failed, FailureKind, Notice, PendingMessage
from chatcore.engine.turns.runner import TurnRunner, TurnSnapshot
from sessions_app import services
from sessions_app.models import MessageKind, MessageStatus, Role
from tests.fakemodel import Reply

pytestmark = [pytest.mark.django_db(transaction=True)]


def shout(ctx: ToolContext, text: str) -> str:
    """Say a text louder.

    Args:
        text: what to say
    """
    return text.upper()


async def _runner(
    fake_model: Any, user: Any, *, staged: list[list[PendingMessage]] | None = None, **kw: Any
) -> tuple[TurnRunner, Any]:
    session = await sync_to_async(services.session_create)(
        owner=user, channel="web", chat_id=f"u{user.pk}"
    )
    await sync_to_async(services.messages_append)(
        session_pk=session.pk,
        messages=[
            services.NewMessage(role=Role.USER, content="hello", kind=MessageKind.USER_INPUT)
        ],
    )
    provider = OpenAIProvider(
        base_url=fake_model.url, api_key="sk-test", model="fake", retry_base_delay=0.01
    )
    builder = TurnInputBuilder(states=SessionStates(), skills_dir="/none")
    runtime = RuntimeInfo(channel="web", dialog_id=session.dialog_id, title=session.title)
    batches = list(staged or [])

    async def fetch_staged() -> list[PendingMessage]:
        return batches.pop(0) if batches else []

    runner = TurnRunner(
        provider=provider,
        tools=ToolRegistry([Tool.from_function(shout)]),
        builder=builder,
        snapshot=TurnSnapshot(turn_id="t-1"),
        tool_context=ToolContext(owner_id=user.pk, session_pk=session.pk),
        fetch_staged=fetch_staged,
        runtime=runtime,
        session_pk=session.pk,
        max_steps=kw.pop("max_steps", 5),
        **kw,
    )
    prepared = await builder.prepare(session_pk=session.pk, runtime=runtime)
    return runner, prepared


async def test_a_plain_answer_streams_into_the_snapshot_and_completes(fake_model, user):
    # covers: D1, C8
    fake_model.script(Reply(text="hi there, friend", usage={"total_tokens": 9}))
    runner, prepared = await _runner(fake_model, user)
    outcome = await runner.run(prepared)
    assert isinstance(outcome, Completed) and outcome.notice == ""
    assert [(m.role, m.content) for m in outcome.messages] == [("assistant", "hi there, friend")]
    assert runner.snapshot.text == "hi there, friend"
    assert outcome.usage["total_tokens"] == 9


async def test_tool_calls_run_and_their_results_go_back_to_the_model(fake_model, user):
    # covers: C8
    fake_model.script(Reply(tool_calls=[("shout", {"text": "quiet"})]), Reply(text="done"))
    runner, prepared = await _runner(fake_model, user)
    outcome = await runner.run(prepared)
    assert isinstance(outcome, Completed)
    kinds = [(m.role, m.tool_name or "") for m in outcome.messages]
    assert kinds == [("assistant", ""), ("tool", "shout"), ("assistant", "")]
    assert outcome.messages[1].content == "QUIET"
    assert runner.snapshot.tools_dicts()[0]["status"] == "ok"
    second = fake_model.turn_requests()[-1].messages
    assert any(m["role"] == "tool" and m["content"] == "QUIET" for m in second)


async def test_a_steer_at_a_step_boundary_causes_one_more_step(fake_model, user):
    # covers: C4
    steer = PendingMessage(role=Role.USER, content="shorter please", kind=MessageKind.STEER)
    fake_model.script(Reply(text="a long answer"), Reply(text="short"))
    runner, prepared = await _runner(fake_model, user, staged=[[steer]])
    outcome = await runner.run(prepared)
    assert isinstance(outcome, Completed)
    assert [m.content for m in outcome.messages] == ["a long answer", "shorter please", "short"]
    assert len(fake_model.turn_requests()) == 2


async def test_a_cut_answer_is_marked_not_passed_off_as_whole(fake_model, user):
    # covers: E5
    fake_model.script(Reply(text="half of it", finish_reason="length"))
    runner, prepared = await _runner(fake_model, user)
    outcome = await runner.run(prepared)
    assert isinstance(outcome, Completed) and outcome.notice == Notice.TRUNCATED
    assert outcome.messages[-1].status == MessageStatus.TRUNCATED


async def test_a_provider_error_fails_the_turn_with_its_kind(fake_model, user):
    # covers: C10, E5
    fake_model.script(Reply(status=401, error={"message": "bad key sk-test"}))
    runner, prepared = await _runner(fake_model, user)
    outcome = await runner.run(prepared)
    assert isinstance(outcome, Failed)
    assert outcome.kind == FailureKind.PROVIDER and outcome.provider_kind == "auth"


async def test_the_last_step_offers_no_tools(fake_model, user):
    # covers: C8
    fake_model.script(Reply(tool_calls=[("shout", {"text": "x"})]), Reply(text="final"))
    runner, prepared = await _runner(fake_model, user, max_steps=2)
    outcome = await runner.run(prepared)
    assert isinstance(outcome, Completed)
    requests = fake_model.requests
    assert len(requests) == 2
    assert requests[0].body.get("tools") and not requests[1].body.get("tools")


async def test_closing_an_opened_request_frees_its_call_and_keeps_the_callers_cancel() -> None:
    # covers: C6, G6 (a first request sent before its runner, closed unread: the model call
    # ends, and a caller cancelled meanwhile, a shutdown, stays cancelled)
    import asyncio

    import httpx

    from chatcore.engine.turns.builder import PreparedInput
    from chatcore.engine.turns.runner import FirstRequest, OpenedRequest

    asked = asyncio.Event()
    released = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        asked.set()
        try:
            await asyncio.Event().wait()  # the model never answers
        finally:
            released.set()
        raise AssertionError("unreachable")

    provider = OpenAIProvider(
        base_url="http://model.test/v1", model="m", transport=httpx.MockTransport(handler)
    )
    messages = [{"role": "user", "content": "hi"}]
    prepared = PreparedInput(messages=messages, base_generation=0, estimated_tokens=1)
    opened = OpenedRequest(provider, prepared, FirstRequest(messages, None, 100))
    await asyncio.wait_for(asked.wait(), 5)
    closing = asyncio.ensure_future(opened.aclose())
    await asyncio.sleep(0)  # the close is under way, waiting for the read to end
    closing.cancel()
    await asyncio.wait([closing])
    assert closing.cancelled()
    await asyncio.wait_for(released.wait(), 5)
    assert opened.taken
    await provider.aclose()
