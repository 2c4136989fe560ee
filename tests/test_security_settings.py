"""Headers, TLS switches, the serve command's secret-key guard and who may issue tokens in the
admin (SPEC F8): pages send a Content-Security-Policy without inline script and `nosniff`;
the TLS switches turn on secure cookies and HSTS; `serve` refuses to listen beyond loopback
with the built-in key; staff who are not superusers issue tokens only for themselves."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from sessions_app import services
from sessions_app.models import ApiToken
from tests.procs import ROOT, embedded_env, free_port, manage, popen_manage

pytestmark = pytest.mark.django_db

TEMPLATES = ROOT / "templates"


def directives(response: Any) -> dict[str, str]:
    policy = response["Content-Security-Policy"]
    out = {}
    for part in policy.split(";"):
        name, _, value = part.strip().partition(" ")
        out[name] = value
    return out


def assert_locked_down(response: Any) -> None:
    policy = directives(response)
    assert policy["script-src"] == "'self'"
    assert "'unsafe-inline'" not in policy["script-src"]
    assert "'unsafe-eval'" not in policy["script-src"]
    assert policy["frame-ancestors"] == "'none'"
    assert policy["object-src"] == "'none'"
    assert response["X-Content-Type-Options"] == "nosniff"


def inline_scripts(html: str) -> list[str]:
    """<script> elements that would execute inline code: no src, and a script type."""
    found = []
    for attrs, body in re.findall(r"<script([^>]*)>(.*?)</script>", html, re.S):
        kind = re.search(r'type="([^"]+)"', attrs)
        if "src=" in attrs or (kind and kind.group(1) == "application/json"):
            continue
        found.append(body)
    return found


def test_chat_page_login_page_and_admin_send_csp_and_nosniff(
    client: Client, make_user: Any
) -> None:
    # covers: F8 (headers)
    login_page = client.get(reverse("login"))
    assert login_page.status_code == 200
    assert_locked_down(login_page)
    assert inline_scripts(login_page.content.decode()) == []

    client.force_login(make_user("root", staff=True))
    chat = client.get("/")
    assert chat.status_code == 200
    assert_locked_down(chat)
    assert inline_scripts(chat.content.decode()) == []
    for url in (
        reverse("admin:index"),
        reverse("admin:sessions_app_session_changelist"),
        reverse("admin:sessions_app_apitoken_add"),
        reverse("admin:auth_user_changelist"),
    ):
        page = client.get(url)
        assert page.status_code == 200, url
        assert_locked_down(page)
        assert inline_scripts(page.content.decode()) == [], url
    # Error answers and API responses carry them too.
    assert_locked_down(client.get("/no-such-page"))
    assert_locked_down(client.get("/api/v1/sessions"))


def test_templates_hold_no_inline_script_or_handlers() -> None:
    # covers: F8 (no inline script: every template of the project)
    for path in TEMPLATES.rglob("*.html"):
        html = path.read_text()
        assert inline_scripts(html) == [], path
        assert not re.search(r"\son[a-z]+\s*=", html), path
        assert "javascript:" not in html, path


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, {"cookies": False, "hsts": 0, "proxy": None, "trusted": []}),
        (
            {
                "DJANGO_SECURE_COOKIES": "1",
                "DJANGO_HSTS_SECONDS": "31536000",
                "DJANGO_TRUST_X_FORWARDED_PROTO": "1",
                "DJANGO_CSRF_TRUSTED_ORIGINS": "https://chat.example.com, https://b.example.com",
            },
            {
                "cookies": True,
                "hsts": 31536000,
                "proxy": ["HTTP_X_FORWARDED_PROTO", "https"],
                "trusted": ["https://chat.example.com", "https://b.example.com"],
            },
        ),
    ],
)
def test_tls_switches_come_from_the_environment(
    tmp_path: Path, env: dict[str, str], expected: dict[str, Any]
) -> None:
    # covers: F8 (secure-cookie and HSTS switches)
    script = (
        "import json; from django.conf import settings as s; print(json.dumps({"
        "'cookies': s.SESSION_COOKIE_SECURE and s.CSRF_COOKIE_SECURE, "
        "'hsts': s.SECURE_HSTS_SECONDS, 'proxy': s.SECURE_PROXY_SSL_HEADER, "
        "'trusted': s.CSRF_TRUSTED_ORIGINS}))"
    )
    done = manage("shell", "-c", script, env=embedded_env(tmp_path, **env))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected


def test_hsts_and_secure_cookies_behind_a_tls_proxy(
    client: Client, make_user: Any, settings: Any
) -> None:
    # covers: F8 (what the switches do to responses)
    settings.SECURE_HSTS_SECONDS = 3600
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    settings.SESSION_COOKIE_SECURE = settings.CSRF_COOKIE_SECURE = True
    user = make_user("tls")
    page = client.get(reverse("login"), headers={"X-Forwarded-Proto": "https"})
    assert page["Strict-Transport-Security"] == "max-age=3600"
    assert page.cookies["csrftoken"]["secure"] is True
    done = client.post(
        reverse("login"),
        {"username": user.username, "password": "pw-12345!"},
        headers={"X-Forwarded-Proto": "https"},
    )
    assert done.status_code == 302
    assert done.cookies["sessionid"]["secure"] is True
    # Plain http (no proxy header) gets no HSTS.
    assert "Strict-Transport-Security" not in client.get(reverse("login"))


# --- serve and the built-in secret key --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1", "chat.example.com"])  # noqa: S104
def test_serve_refuses_a_public_address_with_the_builtin_key(tmp_path: Path, host: str) -> None:
    # covers: F8 (the built-in secret key stays on loopback)
    env = embedded_env(tmp_path, DJANGO_SECRET_KEY="")
    done = manage("serve", "--host", host, "--port", str(free_port()), env=env, timeout=60)
    assert done.returncode != 0
    assert "DJANGO_SECRET_KEY" in done.stderr and "Refusing to serve" in done.stderr
    assert "Serving on" not in done.stdout


@pytest.mark.slow
def test_serve_listens_publicly_with_a_secret_key_and_on_loopback_without(
    tmp_path: Path,
) -> None:
    # covers: F8 (the guard refuses only the dangerous combination)
    for host, key in (("0.0.0.0", "a-real-secret-" + "x" * 40), ("127.0.0.1", "")):  # noqa: S104
        env = embedded_env(tmp_path, DJANGO_SECRET_KEY=key)
        proc = popen_manage(
            "serve",
            "--host",
            host,
            "--port",
            str(free_port()),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            assert proc.stdout is not None
            deadline = time.monotonic() + 60
            seen = ""
            while "Serving on" not in seen:
                assert time.monotonic() < deadline and proc.poll() is None, seen
                seen += proc.stdout.readline()
        finally:
            proc.terminate()
            proc.wait(timeout=30)


# --- Tokens in the admin ------------------------------------------------------------------------


@pytest.fixture
def staff(make_user: Any) -> Any:
    """Staff with every token permission, but not a superuser."""
    member = make_user("staffer")
    member.is_staff = True
    member.save()
    member.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label="sessions_app", codename__endswith="apitoken"
        )
    )
    return member


def test_staff_may_issue_tokens_only_for_themselves(
    client: Client, staff: Any, make_user: Any
) -> None:
    # covers: F8 (tokens for other users: superusers only), E2
    boss = make_user("boss", staff=True)
    someone = make_user("someone")
    client.force_login(staff)
    add = reverse("admin:sessions_app_apitoken_add")
    for target in (boss, someone):
        refused = client.post(add, {"user": target.pk, "name": "stolen"})
        assert refused.status_code == 200
        assert refused.context["adminform"].form.errors["user"]
        assert not ApiToken.objects.filter(user=target).exists()

    issued = client.post(add, {"user": staff.pk, "name": "mine"}, follow=True)
    assert issued.status_code == 200
    assert ApiToken.objects.get().user == staff

    # Other users' tokens are neither listed nor revocable by them.
    theirs, _raw = services.api_token_issue(user=boss, name="boss")
    listing = client.get(reverse("admin:sessions_app_apitoken_changelist"))
    assert [t.user for t in listing.context["cl"].result_list] == [staff]
    client.post(
        reverse("admin:sessions_app_apitoken_changelist"),
        {"action": "revoke_selected", ACTION_CHECKBOX_NAME: [theirs.pk]},
    )
    theirs.refresh_from_db()
    assert theirs.revoked_at is None


def test_superusers_may_issue_tokens_for_anyone(client: Client, make_user: Any) -> None:
    # covers: F8, E2
    client.force_login(make_user("root", staff=True))
    someone = make_user("someone")
    client.post(reverse("admin:sessions_app_apitoken_add"), {"user": someone.pk, "name": "x"})
    assert ApiToken.objects.get().user == someone
