"""Model choice, a dialog's own instructions and what its answers cost (SPEC H4, PROTOCOL
"Models and dialog settings"): the list from the model server and its cache, `PATCH` and the
WebSocket `settings` frame, the model and system prompt a turn sends, per-model context
windows, `/new` keeping the model, and usage in `/info` and the REST API."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from chatcore.engine import jobs
from chatcore.engine.model_catalog import ModelCatalog, UnknownModel
from chatcore.engine.turns.builder import SYSTEM_PROMPT
from sessions_app.models import Session
from tests.api_helpers import Api, error_of
from tests.fakemodel import FakeModelServer, Reply

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]

PIRATE = "Answer like a pirate, and keep it short."


@pytest.fixture(autouse=True)
def _model_server_settings(settings: Any, fake_model: FakeModelServer) -> None:
    """The settings name the fake server and its model, as a deployment's would."""
    settings.LLM = {**settings.LLM, "BASE_URL": fake_model.url, "MODEL": "fake"}
    fake_model.models = ["fake", "big-model", "small-model"]


def turn_bodies(fake_model: FakeModelServer) -> list[dict[str, Any]]:
    return [r.body for r in fake_model.turn_requests()]


# --- The list ------------------------------------------------------------------------------


async def test_the_list_comes_from_the_model_server_and_is_asked_once_in_five_minutes(
    api: Api, fake_model: FakeModelServer
) -> None:
    # covers: H4
    status, data = await api.get("/models")
    assert status == 200, data
    assert data == {
        "items": [{"id": "fake"}, {"id": "big-model"}, {"id": "small-model"}],
        "default": "fake",
    }
    fake_model.models = ["fake", "another"]
    for _ in range(3):
        status, again = await api.get("/models")
        assert again == data
    assert fake_model.models_calls == 1


def test_the_cache_refreshes_after_five_minutes_and_keeps_its_list_when_the_server_fails(
    fake_model: FakeModelServer, caplog: pytest.LogCaptureFixture
) -> None:
    # covers: H4, I3
    now = [1000.0]
    catalog = ModelCatalog(
        base_url=fake_model.url, default="fake", timeout=2.0, clock=lambda: now[0]
    )
    assert catalog.ids() == ["fake", "big-model", "small-model"]
    fake_model.models = ["fake", "new-model"]
    now[0] += 299
    assert catalog.ids() == ["fake", "big-model", "small-model"]
    now[0] += 2
    assert catalog.ids() == ["fake", "new-model"]
    assert fake_model.models_calls == 2
    fake_model.models_status = 500
    now[0] += 301
    with caplog.at_level(logging.WARNING, logger="chatcore.engine.model_catalog"):
        assert catalog.ids() == ["fake", "new-model"]
    assert "could not list the model server's models" in caplog.text
    assert fake_model.models_calls == 3


def test_llm_models_narrows_the_list_and_the_default_is_always_offered(
    fake_model: FakeModelServer,
) -> None:
    # covers: H4
    catalog = ModelCatalog(
        base_url=fake_model.url, default="fake", narrow=["small-model", "not-served"]
    )
    assert catalog.ids() == ["fake", "small-model"]
    with pytest.raises(UnknownModel) as refused:
        catalog.check("big-model", catalog.ids())
    assert "LLM_MODELS" in refused.value.message
    # A server that never answered: what the settings name.
    dead = ModelCatalog(
        base_url="http://127.0.0.1:9/v1",
        default="fake",
        narrow=["small-model"],
        transport=httpx.MockTransport(lambda request: httpx.Response(503)),
    )
    assert dead.ids() == ["fake", "small-model"]
    demo = ModelCatalog(base_url=None, default="demo")
    assert demo.listing(demo.ids()) == {"items": [{"id": "demo"}], "default": "demo"}


# --- Settings through REST and what a turn sends --------------------------------------------


