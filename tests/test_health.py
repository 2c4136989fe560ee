"""`/healthz` answers within its timeout whatever hangs (issue 56; SPEC F4, I3): each
dependency is checked side by side, one that does not answer in CHAT["HEALTH_TIMEOUT_SECONDS"]
is reported `timed_out`, and an unreachable database makes the answer 503. A frozen Redis
(SIGSTOP) in scaled mode is in test_redis_freeze.py."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.db import OperationalError
from django.test import AsyncClient

from sessions_app import views

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


async def timed_health() -> tuple[float, Any]:
    started = time.monotonic()
    response = await AsyncClient().get("/healthz")
    return time.monotonic() - started, response


async def test_health_reports_each_dependency_ok() -> None:
    # covers: F4
    took, response = await timed_health()
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["database"]["ok"] and body["channel_layer"]["ok"] and body["broker"]["ok"]
    assert took < 3.0


async def test_a_hanging_database_check_is_reported_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # covers: I3, F4 (issue 56: health took 10 s whenever a dependency hung)
    def hangs() -> dict[str, Any]:
        time.sleep(4)
        return {"ok": True, "vendor": "late"}

    monkeypatch.setattr(views, "_check_database", hangs)
    took, response = await timed_health()
    assert took < 3.0, took  # 1.5 s of timeout, and room for a loaded machine
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "degraded"
    assert body["database"]["ok"] is False and body["database"]["timed_out"] is True
    assert body["channel_layer"]["ok"] and body["broker"]["ok"]


async def test_an_unreachable_database_answers_503(monkeypatch: pytest.MonkeyPatch) -> None:
    # covers: F4, I3 (503 when the database is unreachable)
    from django.db import connection, connections

    def refuses(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("connection refused")

    # On every thread's connection (the check runs on a database thread).
    monkeypatch.setattr(type(connections["default"]), "cursor", refuses)
    took, response = await timed_health()
    assert took < 3.0
    assert response.status_code == 503
    assert response.json()["database"] == {"ok": False, "vendor": connection.vendor}
