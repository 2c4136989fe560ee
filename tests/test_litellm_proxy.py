"""Compatibility with a real third-party gateway (SPEC E5): the LiteLLM proxy, started on
loopback from tests/litellm_proxy/config.yaml, in front of a scripted model that streams
through LiteLLM's own wrapper (tool calls with split arguments, `length`, `content_filter`,
a mid-stream error) and a `mock_response` model. No network is used: the proxy runs without
a database, telemetry or the remote model-cost map.

Marked `litellm`: CI runs it; skip it locally with `-m "not litellm"`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.conf import settings
from django.test import override_settings

from chatcore.engine.provider import OpenAIProvider
from chatcore.engine.turns.outcome import FailureKind, present_failure
from tests.conftest import IN_CI
from tests.engine_helpers import chat_group_of, history, make_dialog, send, turn
from tests.procs import free_port

pytestmark = [pytest.mark.litellm, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PROXY_DIR = Path(__file__).resolve().parent / "litellm_proxy"
MASTER_KEY = "sk-chatcore-proxy-test"
UPSTREAM_SECRET = "sk-upstream-secret-0123456789"


def _litellm_cli() -> str:
    cli = Path(sys.executable).with_name("litellm")
    if not cli.exists():
        reason = "the LiteLLM proxy is not installed (pip install -e '.[dev]')"
        if IN_CI:
            pytest.fail(reason + " (CI must run it)")
        pytest.skip(reason)
    return str(cli)


@pytest.fixture(scope="module")
def litellm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("litellm") / "proxy.log"
    env = {
        **os.environ,
        # Offline: the bundled model-cost map, no telemetry, no database.
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOG": "ERROR",
        "NO_DOCKER": "True",
    }
    for name in ("DATABASE_URL", "REDIS_URL", "LITELLM_MASTER_KEY"):
        env.pop(name, None)
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [_litellm_cli(), "--config", "config.yaml", "--host", "127.0.0.1", "--port", str(port)],
            cwd=PROXY_DIR,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the LiteLLM proxy exited:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health/liveliness", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the LiteLLM proxy did not start:\n{log_path.read_text()}")
            time.sleep(0.3)
        yield f"{url}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture
async def gateway(make_engine: Any, litellm_url: str) -> Any:
    async def start(model: str = "scripted", **kwargs: Any) -> Any:
        provider = OpenAIProvider(
            base_url=litellm_url,
            api_key=MASTER_KEY,
            model=model,
            retry_base_delay=0.01,
            max_retries=0,
            **kwargs,
        )
        return await make_engine(provider=provider)

    return start


async def run(engine: Any, session: Any, rec: Any, text: str) -> dict[str, Any]:
    ack = await send(engine, session, text)
    return await rec.terminal(ack.turn_id, timeout=60)


def answers(rows: list[Any]) -> list[Any]:
    return [m for m in rows if m.role == "assistant"]


async def test_tool_calls_with_split_arguments_and_null_content(gateway, recorder, user):
    # covers: E5, C8
    engine = await gateway()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    done = await run(engine, session, rec, "[tool] what time is it?")
    assert done["status"] == "completed", done
    rows = await history(session)
    call = next(m for m in rows if m.tool_calls)
    assert call.tool_calls[0]["function"] == {"name": "current_time", "arguments": "{}"}
    assert call.content == ""
    assert any(m.role == "tool" and m.tool_call_id == "call_lite_1" for m in rows)
    assert rows[-1].content.startswith("The tool said: ")
    # The tool-call message is replayed with `content: null`; the gateway takes it.
    done = await run(engine, session, rec, "thanks")
    assert done["status"] == "completed", done
    assert answers(await history(session))[-1].content == "echo: thanks"


async def test_length_stop_is_truncated_and_continue_goes_on(gateway, recorder, user):
    # covers: E5
    engine = await gateway()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    done = await run(engine, session, rec, "[length] a long story")
    assert done["status"] == "completed" and done["notice"]["kind"] == "truncated"
    cut = answers(await history(session))[-1]
    assert (cut.content, cut.status) == ("This answer runs until the limit", "truncated")
    ack = await engine.continue_answer(session, owner=user)
    done = await rec.terminal(ack.turn_id, timeout=60)
    assert done["status"] == "completed" and "notice" not in done
    rest = answers(await history(session))[-1]
    assert rest.content == " and this is the rest."
    assert rest.source["continues"] == str(cut.pk)


async def test_content_filter_commits_no_empty_answer(gateway, recorder, user):
    # covers: E5
    engine = await gateway()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    done = await run(engine, session, rec, "[filter] something")
    assert done["status"] == "completed" and done["notice"]["kind"] == "filtered"
    assert answers(await history(session)) == []


async def test_mid_stream_error_is_classified_and_logged_scrubbed(gateway, recorder, user, caplog):
    # covers: E5, F4
    caplog.set_level(logging.WARNING, logger="chatcore.engine.provider")
    engine = await gateway()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    done = await run(engine, session, rec, "[error] go")
    assert done["status"] == "failed"
    assert done["error"]["message"] == present_failure(FailureKind.PROVIDER, "rate_limited")
    partial = answers(await history(session))[-1]
    assert (partial.content, partial.status) == ("Half an answer", "interrupted")
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "mid-stream" in logged and "throttling_error" in logged
    assert UPSTREAM_SECRET not in logged


async def test_usage_details_and_the_answer_token_limit(gateway, recorder, user):
    # covers: E5
    engine = await gateway(max_tokens_param="max_completion_tokens")
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    with override_settings(LLM={**settings.LLM, "MAX_TOKENS": 77}):
        ack = await send(engine, session, "[max] how many?")
        done = await rec.terminal(ack.turn_id, timeout=60)
    assert done["status"] == "completed"
    assert answers(await history(session))[-1].content == "limit=77"
    usage = (await turn(ack.turn_id)).usage
    assert usage["total_tokens"] == 17
    assert usage["completion_tokens_details"]["text_tokens"] == 5


async def test_mock_response_model(gateway, recorder, user):
    # covers: E5
    engine = await gateway(model="mocked")
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    done = await run(engine, session, rec, "hello")
    assert done["status"] == "completed"
    assert answers(await history(session))[-1].content == "A mock answer from the gateway."


async def test_the_model_list_and_a_dialogs_model_through_the_gateway(gateway, recorder, user):
    # covers: H4, E5
    from chatcore.engine.dialog_settings import dialog_settings_update

    with override_settings(LLM={**settings.LLM, "API_KEY": MASTER_KEY, "MODELS": []}):
        engine = await gateway()
    ids = await engine.models.aids()
    assert ids[0] == "scripted" and set(ids) == {"scripted", "mocked"}
    session = await make_dialog(user)
    await dialog_settings_update(engine=engine, session=session, model="mocked")
    session = await type(session).objects.select_related("owner").aget(pk=session.pk)
    assert session.model == "mocked"
    rec = await recorder(chat_group_of(session))
    done = await run(engine, session, rec, "hello")
    assert done["status"] == "completed"
    assert answers(await history(session))[-1].content == "A mock answer from the gateway."
