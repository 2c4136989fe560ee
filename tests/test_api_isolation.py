"""Isolation matrix of the REST API (F2): a user reaches only their own dialogs and turns.

Every endpoint is called with every id of another user (dialog ids of several channels and
chats, turn ids in several states), over both kinds of auth: each answer is 404 (never 403),
with the same body as for an id that does not exist at all (nothing leaks), list endpoints
never show the other user's dialogs whatever the filters, and nothing of theirs changes."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import cache
from django.test import AsyncClient

from sessions_app.models import Compaction, Message, Session, StagedInput, Turn
from tests.api_helpers import Api, bearer_api
from tests.fakemodel import Reply
from tests.test_api import csrf_pair

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]

SSE = {"Accept": "text/event-stream"}

# (method, path template, body, extra headers); {sid} = a dialog id, {tid} = a turn id.
SESSION_ENDPOINTS: list[tuple[str, str, Any, dict[str, str]]] = [
    ("GET", "/sessions/{sid}", None, {}),
    ("PATCH", "/sessions/{sid}", {"title": "taken over"}, {}),
    ("DELETE", "/sessions/{sid}", None, {}),
    ("GET", "/sessions/{sid}/messages", None, {}),
    ("GET", "/sessions/{sid}/messages?from_seq=1&limit=500", None, {}),
    ("POST", "/sessions/{sid}/messages", {"content": "hello"}, {}),
    ("POST", "/sessions/{sid}/messages", {"content": "hello", "mode": "steer"}, {}),
    ("POST", "/sessions/{sid}/messages", {"content": "hello", "mode": "inject"}, {}),
    ("POST", "/sessions/{sid}/messages", {"content": "hello"}, SSE),
    ("POST", "/sessions/{sid}/stop", None, {}),
    ("POST", "/sessions/{sid}/compact", None, {}),
    ("POST", "/sessions/{sid}/retry", None, {}),
    ("POST", "/sessions/{sid}/retry", None, SSE),
]
TURN_ENDPOINTS: list[tuple[str, str, Any, dict[str, str]]] = [
    ("GET", "/turns/{tid}", None, {}),
]


def owned_state(user_id: int) -> dict[str, Any]:
    """Everything of a user that the API could change."""
    sessions = list(
        Session.objects.filter(owner_id=user_id)
        .order_by("pk")
        .values(
            "pk",
            "title",
            "title_source",
            "deleted_at",
            "last_seq",
            "message_count",
            "state_version",
            "generation",
            "turn_counter",
            "last_active_at",
        )
    )
    pks = [s["pk"] for s in sessions]
    return {
        "sessions": sessions,
        "turns": list(
            Turn.objects.filter(session_id__in=pks)
            .order_by("pk")
            .values("pk", "status", "reason", "cancel_requested")
        ),
        "messages": list(
            Message.objects.filter(session_id__in=pks).order_by("pk").values("pk", "content")
        ),
        "staged": StagedInput.objects.filter(session_id__in=pks).count(),
        "compactions": Compaction.objects.filter(session_id__in=pks).count(),
    }


@pytest.fixture
async def victim(engine: Any, other_user: Any, fake_model: Any) -> dict[str, Any]:
    """Bob's dialogs in three chats, with a completed and a cancelled turn."""
    await sync_to_async(cache.clear)()
    bob = await bearer_api(other_user)
    web = await bob.create(channel="web", dialog_id="default")
    api_default = await bob.create(dialog_id="default")
    work = await bob.create(chat_id=f"u{other_user.pk}.work", dialog_id="work", title="Private")
    done = await bob.send(api_default["session_id"], "secret question")
    await bob.turn_done(done["turn_id"])
    fake_model.script(Reply(text="cut short", endless=True))
    cancelled = await bob.send(work["session_id"], "to be stopped")
    await fake_model.requests_made(2)  # the turn is past its model request
    await bob.post(f"/sessions/{work['session_id']}/stop")
    await bob.turn_done(cancelled["turn_id"])
    await bob.send(web["session_id"], "a note", mode="inject")
    return {
        "api": bob,
        "user": other_user,
        "session_ids": [web["session_id"], api_default["session_id"], work["session_id"]],
        "turn_ids": [done["turn_id"], cancelled["turn_id"]],
    }


async def caller_api(kind: str, user: Any) -> Api:
    if kind == "bearer":
        return await bearer_api(user)
    # The browser session, with a valid CSRF token so the check under test is ownership.
    browser = AsyncClient(enforce_csrf_checks=True)
    await browser.aforce_login(user)
    secret, token = csrf_pair()
    browser.cookies[settings.CSRF_COOKIE_NAME] = secret
    return Api(browser, {"X-CSRFToken": token})


