"""The admin's dialog page on a forked dialog (SPEC H1, E2): the active path, its forks
marked with the number of versions and a link to all of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import transaction
from django.test import Client
from django.urls import reverse

from sessions_app import branch_services, services
from sessions_app.models import MessageKind, Role, Session

pytestmark = [pytest.mark.django_db, pytest.mark.both_dbs]


@pytest.fixture
def operator(client: Client, make_user: Callable[..., Any]) -> Any:
    staff = make_user("operator", staff=True)
    client.force_login(staff)
    return staff


def _append(session: Session, role: str, text: str, parent: Any = False) -> int:
    kind = MessageKind.USER_INPUT if role == Role.USER else MessageKind.ASSISTANT
    with transaction.atomic():
        live = services.lock_session(session.pk)
        assert live is not None
        appended = services.append_locked(
            live, [services.NewMessage(role=role, content=text, kind=kind)], parent_seq=parent
        )
    return appended.messages[0].seq


# covers: H1, E2
def test_the_dialog_page_shows_the_active_path_and_marks_forks(
    client: Client, operator: Any, user: Any
) -> None:
    s = services.session_create(owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id="t")
    q = _append(s, Role.USER, "original question")
    _append(s, Role.ASSISTANT, "original answer")
    edited = _append(s, Role.USER, "edited question", parent=1)
    _append(s, Role.ASSISTANT, "edited answer")
    again = _append(s, Role.USER, "third version", parent=1)

    url = reverse("admin:sessions_app_session_change", args=[s.pk])
    response = client.get(url)
    assert response.status_code == 200
    formset = response.context["inline_admin_formsets"][0].formset
    assert [m.seq for m in formset.queryset] == [1, again]
    body = response.content.decode()
    assert "third version" in body and "original answer" not in body
    assert "3 of 3" in body
    assert "parent_seq=1" in body

    branch_services.branch_switch(session=s, seq=edited)
    response = client.get(url)
    formset = response.context["inline_admin_formsets"][0].formset
    assert [m.content for m in formset.queryset][1:] == ["edited question", "edited answer"]
    assert "2 of 3" in response.content.decode()

    # The link lists every version of the fork.
    listing = client.get(
        reverse("admin:sessions_app_message_changelist"), {"session": s.pk, "parent_seq": 1}
    )
    assert listing.status_code == 200
    shown = {m.seq for m in listing.context["cl"].result_list}
    assert shown == {q, edited, again}