async def test_a_dialogs_model_and_system_prompt_go_into_its_turns_and_no_other(
    api: Api, fake_model: FakeModelServer
) -> None:
    # covers: H4
    chosen = await api.create(dialog_id="pirate")
    other = await api.create(dialog_id="plain")
    status, data = await api.patch(
        f"/sessions/{chosen['session_id']}", {"model": "big-model", "system_prompt": PIRATE}
    )
    assert status == 200, data
    assert (data["model"], data["system_prompt"], data["title"]) == (
        "big-model",
        PIRATE,
        chosen["title"],
    )
    ack = await api.send(chosen["session_id"], "hello")
    assert (await api.turn_done(ack["turn_id"]))["status"] == "completed"
    ack = await api.send(other["session_id"], "hello too")
    assert (await api.turn_done(ack["turn_id"]))["status"] == "completed"

    first, second = turn_bodies(fake_model)
    assert first["model"] == "big-model"
    system = first["messages"][0]
    assert system["role"] == "system"
    assert system["content"].startswith(SYSTEM_PROMPT)
    assert system["content"].index(SYSTEM_PROMPT) < system["content"].index(PIRATE)
    assert second["model"] == "fake"
    assert PIRATE not in second["messages"][0]["content"]

    _, listed = await api.get("/sessions", channel="api")
    models = {item["dialog_id"]: item["model"] for item in listed["items"]}
    assert models == {"pirate": "big-model", "plain": "fake"}
    # The fake reports 10 prompt and 5 completion tokens per answer.
    assert [item["usage"] for item in listed["items"]] == [
        {"prompt_tokens": 10, "completion_tokens": 5, "cached_tokens": 0, "turns": 1}
    ] * 2

    # Empty clears the instructions; the model stays.
    status, data = await api.patch(f"/sessions/{chosen['session_id']}", {"system_prompt": ""})
    assert (status, data["system_prompt"], data["model"]) == (200, "", "big-model")


async def test_titles_keep_the_default_model(
    api: Api, fake_model: FakeModelServer, engine: Any
) -> None:
    # covers: H4, B4
    s = await api.create(dialog_id="titled")
    await api.patch(f"/sessions/{s['session_id']}", {"model": "small-model"})
    ack = await api.send(s["session_id"], "a question worth a title")
    await api.turn_done(ack["turn_id"])
    row = await Session.objects.aget(dialog_id="titled")
    fake_model.script(Reply(text="Pirate talk"))
    assert await jobs.generate_title(session_pk=row.pk, provider=engine.provider) == "Pirate talk"
    titles = [r.body for r in fake_model.requests if not r.body.get("tools")]
    assert titles and {body["model"] for body in titles} == {"fake"}
    assert {body["model"] for body in turn_bodies(fake_model)} == {"small-model"}


async def test_an_unknown_model_or_a_too_long_prompt_is_refused_and_changes_nothing(
    api: Api,
) -> None:
    # covers: H4
    s = await api.create(dialog_id="strict")
    path = f"/sessions/{s['session_id']}"
    status, data = await api.patch(path, {"model": "gpt-17", "system_prompt": PIRATE})
    error_of(status, data, 400, "bad_request")
    assert "gpt-17" in data["message"] and "/models" in data["message"]
    status, data = await api.patch(path, {"system_prompt": "x" * 20_001})
    error_of(status, data, 422, "bad_request")
    status, data = await api.patch(path, {"system_prompt": "x" * 20_000})
    assert status == 200 and len(data["system_prompt"]) == 20_000
    await api.patch(path, {"system_prompt": ""})
    row = await Session.objects.aget(dialog_id="strict")
    assert (row.model, row.system_prompt) == ("", "")
    status, data = await api.get(path)
    assert (data["model"], data["system_prompt"]) == ("fake", "")


async def test_a_models_own_context_window_trims_its_dialogs(
    api: Api, fake_model: FakeModelServer, settings: Any
) -> None:
    # covers: H4, C7
    settings.LLM = {**settings.LLM, "CONTEXT_WINDOWS": {"small-model": 2000}}
    small = await api.create(dialog_id="small")
    large = await api.create(dialog_id="large")
    await api.patch(f"/sessions/{small['session_id']}", {"model": "small-model"})
    for s in (small, large):
        for i in range(4):
            ack = await api.send(s["session_id"], f"message {i} " + "words " * 300)
            await api.turn_done(ack["turn_id"])
    bodies = turn_bodies(fake_model)
    small_last, large_last = bodies[3], bodies[7]
    assert small_last["model"] == "small-model"
    assert len(small_last["messages"]) < len(large_last["messages"])
    assert small_last["max_tokens"] < 2000 < large_last["max_tokens"]


async def test_each_dialog_is_counted_with_its_own_model_s_tokenizer(
    api: Api, fake_model: FakeModelServer, settings: Any
) -> None:
    # covers: H4, C7. The default model ("fake") has no BPE tables here; a dialog on gpt-4o
    # is counted with o200k's, which reads "words words ..." as one token a word where the
    # heuristic reads 1.5. The same input then leaves that dialog more room for its answer.
    settings.LLM = {**settings.LLM, "CONTEXT_WINDOWS": {"gpt-4o": 16_000, "small-model": 16_000}}
    fake_model.models = ["fake", "gpt-4o", "small-model"]
    bpe = await api.create(dialog_id="bpe")
    guessed = await api.create(dialog_id="guessed")
    for s, model in ((bpe, "gpt-4o"), (guessed, "small-model")):
        await api.patch(f"/sessions/{s['session_id']}", {"model": model})
        ack = await api.send(s["session_id"], "words " * 2000)
        await api.turn_done(ack["turn_id"])
    by_model = {body["model"]: body for body in turn_bodies(fake_model)}
    # 2,000 words: about 2,000 tokens by o200k, 3,000 by the heuristic; with a quarter spare.
    room = by_model["gpt-4o"]["max_tokens"] - by_model["small-model"]["max_tokens"]
    assert 1000 <= room <= 1500, room