@pytest.mark.parametrize("auth", ["bearer", "session"])
async def test_every_endpoint_answers_404_for_another_users_ids(
    auth: str, user: Any, victim: dict[str, Any]
) -> None:
    # covers: F2, E3
    alice = await caller_api(auth, user)
    own = await alice.create(dialog_id="default")  # the same dialog id as Bob's
    before = await sync_to_async(owned_state)(victim["user"].pk)
    bob_pk = victim["user"].pk

    def unknown_like(session_id: str) -> str:
        channel, chat_id, _dialog = session_id.split(":")
        return f"{channel}:{chat_id}:no-such-dialog"

    calls = 0
    for method, template, body, headers in SESSION_ENDPOINTS:
        for sid in victim["session_ids"]:
            ref = await alice.call(method, template.format(sid=unknown_like(sid)), body, headers)
            got = await alice.call(method, template.format(sid=sid), body, headers)
            status, data, _ = got
            assert status == 404, (method, template, sid, status, data)
            assert data["code"] == "not_found"
            assert data == ref[1], "another user's dialog must look like a missing one"
            calls += 1
    for method, template, body, headers in TURN_ENDPOINTS:
        for tid in victim["turn_ids"]:
            _, ref, _ = await alice.call(method, template.format(tid=uuid.uuid4()), body, headers)
            status, data, _ = await alice.call(method, template.format(tid=tid), body, headers)
            assert status == 404, (method, template, tid, status, data)
            assert data == ref
            calls += 1
    assert calls == len(SESSION_ENDPOINTS) * 3 + len(TURN_ENDPOINTS) * 2

    # Creating a dialog in one of Bob's chats is refused the same way.
    for body in (
        {"chat_id": f"u{bob_pk}", "dialog_id": "mine"},
        {"chat_id": f"u{bob_pk}.work", "dialog_id": "mine"},
        {"channel": "web", "chat_id": f"u{bob_pk}", "dialog_id": "default"},
        {"channel": "cli", "chat_id": f"u{bob_pk}"},
    ):
        status, data = await alice.post("/sessions", body)
        assert status == 404, (body, data)

    assert await sync_to_async(owned_state)(bob_pk) == before
    # Alice's own dialog of the same id is untouched by all this and still hers.
    status, mine = await alice.get(f"/sessions/{own['session_id']}")
    assert status == 200 and mine["history_revision"] == 1


@pytest.mark.parametrize("auth", ["bearer", "session"])
async def test_lists_never_show_another_users_dialogs(
    auth: str, user: Any, victim: dict[str, Any]
) -> None:
    # covers: F2, E3
    alice = await caller_api(auth, user)
    own = await alice.create(dialog_id="default")
    bob_pk = victim["user"].pk
    status, data = await alice.get("/sessions", limit=100)
    assert status == 200
    assert [i["session_id"] for i in data["items"]] == [own["session_id"]]
    assert data["count"] == 1
    for params in (
        {"chat_id": f"u{bob_pk}"},
        {"chat_id": f"u{bob_pk}.work"},
        {"channel": "web"},
        {"channel": "web", "chat_id": f"u{bob_pk}"},
        {"channel": "api", "chat_id": f"u{bob_pk}"},
    ):
        status, data = await alice.get("/sessions", **params)
        assert status == 200
        assert data == {"items": [], "count": 0}, params
    # Paging past one's own dialogs never reaches anyone else's.
    status, data = await alice.get("/sessions", offset=1, limit=100)
    assert data == {"items": [], "count": 1}

    # Bob still sees all of his.
    _, bobs = await victim["api"].get("/sessions", limit=100)
    assert sorted(i["session_id"] for i in bobs["items"]) == sorted(victim["session_ids"])


async def test_a_users_own_ids_work_on_every_endpoint_as_a_control(
    user: Any, victim: dict[str, Any]
) -> None:
    # The matrix above is only meaningful if the same calls succeed for the owner.
    bob = victim["api"]
    sid = victim["session_ids"][1]
    for method, template, body, headers in SESSION_ENDPOINTS:
        if method == "DELETE" or headers or "retry" in template:
            continue
        status, data, _ = await bob.call(method, template.format(sid=sid), body, headers)
        assert status in (200, 202), (method, template, status, data)
    for tid in victim["turn_ids"]:
        status, _ = await bob.get(f"/turns/{tid}")
        assert status == 200
