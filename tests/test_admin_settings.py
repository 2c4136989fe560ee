"""A dialog's model and system prompt in the admin, and the token usage table (SPEC H4, E2)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from sessions_app import services
from sessions_app.models import Session, Turn, TurnStatus
from tests.fakemodel import FakeModelServer

pytestmark = [pytest.mark.django_db, pytest.mark.both_dbs]

USAGE = reverse("admin:sessions_app_session_usage")


@pytest.fixture
def listing_server(settings: Any) -> Iterator[FakeModelServer]:
    server = FakeModelServer().start()
    server.models = ["fake", "big-model"]
    settings.LLM = {**settings.LLM, "BASE_URL": server.url, "MODEL": "fake", "MODELS": []}
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def operator(client: Client, make_user: Callable[..., Any]) -> Any:
    staff = make_user("operator", staff=True)
    client.force_login(staff)
    return staff


def dialog(owner: Any, dialog_id: str, title: str | None = None) -> Session:
    return services.session_create(
        owner=owner, channel="web", chat_id=f"u{owner.pk}", dialog_id=dialog_id, title=title
    )


def finished_turn(
    session: Session, number: int, usage: dict[str, Any], days_ago: int = 0, model: str = "fake"
) -> None:
    Turn.objects.create(
        session=session,
        owner=session.owner,
        number=number,
        status=TurnStatus.COMPLETED,
        usage=usage,
        model=model,
        finished_at=timezone.now() - timedelta(days=days_ago),
    )


def post_change(client: Client, session: Session, **fields: str) -> Any:
    data = {
        "title": session.title,
        "model": session.model,
        "system_prompt": session.system_prompt,
        "messages-TOTAL_FORMS": "0",
        "messages-INITIAL_FORMS": "0",
        "messages-MIN_NUM_FORMS": "0",
        "messages-MAX_NUM_FORMS": "0",
        **fields,
    }
    return client.post(reverse("admin:sessions_app_session_change", args=[session.pk]), data)


def test_the_dialog_page_sets_the_model_and_system_prompt(
    client: Client, operator: Any, user: Any, listing_server: FakeModelServer
) -> None:
    # covers: H4, E2
    s = dialog(user, "ops")
    page = client.get(reverse("admin:sessions_app_session_change", args=[s.pk]))
    choices = [value for value, _label in page.context["adminform"].form.fields["model"].choices]
    assert choices == ["", "fake", "big-model"]
    response = post_change(client, s, model="big-model", system_prompt="  Be brief.  ")
    assert response.status_code == 302, response.context["adminform"].form.errors
    after = Session.objects.get(pk=s.pk)
    assert (after.model, after.system_prompt) == ("big-model", "Be brief.")
    assert after.state_version == s.state_version + 1

    # A model the server does not offer and a too long prompt are form errors; nothing changes.
    response = post_change(client, after, model="gpt-17")
    assert "model" in response.context["adminform"].form.errors
    response = post_change(client, after, system_prompt="x" * 20_001)
    assert "system_prompt" in response.context["adminform"].form.errors
    assert Session.objects.get(pk=s.pk).model == "big-model"
    # Back to the default.
    post_change(client, after, model="")
    assert Session.objects.get(pk=s.pk).model == ""


def test_the_usage_table_sums_per_dialog_user_model_and_day_and_sorts(
    client: Client, operator: Any, make_user: Callable[..., Any]
) -> None:
    # covers: H4, E2
    ann, bob = make_user("ann"), make_user("bob")
    a1, a2, b1 = dialog(ann, "a1", "Ann one"), dialog(ann, "a2", "Ann two"), dialog(bob, "b1")
    cached = {"prompt_tokens_details": {"cached_tokens": 50}}
    finished_turn(a1, 1, {"prompt_tokens": 100, "completion_tokens": 10, **cached})
    finished_turn(a1, 2, {"prompt_tokens": 200, "completion_tokens": 20})
    finished_turn(a2, 1, {"prompt_tokens": 1000, "completion_tokens": 1}, 3, "big-model")
    finished_turn(b1, 1, {"prompt_tokens": 5, "completion_tokens": 5.0}, days_ago=40)
    finished_turn(b1, 2, {}, days_ago=40)  # a server that reported nothing

    changelist = client.get(reverse("admin:sessions_app_session_changelist"))
    assert USAGE in changelist.content.decode()

    by_user = client.get(USAGE, {"group": "user", "period": "all", "o": "-prompt_tokens"})
    assert by_user.status_code == 200
    rows = [(r["key"], r["prompt_tokens"], r["cached_tokens"]) for r in by_user.context["rows"]]
    assert rows == [("ann", 1300, 50), ("bob", 5, 0)]
    assert by_user.context["totals"]["turns"] == 4
    assert by_user.context["totals"]["total_tokens"] == 1341

    by_dialog = client.get(USAGE, {"group": "dialog", "period": "30", "o": "completion_tokens"})
    keys = [r["key"] for r in by_dialog.context["rows"]]
    assert keys == [a2.session_id, a1.session_id]  # bob's is older than 30 days
    assert "Ann two" in by_dialog.content.decode()

    by_model = client.get(USAGE, {"group": "model", "period": "all", "o": "key"})
    rows = [(r["key"], r["prompt_tokens"], r["turns"]) for r in by_model.context["rows"]]
    assert rows == [("big-model", 1000, 1), ("fake", 305, 3)]

    by_day = client.get(USAGE, {"group": "day", "period": "7"})
    days = [r["key"] for r in by_day.context["rows"]]
    assert days == sorted(days, reverse=True) and len(days) == 2


def test_the_usage_table_needs_a_staff_login(client: Client, user: Any) -> None:
    # covers: H4, F2
    client.force_login(user)
    response = client.get(USAGE)
    assert response.status_code == 302 and reverse("admin:login") in response["Location"]