# --- The WebSocket `settings` frame and slash commands ----------------------------------------


async def test_the_settings_frame_is_answered_by_session_updated(
    connect: Any, user: Any, fake_model: FakeModelServer
) -> None:
    # covers: H4
    ws = await connect(user)
    other = await connect(user)
    # PROTOCOL "Close codes and added fields": the connect frames carry the settings.
    assert [item["model"] for item in ws.sessions["items"]] == ["fake"]
    assert (ws.history["model"], ws.history["system_prompt"]) == ("fake", "")
    answer = await ws.ask(
        {"type": "settings", "model": "small-model", "system_prompt": PIRATE, "client_msg_id": "s1"}
    )
    assert answer["type"] == "session_updated", answer
    assert (answer["model"], answer["system_prompt"]) == ("small-model", PIRATE)
    assert answer["dialog_id"] == ws.history["dialog_id"]
    heard = await other.until(lambda f: f["type"] == "session_updated")
    assert heard[-1]["model"] == "small-model"
    # Not sent twice to the connection that asked.
    assert not [f for f in await ws.drain() if f["type"] == "session_updated"]

    refused = await ws.ask({"type": "settings", "model": "nope", "client_msg_id": "s2"})
    assert (refused["type"], refused["code"]) == ("error", "bad_request")
    refused = await ws.ask({"type": "settings", "client_msg_id": "s3"})
    assert refused["type"] == "error"

    await ws.send({"type": "send", "content": "ahoy", "client_msg_id": "m1"})
    await ws.until(lambda f: f["type"] == "turn_updated")
    body = turn_bodies(fake_model)[-1]
    assert body["model"] == "small-model" and PIRATE in body["messages"][0]["content"]


async def test_new_keeps_the_model_and_info_shows_it_with_the_usage(
    connect: Any, user: Any, fake_model: FakeModelServer, api: Api
) -> None:
    # covers: H4, B3
    ws = await connect(user)
    await ws.ask({"type": "settings", "model": "big-model", "client_msg_id": "s1"})
    fake_model.script(
        Reply(
            text="ahoy",
            usage={
                "prompt_tokens": 1200,
                "completion_tokens": 34,
                "total_tokens": 1234,
                "prompt_tokens_details": {"cached_tokens": 1024},
            },
        )
    )
    await ws.send({"type": "send", "content": "hello", "client_msg_id": "m1"})
    done = (await ws.until(lambda f: f["type"] == "turn_updated"))[-1]
    info = await ws.ask({"type": "send", "content": "/info", "client_msg_id": "i1"})
    assert info["type"] == "command_result" and info["ok"], info
    assert "Model: big-model" in info["content"]
    assert "1200 prompt (1024 cached), 34 completion in 1 answers" in info["content"]

    status, turn = await api.get(f"/turns/{done['turn_id']}")
    assert status == 200, turn
    assert turn["usage"] == {"prompt_tokens": 1200, "completion_tokens": 34, "cached_tokens": 1024}
    assert turn["model"] == "big-model"
    status, state = await api.get(f"/sessions/{ws.history['session_id']}")
    assert status == 200, state
    assert state["usage"] == {
        "prompt_tokens": 1200,
        "completion_tokens": 34,
        "cached_tokens": 1024,
        "turns": 1,
    }

    await ws.send({"type": "send", "content": "/new", "client_msg_id": "n1"})
    history = (await ws.until(lambda f: f["type"] == "session_history"))[-1]
    assert history["dialog_id"] != ws.history["dialog_id"]
    assert history["model"] == "big-model"
    row = await Session.objects.aget(dialog_id=history["dialog_id"], owner=user)
    assert row.model == "big-model"


# --- In both languages ----------------------------------------------------------------------


def test_the_settings_strings_of_the_web_chat_are_translated() -> None:
    # covers: H4, F5
    from django.utils import translation

    from sessions_app.web_settings import settings_strings

    english = settings_strings()
    with translation.override("zh-hans"):
        chinese = settings_strings()
        refusal = ModelCatalog(base_url=None, default="demo")
        with pytest.raises(UnknownModel) as refused:
            refusal.check("gpt-17", refusal.ids())
    assert chinese.keys() == english.keys()
    assert [key for key in english if chinese[key] == english[key]] == []
    assert "未知模型 gpt-17" in refused.value.message


