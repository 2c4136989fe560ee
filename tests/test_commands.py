"""Management commands for operators: `issue_token` (F2) and `ensure_demo_user` (make run)."""

from __future__ import annotations

from collections.abc import Callable
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError

from sessions_app.auth import user_for_token
from sessions_app.models import ApiToken

# both_dbs: token and user writes also run on PostgreSQL in the second pass of `make test`.
pytestmark = [pytest.mark.django_db, pytest.mark.both_dbs]


def run(*args: str, **options: Any) -> list[str]:
    out = StringIO()
    call_command(*args, stdout=out, **options)
    return out.getvalue().splitlines()


# --- issue_token ----------------------------------------------------------------------------


def test_issue_token_prints_a_working_token_as_last_line(user: Any) -> None:
    # covers: F2
    lines = run("issue_token", "alice", "--name", "ci")

    token = lines[-1].strip()
    assert token and " " not in token
    assert user_for_token(token) == user
    stored = ApiToken.objects.get(user=user)
    assert stored.name == "ci"
    assert token not in (stored.key_hash, stored.prefix)  # only the hash is stored


def test_issue_token_twice_gives_two_independent_tokens(user: Any) -> None:
    # covers: F2
    first = run("issue_token", "alice")[-1]
    second = run("issue_token", "alice")[-1]

    assert first != second
    assert user_for_token(first) == user
    assert user_for_token(second) == user


def test_issue_token_quiet_prints_only_the_token(user: Any) -> None:
    # covers: F2
    lines = run("issue_token", "alice", verbosity=0)

    assert len(lines) == 1
    assert user_for_token(lines[0]) == user


def test_issue_token_unknown_user_is_an_error_and_creates_nothing() -> None:
    # covers: F2
    user_model = get_user_model()

    with pytest.raises(CommandError, match="--create-user"):
        run("issue_token", "nobody")

    assert not user_model.objects.filter(username="nobody").exists()
    assert not ApiToken.objects.exists()


def test_issue_token_create_user_creates_an_api_only_user() -> None:
    # covers: F2
    lines = run("issue_token", "robot", "--create-user")

    created = get_user_model().objects.get(username="robot")
    assert not created.has_usable_password()
    assert not created.is_staff
    assert user_for_token(lines[-1]) == created
    assert any("Created user" in line for line in lines[:-1])


def test_issue_token_create_user_with_an_existing_user_reuses_it(user: Any) -> None:
    # covers: F2
    lines = run("issue_token", "alice", "--create-user")

    assert get_user_model().objects.filter(username="alice").count() == 1
    assert user_for_token(lines[-1]) == user


def test_issue_token_rejects_an_invalid_new_username() -> None:
    # covers: F2
    with pytest.raises(CommandError, match="Invalid username"):
        run("issue_token", "no spaces please", "--create-user")

    assert not get_user_model().objects.exists()


def test_issue_token_refuses_an_inactive_user(make_user: Callable[..., Any]) -> None:
    # covers: F2
    inactive = make_user("sleepy")
    inactive.is_active = False
    inactive.save()

    with pytest.raises(CommandError, match="inactive"):
        run("issue_token", "sleepy")

    assert not ApiToken.objects.exists()


# --- ensure_demo_user -----------------------------------------------------------------------


def test_ensure_demo_user_creates_a_plain_login_and_prints_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # covers: F8 (issue 56 row 10: the demo login is never staff by default)
    monkeypatch.delenv("DEMO_PASSWORD", raising=False)

    out = "\n".join(run("ensure_demo_user", "--port", "8123"))

    demo = get_user_model().objects.get(username="demo")
    assert demo.is_active and not demo.is_staff and not demo.is_superuser
    assert demo.check_password("demo-password")
    assert "Demo login: demo / demo-password" in out
    assert "http://127.0.0.1:8123/" in out and "admin" not in out


def test_ensure_demo_user_with_staff_makes_the_admin_login_of_make_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # covers: F2, F8 (`make run` passes --staff: the admin works on a local demo)
    monkeypatch.delenv("DEMO_PASSWORD", raising=False)

    out = "\n".join(run("ensure_demo_user", "--staff", "--port", "8123"))

    demo = get_user_model().objects.get(username="demo")
    assert demo.is_staff and demo.is_superuser and demo.is_active
    assert "http://127.0.0.1:8123/admin/" in out


def test_ensure_demo_user_makes_none_once_a_deployment_key_is_set(settings: Any) -> None:
    # covers: F8 (issue 56 row 10: no demo login with a known password on a deployment)
    settings.SECRET_KEY = "a-real-deployment-key-0123456789-abcdefghijklmnopqrstuvwxyz"

    err = StringIO()
    call_command("ensure_demo_user", "--staff", stdout=StringIO(), stderr=err)

    assert "this machine only" in err.getvalue()
    assert not get_user_model().objects.filter(username="demo").exists()


def test_ensure_demo_user_is_idempotent_and_keeps_a_changed_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DEMO_PASSWORD", raising=False)
    run("ensure_demo_user")
    again = "\n".join(run("ensure_demo_user"))

    assert get_user_model().objects.filter(username="demo").count() == 1
    assert "Demo login: demo / demo-password" in again

    demo = get_user_model().objects.get(username="demo")
    demo.set_password("changed-by-the-user")
    demo.save()
    changed = "\n".join(run("ensure_demo_user"))

    demo.refresh_from_db()
    assert demo.check_password("changed-by-the-user")
    assert "demo-password" not in changed
    assert "--reset" in changed


def test_ensure_demo_user_reset_restores_password_and_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DEMO_PASSWORD", raising=False)
    run("ensure_demo_user", "--staff")
    demo = get_user_model().objects.get(username="demo")
    demo.set_password("changed-by-the-user")
    demo.is_superuser = False
    demo.save()

    out = "\n".join(run("ensure_demo_user", "--reset", "--staff"))

    demo.refresh_from_db()
    assert demo.check_password("demo-password")
    assert demo.is_superuser
    assert "Demo login: demo / demo-password" in out


def test_ensure_demo_user_takes_the_configured_password(settings: Any) -> None:
    # DEMO_PASSWORD in the environment becomes settings.DEMO_PASSWORD.
    settings.DEMO_PASSWORD = "from-the-env-123"

    out = "\n".join(run("ensure_demo_user"))

    assert get_user_model().objects.get(username="demo").check_password("from-the-env-123")
    assert "Demo login: demo / from-the-env-123" in out
