"""The REST API (SPEC E3, F2, PROTOCOL "REST API") through the real ASGI stack (AsyncClient)
and the real engine on the fake model server: the OpenAPI document and docs, auth (bearer
tokens and the browser session with CSRF), unknown paths and the common error shapes. The
routes' own tests are in test_api_sessions.py and test_api_messages.py, SSE in test_sse.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import cache
from django.middleware.csrf import _get_new_csrf_string, _mask_cipher_secret
from django.test import AsyncClient

from sessions_app import services
from sessions_app.models import ApiToken, Message, Session
from tests.api_helpers import (
    Api,
    bearer_api,
    error_of,
    issue_token,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


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
        # H1: edit, regenerate and branch.
        "/api/v1/sessions/{session_id}/messages/{seq}/edit": {"post"},
        "/api/v1/sessions/{session_id}/messages/{seq}/regenerate": {"post"},
        "/api/v1/sessions/{session_id}/branch": {"post"},
        "/api/v1/turns/{turn_id}": {"get"},
        "/api/v1/models": {"get"},
        "/api/v1/files": {"post"},
        "/api/v1/files/{file_id}": {"get"},
        # H2: search, export, import, share links.
        "/api/v1/search": {"get"},
        "/api/v1/sessions/{session_id}/export": {"get"},
        "/api/v1/sessions/import": {"post"},
        "/api/v1/sessions/{session_id}/share": {"post"},
        "/api/v1/shares": {"get"},
        "/api/v1/shares/{share_id}": {"delete"},
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
