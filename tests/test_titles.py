"""B4 as people expect it: a first title right after a dialog's first answer, the seed's title
at the threshold in its place while no person renamed the dialog, and failed titles retried a
bounded number of times with backoff. In both modes (in-process jobs, and a real Celery
worker on Redis), with the fixtures of test_background."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import override_settings

from sessions_app import services
from sessions_app.models import Session
from tests.engine_helpers import chat_group_of, make_dialog
from tests.fakemodel import Reply
from tests.test_background import (  # noqa: F401 - the shared fixtures
    Model,
    chat,
    mode,
    model,
    title_of,
    until,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


@pytest.fixture
def first_titles(mode: str) -> Any:
    """Titles after the first answer (on by default; the suite turns them off elsewhere), the
    seed's at three user messages, quick retries."""
    chat_cfg = {
        **settings.CHAT,
        "FIRST_TITLE": True,
        "AUTO_TITLE_AFTER": 3,
        "TITLE_RETRY_DELAYS": [0.1, 0.2, 0.3],
    }
    with override_settings(CHAT=chat_cfg):
        yield mode


def updates(rec: Any) -> list[str]:
    return [f["title"] for f in rec.frames if f["type"] == "session_updated"]


async def test_a_first_title_after_one_answer_then_the_seeds_at_the_threshold(
    first_titles, model: Model, make_engine, recorder, user
) -> None:
    # covers: B4
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))

    await chat(engine, session, rec, "I want to visit Kyoto")

    await rec.until(lambda f: f["type"] == "session_updated", timeout=30)
    assert await title_of(session) == ("Kyoto trip plans", "first")
    assert "I want to visit Kyoto" in model.title_requests[0]["messages"][1]["content"]

    # Before the threshold nothing asks again; at it the seed's title replaces the first.
    model.title = Reply(text="Kyoto in spring")
    await chat(engine, session, rec, "in spring")
    assert len(model.title_requests) == 1
    await chat(engine, session, rec, "with my family")
    await rec.until(lambda f: f.get("title") == "Kyoto in spring", timeout=30)
    assert await title_of(session) == ("Kyoto in spring", "auto")
    assert updates(rec) == ["Kyoto trip plans", "Kyoto in spring"]
    assert len(model.title_requests) == 2


async def test_a_persons_rename_of_the_first_title_wins_at_the_threshold(
    first_titles, model: Model, make_engine, recorder, user
) -> None:
    # covers: B4
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    await chat(engine, session, rec, "I want to visit Kyoto")
    await until(lambda: Session.objects.get(pk=session.pk).title_source == "first")

    fresh = await sync_to_async(Session.objects.get)(pk=session.pk)
    await sync_to_async(services.session_rename)(session=fresh, title="Our trip")
    await chat(engine, session, rec, "in spring", "with my family", "by train")
    await asyncio.sleep(0.5)

    assert await title_of(session) == ("Our trip", "user")
    assert len(model.title_requests) == 1


async def test_a_failed_title_is_retried_three_times_backing_off_then_left(
    first_titles, model: Model, make_engine, recorder, user, caplog
) -> None:
    # covers: B4, C10
    # A refusal the provider does not retry itself: one request per attempt.
    model.title = Reply(status=400, error={"message": "bad request", "type": "invalid"})
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    await chat(engine, session, rec, "I want to visit Kyoto")
    await until(lambda: Session.objects.get(pk=session.pk).title_attempts == 4)

    # One attempt and three retries, each sent after a longer wait than the one before (the
    # fake server stamps each request as it arrives).
    assert len(model.title_requests) == 4
    at = model.title_arrivals
    gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2 and gaps[2] >= 0.3, gaps
    assert await title_of(session) == ("Dialog default", "default")
    with pytest.raises(TimeoutError):
        await rec.until(lambda f: f["type"] == "session_updated", timeout=0.5)

    # Given up: the next answers ask no more.
    await chat(engine, session, rec, "in spring")
    await asyncio.sleep(0.5)
    assert len(model.title_requests) == 4


async def test_a_retry_that_succeeds_commits_and_resets_the_count(
    first_titles, model: Model, make_engine, recorder, user
) -> None:
    # covers: B4
    model.title = Reply(status=400, error={"message": "bad request", "type": "invalid"})
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    await chat(engine, session, rec, "I want to visit Kyoto")
    await until(lambda: bool(model.title_requests))
    model.title = Reply(text="Kyoto trip plans")

    await until(lambda: Session.objects.get(pk=session.pk).title_source == "first")

    fresh = await sync_to_async(Session.objects.get)(pk=session.pk)
    assert (fresh.title, fresh.title_attempts) == ("Kyoto trip plans", 0)
    assert len(model.title_requests) == 2
