"""Tools (C8) and providers (E5): schemas from typed functions, extra tools from settings,
the demo provider's whole flow, usage recording and error classification."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import override_settings

from chatcore.engine.demo_provider import DemoProvider
from chatcore.engine.provider_errors import classify_http_error
from chatcore.engine.tools import Tool, ToolContext, current_time, registry_from_settings
from sessions_app.models import Turn
from tests.engine_helpers import chat_group_of, history, make_dialog, send
from tests.fakemodel import Reply
from tests.test_engine_turns import terminals


def test_schema_is_derived_from_type_hints_and_docstring():
    # covers: C8
    from tests.tools_extra import convert_temperature

    schema = Tool.from_function(convert_temperature).as_openai()["function"]
    assert schema["name"] == "convert_temperature"
    assert schema["description"] == "Convert a temperature between Celsius and Fahrenheit."
    props = schema["parameters"]["properties"]
    assert props["value"] == {"type": "number", "description": "the temperature to convert"}
    assert props["unit"]["enum"] == ["C", "F"]
    assert schema["parameters"]["required"] == ["value"]
    assert "ctx" not in props


def test_builtins_and_extra_tools_from_settings():
    # covers: C8
    with override_settings(
        CHAT={**settings.CHAT, "EXTRA_TOOLS": ["tests.tools_extra.convert_temperature"]}
    ):
        registry = registry_from_settings()
    assert {
        "current_time",
        "remember",
        "recall",
        "plan_update",
        "plan_read",
        "convert_temperature",
    } <= set(registry.names())


async def test_tool_arguments_are_validated():
    # covers: C8
    registry = registry_from_settings()
    ctx = ToolContext(owner_id=1, session_pk="x")
    ok, text = await registry.call("current_time", "not json", ctx)
    assert not ok and "invalid arguments" in text
    ok, text = await registry.call("current_time", '{"unexpected": 1}', ctx)
    assert not ok and "unexpected" in text
    assert current_time(ctx).endswith("UTC")


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (400, '{"error": {"code": "context_length_exceeded", "message": "x"}}', "context_overflow"),
        (
            400,
            '{"error": {"message": "This model\'s maximum context length is 8192 tokens"}}',
            "context_overflow",
        ),
        (413, '{"error": "prompt is too long"}', "context_overflow"),
        (401, '{"error": {"message": "bad key"}}', "auth"),
        (429, "{}", "rate_limited"),
        (502, "<html>bad gateway</html>", "server"),
        (400, '{"error": {"message": "bad param"}}', "bad_request"),
    ],
)
def test_http_errors_are_classified(status, body, kind):
    # covers: E5, C7
    assert classify_http_error(status, body).kind == kind


@pytest.mark.django_db(transaction=True)
async def test_demo_provider_runs_the_whole_flow_with_a_tool(make_engine, recorder, user):
    # covers: E5, C8
    engine = await make_engine(provider=DemoProvider(word_delay=0))
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    ack = await send(engine, session, "hello demo")
    done = await terminals(rec, [ack.turn_id])
    assert done[ack.turn_id]["status"] == "completed"
    rows = await history(session)
    assert [m.role for m in rows[1:]] == ["user", "assistant", "tool", "assistant"]
    assert rows[2].tool_calls[0]["function"]["name"] == "current_time"
    assert "[demo provider]" in rows[-1].content and "hello demo" in rows[-1].content


@pytest.mark.django_db(transaction=True)
async def test_usage_is_recorded_on_the_turn(make_engine, fake_model, recorder, user):
    # covers: E5
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(
        Reply(text="ok", usage={"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10})
    )
    ack = await send(engine, session, "count me")
    await terminals(rec, [ack.turn_id])
    turn = await sync_to_async(Turn.objects.get)(pk=ack.turn_id)
    assert turn.usage == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
