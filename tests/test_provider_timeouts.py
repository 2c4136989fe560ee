"""A model server that goes silent (SPEC I3, C9, E5): its turn ends `failed` once the read
timeout (`LLM_READ_TIMEOUT`) passes, keeping what arrived, and the dialog goes on. The model
is the fake OpenAI-compatible server of `tests/fakemodel.py`, on a real socket."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from chatcore.engine.provider import OpenAIProvider
from chatcore.engine.provider_types import ProviderError
from chatcore.engine.turns.outcome import present_failure
from tests.engine_helpers import chat_group_of, history, make_dialog, send
from tests.fakemodel import Reply
from tests.test_provider_fidelity import finish

ROOT = Path(__file__).resolve().parent.parent


def test_the_model_timeouts_come_from_the_environment(tmp_path: Path) -> None:
    # covers: I3 (every network call has a timeout; the operator sets them: README)
    code = (
        "import django; django.setup(); from django.conf import settings; "
        "from chatcore.engine.provider import OpenAIProvider; "
        "t = OpenAIProvider.from_settings()._client.timeout; "
        "print(settings.LLM['READ_TIMEOUT'], t.read, t.connect, t.pool)"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "chatcore.settings",
        "CHAT_VAR_DIR": str(tmp_path),
        "LLM_BASE_URL": "http://127.0.0.1:9/v1",
        "LLM_READ_TIMEOUT": "7.5",
        "LLM_CONNECT_TIMEOUT": "2",
        "LLM_POOL_TIMEOUT": "0.25",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["7.5", "7.5", "2.0", "0.25"]


def test_the_default_timeouts_are_the_documented_ones(settings) -> None:
    # covers: I3 (README: LLM_READ_TIMEOUT 120, LLM_CONNECT_TIMEOUT 10, LLM_POOL_TIMEOUT 5)
    for name in ("LLM_READ_TIMEOUT", "LLM_CONNECT_TIMEOUT", "LLM_POOL_TIMEOUT"):
        assert name not in os.environ
    provider = OpenAIProvider.from_settings()
    assert provider._client.timeout == httpx.Timeout(120.0, connect=10.0, pool=5.0)
    readme = (ROOT / "README.md").read_text()
    assert "| `LLM_READ_TIMEOUT` |" in readme


@pytest.mark.django_db(transaction=True)
@pytest.mark.both_dbs
async def test_a_model_that_stops_mid_answer_fails_the_turn_after_the_read_timeout(
    make_engine, fake_model, recorder, user, settings
) -> None:
    # covers: I3, C9, C10, E5 (issue 49 item 3: a model server that stops sending mid-answer
    # ends the turn `failed` after LLM_READ_TIMEOUT, the part that arrived kept as a message
    # marked interrupted; the next send is answered)
    settings.LLM = {
        **settings.LLM,
        "BASE_URL": fake_model.url,
        "MODEL": "fake",
        "READ_TIMEOUT": 0.5,
        "RETRY_BASE_DELAY": 0.01,
    }
    engine = await make_engine(provider=OpenAIProvider.from_settings())
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    silent = threading.Event()  # never set while the turn runs: the model goes quiet
    fake_model.script(
        Reply(text="the first half ", chunk=5, gate=silent), Reply(text="a whole answer")
    )
    try:
        started = time.monotonic()
        ack = await send(engine, session, "tell me everything")
        done = await finish(rec, ack.turn_id)
        waited = time.monotonic() - started
        assert done["status"] == "failed"
        assert done["error"] == {
            "kind": "provider",
            "message": present_failure("provider", "timeout"),
        }
        assert 0.5 <= waited < 10, waited
        kept = [m for m in await history(session) if m.role == "assistant"]
        assert [(m.content, m.status) for m in kept] == [("the first half ", "interrupted")]
        assert len(fake_model.turn_requests()) == 1  # a started answer is not retried
        nxt = await send(engine, session, "try again")
        assert (await finish(rec, nxt.turn_id))["status"] == "completed"
        kept = [m for m in await history(session) if m.role == "assistant"]
        assert [m.content for m in kept] == ["the first half ", "a whole answer"]
    finally:
        silent.set()


async def test_a_model_silent_before_its_first_token_times_out_and_is_retried(
    fake_model,
) -> None:
    # covers: I3, E5 (no token yet: the read timeout is retried, then reported `timeout`)
    quiet = threading.Event()
    fake_model.script(*[Reply(text="late", first_token_gate=quiet) for _ in range(2)])
    provider = OpenAIProvider(
        base_url=fake_model.url, model="m", read_timeout=0.3, max_retries=1, retry_base_delay=0
    )
    try:
        with pytest.raises(ProviderError) as failed:
            async for _event in provider.stream(messages=[{"role": "user", "content": "hi"}]):
                pass
        assert failed.value.kind == "timeout"
        assert len(fake_model.requests) == 2
    finally:
        quiet.set()
        await provider.aclose()
