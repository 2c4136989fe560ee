"""REST API dialogs (SPEC E3, A7, C9; PROTOCOL "REST API"): create, list, get, rename and
delete, with their error paths, through the real ASGI stack and engine."""

from __future__ import annotations

import json
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from sessions_app.models import Session
from tests.api_helpers import (
    BASE,
    Api,
    error_of,
    wait_turn_row,
)
from tests.fakemodel import Reply

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


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
        turn = await wait_turn_row(turn_id)
        assert turn.status == "cancelled" and turn.reason == "stale"
    # A7: the turns of a deleted dialog are hidden with it.
    status, data = await api.get(f"/turns/{ack['turn_id']}")
    error_of(status, data, 404, "not_found")