def test_llm_context_windows_reads_name_equals_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    # covers: H4
    from chatcore.settings import _env_windows

    monkeypatch.setenv("LLM_CONTEXT_WINDOWS", "gpt-4o=128000, org/llama-3:8b=8192")
    assert _env_windows("LLM_CONTEXT_WINDOWS") == {"gpt-4o": 128000, "org/llama-3:8b": 8192}
    monkeypatch.setenv("LLM_CONTEXT_WINDOWS", "gpt-4o:128000")
    with pytest.raises(ValueError, match="name=tokens"):
        _env_windows("LLM_CONTEXT_WINDOWS")


async def test_the_model_command_lists_and_chooses(
    connect: Any, user: Any, fake_model: FakeModelServer
) -> None:
    # covers: H4, B3
    ws = await connect(user)
    listed = await ws.ask({"type": "send", "content": "/model", "client_msg_id": "l1"})
    assert listed["type"] == "command_result" and listed["ok"], listed
    assert listed["content"].splitlines()[1:] == ["* fake", "- big-model", "- small-model"]
    chosen = await ws.ask({"type": "send", "content": "/model big-model", "client_msg_id": "c1"})
    assert chosen["content"] == "This dialog now uses big-model."
    updated = await ws.until(lambda f: f["type"] == "session_updated")
    assert updated[-1]["model"] == "big-model"
    refused = await ws.ask({"type": "send", "content": "/model nope", "client_msg_id": "c2"})
    assert (refused["type"], refused["code"]) == ("error", "bad_request")
    row = await Session.objects.aget(dialog_id=ws.history["dialog_id"], owner=user)
    assert row.model == "big-model"


async def test_the_system_prompt_is_counted_in_the_input(
    api: Api, fake_model: FakeModelServer
) -> None:
    # covers: H4, C7
    long_prompt = "Always answer in haiku form, please. " * 100
    plain = await api.create(dialog_id="plain")
    instructed = await api.create(dialog_id="instructed")
    await api.patch(f"/sessions/{instructed['session_id']}", {"system_prompt": long_prompt})
    for s in (plain, instructed):
        ack = await api.send(s["session_id"], "the same question")
        await api.turn_done(ack["turn_id"])
    without, with_prompt = turn_bodies(fake_model)
    # The answer's room is what the window leaves after the input: the prompt's tokens less.
    assert without["max_tokens"] - with_prompt["max_tokens"] > 500


async def test_a_retry_and_a_continue_ask_the_dialogs_model(
    api: Api, fake_model: FakeModelServer
) -> None:
    # covers: H4, C6, E5
    s = await api.create(dialog_id="again")
    await api.patch(f"/sessions/{s['session_id']}", {"model": "small-model"})
    fake_model.script(
        Reply(status=400, error={"error": {"message": "bad request"}}),
        Reply(text="cut here", finish_reason="length"),
    )
    ack = await api.send(s["session_id"], "first try")
    assert (await api.turn_done(ack["turn_id"]))["status"] == "failed"
    status, retried = await api.post(f"/sessions/{s['session_id']}/retry")
    assert status == 202, retried
    assert (await api.turn_done(retried["turn_id"]))["status"] == "completed"
    status, continued = await api.post(f"/sessions/{s['session_id']}/continue")
    assert status == 202, continued
    assert (await api.turn_done(continued["turn_id"]))["status"] == "completed"
    # The turns' requests (a title's, if one is asked meanwhile, keeps the default model).
    turns = [r for r in fake_model.requests if SYSTEM_PROMPT in r.purpose_system]
    assert [r.body["model"] for r in turns] == ["small-model"] * 3


async def test_the_admin_offers_the_running_engines_models_and_without_one_the_settings(
    engine: Any, fake_model: FakeModelServer, make_user: Any, user: Any, settings: Any
) -> None:
    # covers: H4 (the admin's model choices: this process's engine's catalog, which follows its
    # provider's server; in a process without an engine, one made from the settings)
    from asgiref.sync import sync_to_async
    from django.test import Client
    from django.urls import reverse

    from chatcore.engine import runtime
    from sessions_app import services

    staff = await sync_to_async(make_user)("operator", staff=True)
    session = await sync_to_async(services.session_create)(
        owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id="ops"
    )
    elsewhere = FakeModelServer().start()
    elsewhere.models = ["settings-model"]
    settings.LLM = {**settings.LLM, "BASE_URL": elsewhere.url, "MODEL": "settings-model"}

    def choices() -> list[str]:
        client = Client()
        client.force_login(staff)
        page = client.get(reverse("admin:sessions_app_session_change", args=[session.pk]))
        return [value for value, _label in page.context["adminform"].form.fields["model"].choices]

    try:
        assert await sync_to_async(choices)() == ["", "fake", "big-model", "small-model"]
        runtime.set_engine(None)
        assert await sync_to_async(choices)() == ["", "settings-model"]
    finally:
        elsewhere.stop()
