"""The REST API (SPEC E3, PROTOCOL "REST API") through the real ASGI stack (AsyncClient) and
the real engine on the fake model server: every endpoint's happy and error paths, auth
(bearer tokens and the browser session with CSRF), limits, pagination, and SSE in-process."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import cache
from django.middleware.csrf import _get_new_csrf_string, _mask_cipher_secret
from django.test import AsyncClient, override_settings

from chatcore.engine import runtime
from sessions_app import services
from sessions_app.models import ApiToken, Message, Session, Turn
from tests.fakemodel import Reply

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]

BASE = "/api/v1"
TERMINAL = ("completed", "cancelled", "failed")


def chat_cfg(**changes: Any) -> Any:
    return override_settings(CHAT={**settings.CHAT, **changes})


@asynccontextmanager
async def engine_with(make_engine: Any, **changes: Any) -> AsyncIterator[Any]:
    """Settings changed for the API and a process engine started under them (an engine
    reads its settings when it starts)."""
    with chat_cfg(**changes):
        previous = await runtime.get_engine()
        engine = await make_engine()
        runtime.set_engine(engine)
        try:
            yield engine
        finally:
            runtime.set_engine(previous)


async def issue_token(user: Any) -> str:
    _token, raw = await sync_to_async(services.api_token_issue)(user=user, name="test")
    return raw


class Api:
    """A client of the API: JSON in, (status, JSON) out. Headers go with every request
    (AsyncClient(headers=...) sends them under wrong names in this Django version)."""

    def __init__(self, client: AsyncClient, headers: dict[str, str] | None = None) -> None:
        self.client = client
        self.headers = headers or {}

    async def call(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any, Any]:
        url = path if path.startswith("/api/") else BASE + path
        headers = {**self.headers, **(headers or {})}
        if method in ("GET", "HEAD"):
            fn = getattr(self.client, method.lower())
            response = await fn(url, body or {}, headers=headers)
        elif body is None:  # no body at all, as curl or httpx send it
            response = await self.client.generic(method, url, b"", headers=headers)
        else:
            response = await self.client.generic(
                method, url, json.dumps(body), content_type="application/json", headers=headers
            )
        data = None
        if response.get("Content-Type", "").startswith("application/json") and response.content:
            data = json.loads(response.content)
        return response.status_code, data, response

    async def get(self, path: str, **params: Any) -> tuple[int, Any]:
        status, data, _ = await self.call("GET", path, params)
        return status, data

    async def post(self, path: str, body: Any = None) -> tuple[int, Any]:
        status, data, _ = await self.call("POST", path, body)
        return status, data

    async def patch(self, path: str, body: Any) -> tuple[int, Any]:
        status, data, _ = await self.call("PATCH", path, body)
        return status, data

    async def delete(self, path: str) -> tuple[int, Any]:
        status, data, _ = await self.call("DELETE", path)
        return status, data

    async def create(self, **body: Any) -> dict[str, Any]:
        status, data = await self.post("/sessions", body)
        assert status == 201, data
        return data

    async def send(self, session_id: str, content: str, **body: Any) -> dict[str, Any]:
        status, data = await self.post(
            f"/sessions/{session_id}/messages", {"content": content, **body}
        )
        assert status == 202, data
        return data

    async def turn_done(self, turn_id: str, timeout: float = 15.0) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            status, data = await self.get(f"/turns/{turn_id}")
            assert status == 200, data
            if data["status"] in TERMINAL:
                return data
            assert loop.time() < deadline, f"turn still {data['status']}"
            await asyncio.sleep(0.03)

    async def until(self, path: str, pred: Any, timeout: float = 10.0) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            status, data = await self.get(path)
            if status == 200 and pred(data):
                return data
            assert loop.time() < deadline, f"condition on {path} not met: {data}"
            await asyncio.sleep(0.03)


async def bearer_api(user: Any) -> Api:
    return Api(AsyncClient(), {"Authorization": f"Bearer {await issue_token(user)}"})


@pytest.fixture
async def api(engine: Any, user: Any) -> Api:
    await sync_to_async(cache.clear)()  # rate-limit counters of earlier tests
    return await bearer_api(user)


def error_of(status: int, data: Any, expected_status: int, code: str) -> None:
    assert status == expected_status, data
    assert data["code"] == code, data
    assert isinstance(data["message"], str) and data["message"]


# --- OpenAPI and docs -------------------------------------------------------------------------


async def test_openapi_document_is_valid_and_lists_every_path(api: Api) -> None:
    # covers: E3
    import schemathesis

    status, schema, _ = await Api(AsyncClient()).call("GET", "/api/v1/openapi.json")
    assert status == 200  # public: client generators and tools fetch it without a login
    schemathesis.openapi.from_dict(schema).validate()  # the OpenAPI 3.1 meta-schema
    paths = schema["paths"]
    expected = {
        "/api/v1/sessions": {"get", "post"},
        "/api/v1/sessions/{session_id}": {"get", "patch", "delete"},
        "/api/v1/sessions/{session_id}/messages": {"get", "post"},
        "/api/v1/sessions/{session_id}/stop": {"post"},
        "/api/v1/sessions/{session_id}/compact": {"post"},
        "/api/v1/sessions/{session_id}/retry": {"post"},
        "/api/v1/sessions/{session_id}/continue": {"post"},
        "/api/v1/turns/{turn_id}": {"get"},
    }
    assert set(paths) == set(expected)
    for path, methods in expected.items():
        assert set(paths[path]) == methods, path
        for op in paths[path].values():
            assert {"BearerTokenAuth": []} in op["security"]
    schemes = schema["components"]["securitySchemes"]
    assert schemes["BearerTokenAuth"] == {"type": "http", "scheme": "bearer"}
    assert schemes["SessionCookieAuth"]["in"] == "cookie"
    post = paths["/api/v1/sessions/{session_id}/messages"]["post"]
    assert "text/event-stream" in post["responses"]["200"]["content"]
    assert {"202", "401", "404", "409", "413", "422", "429"} <= set(post["responses"])


async def test_docs_need_a_login_or_a_valid_token(api: Api, user: Any) -> None:
    # covers: E3, F2
    anonymous = AsyncClient()
    response = await anonymous.get("/api/v1/docs")
    assert response.status_code == 302
    assert response["Location"].startswith(settings.LOGIN_URL)

    bad = await AsyncClient().get("/api/v1/docs", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401
    assert json.loads(bad.content)["code"] == "unauthorized"

    with_token = await api.client.get("/api/v1/docs", headers=api.headers)
    assert with_token.status_code == 200
    assert b"swagger" in with_token.content.lower()

    browser = AsyncClient()
    await browser.aforce_login(user)
    assert (await browser.get("/api/v1/docs")).status_code == 200


async def test_unknown_paths_and_methods_answer_json(api: Api) -> None:
    status, data, _ = await api.call("GET", "/api/v1/nothing/here")
    error_of(status, data, 404, "not_found")
    status, data, _ = await api.call("GET", "/api/v1/")
    error_of(status, data, 404, "not_found")
    status, data, response = await api.call("PUT", "/api/v1/sessions", {})
    error_of(status, data, 405, "method_not_allowed")
    assert "GET" in response["Allow"]


# --- Auth (F2) --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [None, "Bearer", "Bearer not-a-token", "Basic dXNlcjpwdw==", "Token abc"],
    ids=["none", "empty", "unknown", "basic", "other-scheme"],
)
async def test_requests_without_valid_credentials_get_401(engine: Any, header: str | None) -> None:
    # covers: F2
    client = Api(AsyncClient(), {"Authorization": header} if header else {})
    for method, path in [
        ("GET", "/sessions"),
        ("POST", "/sessions"),
        ("GET", "/sessions/api:u1:default"),
        ("POST", "/sessions/api:u1:default/messages"),
        ("GET", "/turns/00000000-0000-0000-0000-000000000000"),
    ]:
        status, data, response = await client.call(method, path, {"content": "x"})
        error_of(status, data, 401, "unauthorized")
        assert response["WWW-Authenticate"].startswith("Bearer")


async def test_revoked_token_is_refused_and_use_is_recorded(engine: Any, user: Any) -> None:
    # covers: F2
    token, raw = await sync_to_async(services.api_token_issue)(user=user)
    client = Api(AsyncClient(), {"Authorization": f"Bearer {raw}"})
    status, _ = await client.get("/sessions")
    assert status == 200
    fresh = await sync_to_async(ApiToken.objects.get)(pk=token.pk)
    assert fresh.last_used_at is not None
    await sync_to_async(services.api_token_revoke)(token=token)
    status, data = await client.get("/sessions")
    error_of(status, data, 401, "unauthorized")


async def test_inactive_user_token_is_refused(engine: Any, make_user: Any) -> None:
    # covers: F2
    carol = await sync_to_async(make_user)("carol")
    client = await bearer_api(carol)
    carol.is_active = False
    await sync_to_async(carol.save)()
    status, data = await client.get("/sessions")
    error_of(status, data, 401, "unauthorized")


def csrf_pair() -> tuple[str, str]:
    """A CSRF cookie secret and a masked token for the X-CSRFToken header."""
    secret = _get_new_csrf_string()
    return secret, _mask_cipher_secret(secret)


async def test_browser_session_works_with_csrf_and_is_refused_without(
    engine: Any, user: Any
) -> None:
    # covers: F2, E3
    await sync_to_async(cache.clear)()
    browser = AsyncClient(enforce_csrf_checks=True)
    await browser.aforce_login(user)
    secret, token = csrf_pair()
    browser.cookies[settings.CSRF_COOKIE_NAME] = secret
    api = Api(browser)

    status, data = await api.get("/sessions")  # safe methods need no token
    assert status == 200 and data["count"] == 0

    status, data = await api.post("/sessions", {"dialog_id": "web1"})
    error_of(status, data, 403, "csrf_failed")
    assert await sync_to_async(Session.objects.count)() == 0

    status, data, _ = await api.call(
        "POST", "/sessions", {"dialog_id": "web1"}, headers={"X-CSRFToken": token}
    )
    assert status == 201, data
    assert data["session_id"] == f"api:u{user.pk}:web1"

    status, data, _ = await api.call("DELETE", f"/sessions/{data['session_id']}")
    error_of(status, data, 403, "csrf_failed")


async def test_anonymous_unsafe_call_is_401_not_csrf_403(engine: Any) -> None:
    status, data, _ = await Api(AsyncClient(enforce_csrf_checks=True)).call("POST", "/sessions", {})
    error_of(status, data, 401, "unauthorized")


async def test_bearer_calls_need_no_csrf_and_a_bad_token_never_falls_back_to_the_cookie(
    engine: Any, user: Any
) -> None:
    # covers: F2
    client = Api(
        AsyncClient(enforce_csrf_checks=True),
        {"Authorization": f"Bearer {await issue_token(user)}"},
    )
    status, data = await client.post("/sessions", {})
    assert status == 201, data

    browser = AsyncClient()
    await browser.aforce_login(user)
    status, data = await Api(browser, {"Authorization": "Bearer revoked-or-wrong"}).get("/sessions")
    error_of(status, data, 401, "unauthorized")


# --- Dialogs ----------------------------------------------------------------------------------


async def test_create_session_defaults(api: Api, user: Any) -> None:
    # covers: E3, A1, B2
    data = await api.create()
    assert data["channel"] == "api"
    assert data["chat_id"] == f"u{user.pk}"
    assert data["session_id"] == f"api:u{user.pk}:{data['dialog_id']}"
    assert data["title"] == f"Dialog {data['dialog_id']}"
    assert data["status"] == "idle"
    assert data["active_turn"] is None and data["queue"] == []
    assert data["history_revision"] == 1  # the welcome message (B2)
    assert data["message_count"] == 0 and data["total_message_count"] == 1


async def test_create_session_with_ids_and_title(api: Api, user: Any) -> None:
    # covers: E3, A1
    data = await api.create(channel="web", chat_id=f"u{user.pk}.work", dialog_id="d-1", title="Hi")
    assert data["session_id"] == f"web:u{user.pk}.work:d-1"
    assert data["title"] == "Hi"
    status, got = await api.get(f"/sessions/{data['session_id']}")
    assert status == 200 and got["session_id"] == data["session_id"]


@pytest.mark.parametrize(
    "body",
    [
        {"dialog_id": "bad id"},
        {"dialog_id": "x" * 65},
        {"dialog_id": ""},
        {"dialog_id": "a:b"},
        {"chat_id": "u1/2"},
        {"channel": "telegram"},
        {"channel": "bad channel"},
        {"title": ""},
        {"title": "   "},
        {"title": "t" * 201},
        {"title": "nul\x00"},
        {"dialog_id": 5},
    ],
    ids=lambda b: json.dumps(b)[:40],
)
async def test_create_session_rejects_bad_input_with_422(api: Api, body: dict[str, Any]) -> None:
    # covers: E3, A1
    status, data = await api.post("/sessions", body)
    error_of(status, data, 422, "bad_request")
    assert await sync_to_async(Session.objects.count)() == 0


async def test_create_session_in_another_users_chat_is_404(
    api: Api, user: Any, other_user: Any
) -> None:
    # covers: F2, A1
    for chat_id in (f"u{other_user.pk}", f"u{other_user.pk}.x", "u999999", "shared"):
        status, data = await api.post("/sessions", {"chat_id": chat_id})
        error_of(status, data, 404, "not_found")
    assert await sync_to_async(Session.objects.count)() == 0


async def test_create_existing_dialog_is_409_conflict(api: Api) -> None:
    # covers: E3, A1
    await api.create(dialog_id="same")
    status, data = await api.post("/sessions", {"dialog_id": "same"})
    error_of(status, data, 409, "conflict")
    # Another chat of the same user may use the id.
    await api.create(dialog_id="same", channel="web")


async def test_malformed_json_is_400(api: Api) -> None:
    response = await api.client.post(
        f"{BASE}/sessions", "{not json", content_type="application/json", headers=api.headers
    )
    assert response.status_code == 400
    assert json.loads(response.content)["code"] == "bad_request"


async def test_list_sessions_most_recent_first_with_filters_and_pages(api: Api, user: Any) -> None:
    # covers: E3
    a = await api.create(dialog_id="a")
    b = await api.create(dialog_id="b", channel="web")
    c = await api.create(dialog_id="c", chat_id=f"u{user.pk}.work")
    # Activity moves a dialog to the top.
    await api.send(a["session_id"], "note", mode="inject")

    status, data = await api.get("/sessions")
    assert status == 200
    assert data["count"] == 3
    assert [i["session_id"] for i in data["items"]] == [
        a["session_id"],
        c["session_id"],
        b["session_id"],
    ]
    assert data["items"][0]["status"] == "idle"

    _, web = await api.get("/sessions", channel="web")
    assert [i["dialog_id"] for i in web["items"]] == ["b"] and web["count"] == 1
    _, work = await api.get("/sessions", chat_id=f"u{user.pk}.work")
    assert [i["dialog_id"] for i in work["items"]] == ["c"]
    _, page = await api.get("/sessions", limit=1, offset=1)
    assert [i["dialog_id"] for i in page["items"]] == ["c"] and page["count"] == 3
    _, empty = await api.get("/sessions", offset=10)
    assert empty == {"items": [], "count": 3}


@pytest.mark.parametrize(
    "params",
    [{"limit": 0}, {"limit": 101}, {"offset": -1}, {"limit": "x"}, {"channel": "a b"}],
    ids=str,
)
async def test_list_sessions_rejects_bad_paging(api: Api, params: dict[str, Any]) -> None:
    status, data = await api.get("/sessions", **params)
    error_of(status, data, 422, "bad_request")
    assert data["errors"] and data["errors"][0]["loc"][0] == "query"


async def test_get_unknown_or_malformed_session_is_404(api: Api, user: Any) -> None:
    # covers: E3, F2
    for sid in (f"api:u{user.pk}:nope", "garbage", "a:b", "a:b:c:d", "%00", "api:u1:..."):
        status, data = await api.get(f"/sessions/{sid}")
        error_of(status, data, 404, "not_found")


async def test_rename_session(api: Api) -> None:
    # covers: E3, B4
    s = await api.create(dialog_id="r")
    status, data = await api.patch(f"/sessions/{s['session_id']}", {"title": "  New   name "})
    assert status == 200, data
    assert data["title"] == "New name"
    for body in ({"title": ""}, {}, {"title": None}, {"title": "x" * 201}):
        status, data = await api.patch(f"/sessions/{s['session_id']}", body)
        error_of(status, data, 422, "bad_request")
    status, data = await api.patch(f"/sessions/{s['session_id']}x", {"title": "t"})
    error_of(status, data, 404, "not_found")


async def test_delete_session(api: Api) -> None:
    # covers: E3, A7
    s = await api.create(dialog_id="gone")
    status, data, response = await api.call("DELETE", f"/sessions/{s['session_id']}")
    assert status == 204 and response.content == b""
    status, data = await api.get(f"/sessions/{s['session_id']}")
    error_of(status, data, 404, "not_found")
    _, listed = await api.get("/sessions")
    assert listed["count"] == 0
    status, data = await api.delete(f"/sessions/{s['session_id']}")
    error_of(status, data, 404, "not_found")
    # A7: the id can be used again.
    again = await api.create(dialog_id="gone")
    assert again["history_revision"] == 1


async def test_delete_while_a_turn_runs_ends_it_as_stale(api: Api, fake_model: Any) -> None:
    # covers: E3, C9, A7
    s = await api.create(dialog_id="busy")
    fake_model.script(Reply(text="never", endless=True))
    ack = await api.send(s["session_id"], "hello")
    queued = await api.send(s["session_id"], "second")
    await fake_model.requests_made(1)  # the turn is past its model request
    status, _ = await api.delete(f"/sessions/{s['session_id']}")
    assert status == 204
    for turn_id in (ack["turn_id"], queued["turn_id"]):
        turn = await _wait_turn_row(turn_id)
        assert turn.status == "cancelled" and turn.reason == "stale"
    # A7: the turns of a deleted dialog are hidden with it.
    status, data = await api.get(f"/turns/{ack['turn_id']}")
    error_of(status, data, 404, "not_found")


async def _wait_turn_row(turn_id: str, timeout: float = 15.0) -> Turn:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        turn = await sync_to_async(Turn.objects.get)(pk=turn_id)
        if turn.status in TERMINAL:
            return turn
        assert loop.time() < deadline
        await asyncio.sleep(0.03)


# --- Messages and turns -----------------------------------------------------------------------


async def test_send_is_accepted_and_the_turn_completes(api: Api, user: Any) -> None:
    # covers: E3, C2
    s = await api.create(dialog_id="chat")
    ack = await api.send(s["session_id"], "hi there", client_msg_id="c-1")
    assert ack["session_id"] == s["session_id"]
    assert ack["position"] == 0 and ack["mode"] == "send" and ack["client_msg_id"] == "c-1"
    turn = await api.turn_done(ack["turn_id"])
    assert turn["status"] == "completed"
    assert turn["reason"] is None and turn["error"] is None
    assert turn["session_id"] == s["session_id"] and turn["client_msg_id"] == "c-1"
    roles = [(m["role"], m["content"]) for m in turn["messages"]]
    assert roles == [("user", "hi there"), ("assistant", "echo: hi there")]
    user_message = turn["messages"][0]
    assert user_message["source"]["from_channel"] == "api"
    assert "from_user_id" not in user_message["source"]  # sender ids stay private
    assert "tool_calls" not in user_message  # optional fields only when present

    _, page = await api.get(f"/sessions/{s['session_id']}/messages")
    assert [m["seq"] for m in page["messages"]] == [1, 2, 3]
    assert page["history_revision"] == 3 and page["has_more"] is False
    _, state = await api.get(f"/sessions/{s['session_id']}")
    assert state["message_count"] == 1 and state["status"] == "idle"


async def test_session_shows_the_running_turn_and_the_queue(api: Api, fake_model: Any) -> None:
    # covers: E3, C2, D3
    s = await api.create(dialog_id="q")
    gate = threading.Event()
    fake_model.script(Reply(text="first answer", gate=gate), Reply(text="second"))
    first = await api.send(s["session_id"], "one")
    second = await api.send(s["session_id"], "two", client_msg_id="m2")
    assert second["position"] == 1
    state = await api.until(
        f"/sessions/{s['session_id']}",
        lambda d: d["status"] == "running" and d["active_turn"]["text"] == "first answer",
    )
    assert state["active_turn"]["turn_id"] == first["turn_id"]
    assert state["active_turn"]["text_offset"] == 0
    assert state["queue"] == [
        {"turn_id": second["turn_id"], "mode": "send", "client_msg_id": "m2", "preview": "two"}
    ]
    _, listed = await api.get("/sessions")
    assert listed["items"][0]["status"] == "running"
    status, turn = await api.get(f"/turns/{second['turn_id']}")
    assert turn["status"] == "queued" and turn["messages"] == []
    gate.set()
    assert (await api.turn_done(second["turn_id"]))["status"] == "completed"


async def test_steer_joins_the_running_turn(api: Api, fake_model: Any) -> None:
    # covers: E3, C4
    s = await api.create(dialog_id="steer")
    gate = threading.Event()
    fake_model.script(Reply(text="step one", gate=gate), Reply(text="steered answer"))
    ack = await api.send(s["session_id"], "start")
    await fake_model.requests_made(1)  # the turn is past its model request
    steer = await api.send(s["session_id"], "also this", mode="steer")
    assert steer["mode"] == "steer" and steer["turn_id"] == ack["turn_id"]
    gate.set()
    turn = await api.turn_done(ack["turn_id"])
    assert [m["content"] for m in turn["messages"]] == [
        "start",
        "step one",
        "also this",
        "steered answer",
    ]


async def test_idle_steer_is_a_send(api: Api) -> None:
    # covers: C4
    s = await api.create(dialog_id="idle-steer")
    ack = await api.send(s["session_id"], "as a send", mode="steer")
    assert ack["mode"] == "send" and ack["turn_id"]
    assert (await api.turn_done(ack["turn_id"]))["status"] == "completed"


async def test_idle_inject_appends_without_a_turn(api: Api, fake_model: Any) -> None:
    # covers: E3, C5
    s = await api.create(dialog_id="inj")
    ack = await api.send(s["session_id"], "context only", mode="inject")
    assert ack["turn_id"] is None and ack["mode"] == "inject"
    _, page = await api.get(f"/sessions/{s['session_id']}/messages", from_seq=2)
    assert [(m["role"], m["content"]) for m in page["messages"]] == [("user", "context only")]
    assert fake_model.turn_requests() == []


@pytest.mark.parametrize(
    "body",
    [
        {"content": ""},
        {"content": "   \n"},
        {},
        {"content": None},
        {"content": 12},
        {"content": "x", "mode": "shout"},
        {"content": "x", "client_msg_id": "c" * 129},
        {"content": "nul \x00 inside"},
        {"content": "lone \ud800 surrogate"},
    ],
    ids=lambda b: json.dumps(b)[:40],
)
async def test_send_rejects_bad_input_with_422(api: Api, body: dict[str, Any]) -> None:
    # covers: E3, C2
    s = await api.create(dialog_id="bad")
    status, data = await api.post(f"/sessions/{s['session_id']}/messages", body)
    error_of(status, data, 422, "bad_request")
    assert await sync_to_async(Turn.objects.count)() == 0
    _, page = await api.get(f"/sessions/{s['session_id']}/messages")
    assert len(page["messages"]) == 1  # a refused send writes nothing (C2)


async def test_send_to_an_unknown_dialog_is_404(api: Api, user: Any) -> None:
    status, data = await api.post(f"/sessions/api:u{user.pk}:none/messages", {"content": "x"})
    error_of(status, data, 404, "not_found")


async def test_too_long_content_is_413(api: Api, make_engine: Any) -> None:
    # covers: F3, F6
    s = await api.create(dialog_id="big")
    async with engine_with(make_engine, CONTENT_LIMIT=10):
        status, data = await api.post(
            f"/sessions/{s['session_id']}/messages", {"content": "x" * 11}
        )
        error_of(status, data, 413, "too_large")
        # The body guard refuses an oversized body before parsing it.
        status, data = await api.post(
            f"/sessions/{s['session_id']}/messages", {"content": "y" * 200_000}
        )
        error_of(status, data, 413, "too_large")
        ack = await api.send(s["session_id"], "x" * 10)
        assert ack["turn_id"]
    assert await sync_to_async(Turn.objects.count)() == 1


async def test_body_guard_follows_djangos_upload_limit(api: Api) -> None:
    # covers: F3
    s = await api.create(dialog_id="guard")
    with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000):
        status, data = await api.post(
            f"/sessions/{s['session_id']}/messages", {"content": "z" * 2000}
        )
    error_of(status, data, 413, "too_large")
    assert await sync_to_async(Turn.objects.count)() == 0


async def test_rate_limit_is_429_with_retry_after(api: Api, make_engine: Any) -> None:
    # covers: F3
    s = await api.create(dialog_id="rl")
    await sync_to_async(cache.clear)()
    async with engine_with(make_engine, RATE_LIMIT_PER_MINUTE=2):
        await api.send(s["session_id"], "one", mode="inject")
        await api.send(s["session_id"], "two", mode="inject")
        status, data, response = await api.call(
            "POST", f"/sessions/{s['session_id']}/messages", {"content": "three"}
        )
    error_of(status, data, 429, "rate_limited")
    assert 1 <= int(response["Retry-After"]) <= 60
    await sync_to_async(cache.clear)()


async def test_full_queue_is_409(api: Api, fake_model: Any, make_engine: Any) -> None:
    # covers: C1, F3
    s = await api.create(dialog_id="full")
    gate = threading.Event()
    fake_model.script(Reply(text="slow", gate=gate))
    async with engine_with(make_engine, QUEUE_CAPACITY=2):
        first = await api.send(s["session_id"], "running")
        await fake_model.requests_made(1)  # the turn is past its model request
        await api.send(s["session_id"], "queued 1")
        await api.send(s["session_id"], "queued 2")
        status, data = await api.post(f"/sessions/{s['session_id']}/messages", {"content": "no"})
        error_of(status, data, 409, "queue_full")
        gate.set()
        await api.turn_done(first["turn_id"])


async def test_stop_cancels_the_running_turn_and_drops_the_queue(api: Api, fake_model: Any) -> None:
    # covers: E3, C6
    s = await api.create(dialog_id="stop")
    fake_model.script(Reply(text="partial answer", endless=True))
    running = await api.send(s["session_id"], "go")
    queued = await api.send(s["session_id"], "later")
    await api.until(
        f"/sessions/{s['session_id']}",
        lambda d: d["active_turn"] is not None and "partial" in d["active_turn"]["text"],
    )
    status, data = await api.post(f"/sessions/{s['session_id']}/stop")
    assert status == 200
    assert data == {"stopped_running": True, "dropped": 1}
    stopped = await api.turn_done(running["turn_id"])
    assert stopped["status"] == "cancelled"
    partial = [m for m in stopped["messages"] if m["role"] == "assistant"]
    assert partial and partial[0]["status"] == "cancelled"
    dropped = await api.turn_done(queued["turn_id"])
    assert dropped["status"] == "cancelled" and dropped["reason"] == "dropped"

    status, data = await api.post(f"/sessions/{s['session_id']}/stop")
    assert status == 200 and data == {"stopped_running": False, "dropped": 0}


async def test_retry_reruns_the_last_cancelled_turn(api: Api, fake_model: Any) -> None:
    # covers: E3, C6
    s = await api.create(dialog_id="retry")
    status, data = await api.post(f"/sessions/{s['session_id']}/retry")
    assert status == 409, data  # nothing to retry yet
    fake_model.script(Reply(text="cut", endless=True), Reply(text="second try"))
    ack = await api.send(s["session_id"], "question")
    await fake_model.requests_made(1)  # the turn is past its model request
    await api.post(f"/sessions/{s['session_id']}/stop")
    await api.turn_done(ack["turn_id"])

    status, retried = await api.post(f"/sessions/{s['session_id']}/retry", {"client_msg_id": "r1"})
    assert status == 202, retried
    assert retried["mode"] == "retry" and retried["turn_id"] != ack["turn_id"]
    assert retried["client_msg_id"] == "r1"
    turn = await api.turn_done(retried["turn_id"])
    assert turn["status"] == "completed"
    assert [m["content"] for m in turn["messages"]] == ["second try"]  # no second user message
    _, page = await api.get(f"/sessions/{s['session_id']}/messages")
    assert [m["content"] for m in page["messages"] if m["role"] == "user"] == ["question"]


async def test_compact_is_accepted(api: Api, fake_model: Any) -> None:
    # covers: E3, B5
    s = await api.create(dialog_id="compact")
    for i in range(8):
        await api.send(s["session_id"], f"fact {i}", mode="inject")
    status, data = await api.post(f"/sessions/{s['session_id']}/compact")
    assert status == 202
    assert data == {"session_id": s["session_id"], "accepted": True}
    status, data = await api.post(f"/sessions/{s['session_id']}x/compact")
    error_of(status, data, 404, "not_found")


async def test_get_turn_unknown_or_malformed_is_404(api: Api) -> None:
    # covers: E3, F2
    for turn_id in ("00000000-0000-0000-0000-000000000000", "nope", "1", "%20"):
        status, data = await api.get(f"/turns/{turn_id}")
        error_of(status, data, 404, "not_found")


# --- Message pages ----------------------------------------------------------------------------


async def test_messages_page_by_from_seq(api: Api) -> None:
    # covers: E3, A3
    s = await api.create(dialog_id="pages")
    sid = s["session_id"]
    for i in range(6):
        await api.send(sid, f"m{i}", mode="inject")  # seqs 2..7 (1 is the welcome)

    status, page = await api.get(f"/sessions/{sid}/messages", from_seq=0, limit=3)
    assert status == 200
    assert [m["seq"] for m in page["messages"]] == [1, 2, 3]
    assert page["has_more"] is True and page["next_from_seq"] == 4
    assert page["history_revision"] == 7

    # New messages arrive between pages: the next page neither skips nor repeats.
    await api.send(sid, "late", mode="inject")
    _, page2 = await api.get(f"/sessions/{sid}/messages", from_seq=page["next_from_seq"], limit=3)
    assert [m["seq"] for m in page2["messages"]] == [4, 5, 6]
    assert page2["has_more"] is True and page2["history_revision"] == 8
    _, page3 = await api.get(f"/sessions/{sid}/messages", from_seq=page2["next_from_seq"], limit=3)
    assert [m["content"] for m in page3["messages"]] == ["m5", "late"]
    assert page3["has_more"] is False and page3["next_from_seq"] == 9
    _, beyond = await api.get(f"/sessions/{sid}/messages", from_seq=100)
    assert beyond["messages"] == [] and beyond["has_more"] is False
    assert beyond["next_from_seq"] == 100

    _, everything = await api.get(f"/sessions/{sid}/messages", limit=500)
    assert [m["seq"] for m in everything["messages"]] == list(range(1, 9))
    first = everything["messages"][0]
    assert set(first) >= {"id", "seq", "role", "content", "created_at"}


@pytest.mark.parametrize(
    "params",
    [{"limit": 0}, {"limit": 501}, {"from_seq": -1}, {"from_seq": 2**63}, {"limit": "many"}],
    ids=str,
)
async def test_messages_page_rejects_bad_paging(api: Api, params: dict[str, Any]) -> None:
    s = await api.create(dialog_id="badpages")
    status, data = await api.get(f"/sessions/{s['session_id']}/messages", **params)
    error_of(status, data, 422, "bad_request")


# --- Body and error shapes --------------------------------------------------------------------


async def test_validation_errors_have_the_common_shape(api: Api) -> None:
    s = await api.create(dialog_id="shape")
    status, data = await api.post(f"/sessions/{s['session_id']}/messages", {"mode": "send"})
    assert status == 422
    assert data["code"] == "bad_request"
    assert data["message"] == "content: Field required"
    assert data["errors"][0]["loc"] == ["body", "payload", "content"]


async def test_messages_of_a_session_survive_reload_as_stored(api: Api) -> None:
    s = await api.create(dialog_id="stored")
    ack = await api.send(s["session_id"], "persist me")
    await api.turn_done(ack["turn_id"])
    stored = await sync_to_async(
        lambda: list(
            Message.objects.filter(session__dialog_id="stored")
            .order_by("seq")
            .values_list("seq", "content")
        )
    )()
    _, page = await api.get(f"/sessions/{s['session_id']}/messages")
    assert [(m["seq"], m["content"]) for m in page["messages"]] == stored


# --- SSE in-process ---------------------------------------------------------------------------


def parse_sse(raw: str) -> list[dict[str, Any]]:
    events = []
    for block in raw.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if line.startswith(":") or ":" not in line:
                continue
            key, _, value = line.partition(":")
            fields[key] = value.lstrip(" ")
        if "event" in fields:
            events.append(
                {"event": fields["event"], "id": int(fields["id"]), **json.loads(fields["data"])}
            )
    return events


async def read_stream(response: Any) -> list[dict[str, Any]]:
    chunks = []
    async for chunk in response.streaming_content:
        chunks.append(chunk.decode() if isinstance(chunk, bytes) else chunk)
    return parse_sse("".join(chunks))


async def test_sse_streams_the_turn_in_process(api: Api, fake_model: Any) -> None:
    # covers: E3, D1, D3
    s = await api.create(dialog_id="sse")
    fake_model.script(Reply(text="streamed answer, word by word", chunk=3, delay=0.01))
    response = await api.client.post(
        f"{BASE}/sessions/{s['session_id']}/messages",
        {"content": "stream please", "client_msg_id": "s1"},
        content_type="application/json",
        headers={**api.headers, "Accept": "text/event-stream"},
    )
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/event-stream")
    events = await asyncio.wait_for(read_stream(response), 20)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "queued" and kinds[1] == "history_delta" and kinds[-1] == "turn_updated"
    assert kinds[-2] == "history_delta"
    assert set(kinds[2:-2]) == {"turn_snapshot"}
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    turn_id = events[0]["turn_id"]
    assert events[0]["client_msg_id"] == "s1"
    assert all(e.get("turn_id") == turn_id for e in events)
    text = ""
    for e in events[2:-2]:
        text = text[: e["text_offset"]] + e["text"]
    assert text == "streamed answer, word by word"
    assert events[-2]["messages"][-1]["content"] == text
    assert events[-1]["status"] == "completed"


async def test_sse_idle_inject_streams_queued_then_its_delta(api: Api) -> None:
    # covers: C5, E3
    s = await api.create(dialog_id="sse-inject")
    response = await api.client.post(
        f"{BASE}/sessions/{s['session_id']}/messages",
        {"content": "ctx", "mode": "inject"},
        content_type="application/json",
        headers={**api.headers, "Accept": "text/event-stream"},
    )
    events = await asyncio.wait_for(read_stream(response), 10)
    assert [e["event"] for e in events] == ["queued", "history_delta"]
    assert events[0]["turn_id"] is None
    assert events[1]["messages"][0]["content"] == "ctx"
    assert events[1]["history_revision"] == 2


async def test_sse_refusal_is_a_json_error(api: Api, make_engine: Any) -> None:
    s = await api.create(dialog_id="sse-bad")
    async with engine_with(make_engine, CONTENT_LIMIT=3):
        status, data, _ = await api.call(
            "POST",
            f"/sessions/{s['session_id']}/messages",
            {"content": "too long"},
            headers={"Accept": "text/event-stream"},
        )
    error_of(status, data, 413, "too_large")


async def stream_post(api: Api, path: str, body: dict[str, Any] | None = None) -> Any:
    response = await api.client.generic(
        "POST",
        f"{BASE}{path}",
        json.dumps(body) if body is not None else b"",
        content_type="application/json",
        headers={**api.headers, "Accept": "text/event-stream"},
    )
    assert response.status_code == 200, response.content
    return response


async def test_sse_steer_joins_the_running_turn_with_a_full_snapshot(
    api: Api, fake_model: Any
) -> None:
    # covers: C4, D3: a stream that joins mid-turn first gets the whole text so far.
    s = await api.create(dialog_id="sse-steer")
    gate = threading.Event()
    fake_model.script(Reply(text="first part", gate=gate), Reply(text=" and the rest"))
    ack = await api.send(s["session_id"], "begin")
    await api.until(
        f"/sessions/{s['session_id']}",
        lambda d: d["active_turn"] is not None and d["active_turn"]["text"] == "first part",
    )
    response = await stream_post(
        api, f"/sessions/{s['session_id']}/messages", {"content": "steer it", "mode": "steer"}
    )
    reader = asyncio.ensure_future(read_stream(response))
    await asyncio.sleep(0.3)
    gate.set()
    events = await asyncio.wait_for(reader, 20)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "queued" and kinds[-1] == "turn_updated"
    assert events[0]["mode"] == "steer" and events[0]["turn_id"] == ack["turn_id"]
    snapshots = [e for e in events if e["event"] == "turn_snapshot"]
    assert snapshots[0]["text_offset"] == 0 and snapshots[0]["text"] == "first part"
    text = ""
    for e in snapshots:
        assert e["text_offset"] <= len(text)
        text = text[: e["text_offset"]] + e["text"]
    assert text.endswith(" and the rest")
    assert events[-1]["turn_id"] == ack["turn_id"] and events[-1]["status"] == "completed"
    deltas = [m["content"] for e in events if e["event"] == "history_delta" for m in e["messages"]]
    assert "steer it" in deltas


async def test_sse_retry_streams_the_new_turn(api: Api, fake_model: Any) -> None:
    # covers: C6, E3
    s = await api.create(dialog_id="sse-retry")
    fake_model.script(Reply(text="x", endless=True), Reply(text="retried answer"))
    ack = await api.send(s["session_id"], "q")
    await fake_model.requests_made(1)  # the turn is past its model request
    await api.post(f"/sessions/{s['session_id']}/stop")
    await api.turn_done(ack["turn_id"])
    response = await stream_post(api, f"/sessions/{s['session_id']}/retry")
    events = await asyncio.wait_for(read_stream(response), 20)
    assert events[0]["event"] == "queued" and events[0]["mode"] == "retry"
    assert events[-1]["event"] == "turn_updated" and events[-1]["status"] == "completed"
    assert events[-1]["turn_id"] == events[0]["turn_id"] != ack["turn_id"]


async def test_sse_sends_keepalives_while_silent(
    api: Api, fake_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: E3
    from sessions_app import api as api_module

    monkeypatch.setattr(api_module, "SSE_KEEPALIVE_SECONDS", 0.05)
    s = await api.create(dialog_id="sse-quiet")
    gate = threading.Event()
    fake_model.script(Reply(text="late", gate=gate))
    response = await stream_post(api, f"/sessions/{s['session_id']}/messages", {"content": "hi"})
    chunks: list[str] = []

    async def consume() -> None:
        async for chunk in response.streaming_content:
            chunks.append(chunk.decode() if isinstance(chunk, bytes) else chunk)

    reader = asyncio.ensure_future(consume())
    await asyncio.sleep(0.5)
    gate.set()
    await asyncio.wait_for(reader, 20)
    raw = "".join(chunks)
    assert ": keepalive\n\n" in raw
    assert parse_sse(raw)[-1]["status"] == "completed"


@pytest.mark.redis
async def test_sse_over_redis_keeps_every_frame_across_keepalives(
    api: Api, fake_model: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: E3, D1, D3 in scaled mode: keepalive timeouts never drop frames (the Redis
    # pub/sub layer unsubscribes a channel whose receive is cancelled).
    from channels.layers import get_channel_layer

    from chatcore.engine.engine import Engine
    from chatcore.engine.provider import OpenAIProvider
    from sessions_app import api as api_module

    monkeypatch.setattr(api_module, "SSE_KEEPALIVE_SECONDS", 0.01)
    layers = {
        "default": {
            "BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
            "CONFIG": {"hosts": [redis_url], "prefix": f"t{uuid.uuid4().hex[:8]}"},
        }
    }
    answer = "Every frame arrives, however long the pauses between them are."
    previous = await runtime.get_engine()
    with override_settings(CHANNEL_LAYERS=layers):
        engine = Engine(
            provider=OpenAIProvider(
                base_url=fake_model.url, api_key="sk-test", model="fake", retry_base_delay=0.01
            )
        )
        await engine.start()
        runtime.set_engine(engine)
        try:
            s = await api.create(dialog_id="redis-sse")
            fake_model.script(Reply(text=answer, chunk=3, delay=0.06))
            response = await stream_post(
                api, f"/sessions/{s['session_id']}/messages", {"content": "go"}
            )
            chunks: list[str] = []
            async for chunk in response.streaming_content:
                chunks.append(chunk.decode() if isinstance(chunk, bytes) else chunk)
            raw = "".join(chunks)
        finally:
            runtime.set_engine(previous)
            await engine.shutdown(grace=2)
            await get_channel_layer().flush()
    assert raw.count(": keepalive") > 3
    events = parse_sse(raw)
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["queued", "history_delta"]
    assert kinds[-2:] == ["history_delta", "turn_updated"]
    text = ""
    for e in events[2:-2]:
        text = text[: e["text_offset"]] + e["text"]
    assert text == answer
    assert events[-2]["messages"][-1]["content"] == answer


async def test_sse_ends_with_the_stored_terminal_when_the_layer_loses_it(
    api: Api, fake_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: C2, E3: every accepted send ends with one terminal, on the stream too.
    from chatcore.common import publish
    from sessions_app import api as api_module

    monkeypatch.setattr(api_module, "SSE_KEEPALIVE_SECONDS", 0.05)
    monkeypatch.setattr(api_module, "SSE_TERMINAL_GRACE_SECONDS", 0.1)
    original = publish.apublish

    async def lossy(group: str, frame: dict[str, Any]) -> None:
        if frame.get("type") != "turn_updated":
            await original(group, frame)

    monkeypatch.setattr(publish, "apublish", lossy)
    s = await api.create(dialog_id="lossy")
    response = await stream_post(api, f"/sessions/{s['session_id']}/messages", {"content": "hi"})
    events = await asyncio.wait_for(read_stream(response), 20)
    assert events[-1]["event"] == "turn_updated"
    assert events[-1]["status"] == "completed"
    assert events[-1]["turn_id"] == events[0]["turn_id"]
