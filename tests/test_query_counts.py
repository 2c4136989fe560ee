"""Query counts pinned on hot paths (STYLE 12): they must not grow with the history."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from chatcore.engine import clientstate
from sessions_app import selectors, services

pytestmark = [pytest.mark.django_db, pytest.mark.both_dbs]


def dialog_with(user: Any, n: int, name: str | None = None) -> Any:
    session = services.session_create(
        owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id=name or f"d{n}"
    )
    if n:
        services.messages_append(
            session_pk=session.pk,
            messages=[
                services.NewMessage(role="user", content=f"m{i}", kind="user_input")
                for i in range(n)
            ],
        )
    return session


@pytest.mark.parametrize("size", [1, 50])
def test_append_costs_the_same_for_one_or_many(size, user, django_assert_num_queries):
    # covers: A3, A4 (one transaction, one insert whatever the batch size; on PostgreSQL the
    # insert and the row's update are one statement, `rows.merged`)
    session = dialog_with(user, 3)
    batch = [services.NewMessage(role="user", content="x", kind="user_input") for _ in range(size)]
    with django_assert_num_queries(QUERIES["append"][connection.vendor]):
        services.messages_append(
            session_pk=session.pk, session=session, messages=batch, publish_delta=False
        )


@pytest.mark.parametrize("size", [2, 120])
def test_session_history_frame_does_not_grow_with_history(size, user, django_assert_num_queries):
    # covers: D2
    session = dialog_with(user, size)
    with django_assert_num_queries(QUERIES["history"]):
        frame = clientstate.session_history_frame(session=session, engine=None)
    assert len(frame["messages"]) == min(size + 1, 100)


def test_dialog_list_is_one_query(user, django_assert_num_queries):
    # covers: B3
    for i in range(12):
        dialog_with(user, 1, name=f"x{i}")
    with django_assert_num_queries(1):
        items = selectors.dialog_list_for_chat(
            owner_id=user.pk, channel="web", chat_id=f"u{user.pk}"
        )
    assert len(items) == 10


QUERIES: dict[str, Any] = {"append": {"sqlite": 5, "postgresql": 4}, "history": 4}
