"""Login throttling (issue 56 row 10; SPEC F8): failed logins on the web and admin login
pages are logged and recorded by django-axes; a username that keeps failing from one address
is refused (429) even with the right password until the cool-off passes, while other users
and addresses sign in as usual. Every test has its own database, so no test is locked out by
another's failures."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from axes.models import AccessAttempt
from django.conf import settings
from django.test import Client
from django.utils import translation

pytestmark = pytest.mark.django_db

PASSWORD = "pw-12345!"


def attempt(client: Client, path: str, username: str, password: str, **extra: Any) -> Any:
    return client.post(path, {"username": username, "password": password}, **extra)


@pytest.mark.parametrize("path", ["/accounts/login/", "/admin/login/"])
def test_repeated_failures_lock_that_user_out_from_that_address(
    make_user: Any, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    # covers: F8 (issue 56 row 10: 30 wrong admin passwords then the right one logged in,
    # and no failure was logged)
    target = make_user("victim", staff=True, password=PASSWORD)
    make_user("bystander", staff=True, password=PASSWORD)
    client = Client(REMOTE_ADDR="203.0.113.7")
    with caplog.at_level(logging.WARNING):
        for _ in range(settings.AXES_FAILURE_LIMIT - 1):
            assert attempt(client, path, "victim", "wrong").status_code == 200
        locked = attempt(client, path, "victim", "wrong")
    assert locked.status_code == 429
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("axes")]
    assert sum("login failure by" in line for line in logged) == settings.AXES_FAILURE_LIMIT
    assert any("Locking out" in line for line in logged)
    assert AccessAttempt.objects.get(username="victim").failures_since_start == (
        settings.AXES_FAILURE_LIMIT
    )
    # The right password does not get in now.
    refused = attempt(client, path, "victim", PASSWORD)
    assert refused.status_code == 429
    assert "_auth_user_id" not in client.session
    assert b"Too many failed sign-ins" in refused.content
    # Another user from the same address, and the same user from another address, sign in.
    assert (
        attempt(Client(REMOTE_ADDR="203.0.113.7"), path, "bystander", PASSWORD).status_code == 302
    )
    elsewhere = Client(REMOTE_ADDR="198.51.100.2")
    assert attempt(elsewhere, path, "victim", PASSWORD).status_code == 302
    assert int(elsewhere.session["_auth_user_id"]) == target.pk


def test_a_success_before_the_limit_clears_the_failures(make_user: Any) -> None:
    # covers: F8 (a user who mistyped a few times is not counted down for the day)
    make_user("typo", password=PASSWORD)
    client = Client(REMOTE_ADDR="203.0.113.9")
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        attempt(client, "/accounts/login/", "typo", "wrong")
    assert attempt(client, "/accounts/login/", "typo", PASSWORD).status_code == 302
    client.logout()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        assert attempt(client, "/accounts/login/", "typo", "wrong").status_code == 200


def test_the_lockout_page_speaks_chinese_too(make_user: Any) -> None:
    # covers: F5, F8
    make_user("zh", password=PASSWORD)
    client = Client(REMOTE_ADDR="203.0.113.10", HTTP_ACCEPT_LANGUAGE="zh-hans")
    for _ in range(settings.AXES_FAILURE_LIMIT):
        attempt(client, "/accounts/login/", "zh", "wrong")
    page = attempt(client, "/accounts/login/", "zh", PASSWORD).content.decode()
    with translation.override("zh-hans"):
        expected = translation.gettext(
            "Too many failed sign-ins for this account from here. Please try again later."
        )
    assert expected in page and "Too many failed" not in page


def test_a_login_without_a_request_is_left_to_the_model_backend(make_user: Any) -> None:
    # covers: F2 (a test client's or a command's login has no address to throttle by)
    make_user("plain", password=PASSWORD)
    assert Client().login(username="plain", password=PASSWORD)
    assert not Client().login(username="plain", password="wrong")


def test_behind_a_trusted_proxy_the_forwarded_address_counts(make_user: Any, settings: Any) -> None:
    # covers: F8 (behind deploy/nginx.conf every login comes from the proxy's address; the
    # address it appends is the client's, and one the client sent itself is not trusted)
    settings.TRUST_X_FORWARDED_FOR = True
    make_user("proxied", password=PASSWORD)
    proxy = "127.0.0.1"
    attacker = Client(REMOTE_ADDR=proxy, HTTP_X_FORWARDED_FOR="198.51.100.9, 203.0.113.66")
    for _ in range(settings.AXES_FAILURE_LIMIT):
        attempt(attacker, "/accounts/login/", "proxied", "wrong")
    assert AccessAttempt.objects.get().ip_address == "203.0.113.66"
    assert attempt(attacker, "/accounts/login/", "proxied", PASSWORD).status_code == 429
    # The same user from another client behind the same proxy signs in.
    owner = Client(REMOTE_ADDR=proxy, HTTP_X_FORWARDED_FOR="203.0.113.77")
    assert attempt(owner, "/accounts/login/", "proxied", PASSWORD).status_code == 302
    # A forged first hop does not change the address counted.
    forged = Client(REMOTE_ADDR=proxy, HTTP_X_FORWARDED_FOR="203.0.113.77, 203.0.113.66")
    assert attempt(forged, "/accounts/login/", "proxied", PASSWORD).status_code == 429
