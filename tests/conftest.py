"""Shared fixtures. Infrastructure: SQLite unless DATABASE_URL is set (the Makefile's second
pass runs the `both_dbs` modules on PostgreSQL); the in-memory channel layer unless a test is
about Redis. Tests that need PostgreSQL or Redis skip with a reason on a machine without them,
and fail in CI (CI=true), where they must run."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth import get_user_model

IN_CI = os.environ.get("CI", "").lower() == "true"
_counter = itertools.count(1)


def pytest_configure(config: pytest.Config) -> None:
    for marker in (
        "both_dbs: the module also runs on PostgreSQL in the second pass of make test",
        "postgres: needs PostgreSQL (TEST_DATABASE_URL)",
        "redis: needs Redis (TEST_REDIS_URL)",
        "browser: drives a real headless Chromium",
        "slow: starts subprocesses or servers",
    ):
        config.addinivalue_line("markers", marker)


def require_service(env_name: str, what: str) -> str:
    """The URL of a real service for this test, or skip (fail in CI) with a clear reason."""
    url = os.environ.get(env_name, "").strip()
    if not url:
        reason = f"{what} not configured: set {env_name} to run this test"
        if IN_CI:
            pytest.fail(reason + " (CI must run it)")
        pytest.skip(reason)
    return url


@pytest.fixture
def redis_url() -> str:
    return require_service("TEST_REDIS_URL", "Redis")


@pytest.fixture
def make_user(db: None) -> Callable[..., Any]:
    def factory(username: str | None = None, *, staff: bool = False, password: str = "pw-12345!") -> Any:
        name = username or f"user{next(_counter)}"
        model = get_user_model()
        if staff:
            return model.objects.create_superuser(name, f"{name}@example.com", password)
        return model.objects.create_user(name, f"{name}@example.com", password)

    return factory


@pytest.fixture
def user(make_user: Callable[..., Any]) -> Any:
    return make_user("alice")


@pytest.fixture
def other_user(make_user: Callable[..., Any]) -> Any:
    return make_user("bob")
