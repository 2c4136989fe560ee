"""What `make run` does, end to end: migrate, ensure the demo login, `serve` under Daphne, then
a real HTTP client checks health, the login page, signing in and the admin.

Runs in embedded mode in a temporary CHAT_VAR_DIR (its own SQLite file), whatever the outer
environment says about DATABASE_URL and REDIS_URL.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.procs import ServeProcess, embedded_env, manage

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The base URL of a `serve` process started as `make run` does, and its log file."""
    var_dir = tmp_path_factory.mktemp("var")
    env = embedded_env(var_dir, DEMO_PASSWORD="smoke-test-password")
    for args in (("migrate", "--noinput"), ("ensure_demo_user", "--staff")):
        done = manage(*args, env=env)
        assert done.returncode == 0, f"{args[0]} failed:\n{done.stdout}\n{done.stderr}"
        if args[0] == "ensure_demo_user":
            assert "Demo login: demo / smoke-test-password" in done.stdout

    with ServeProcess(var_dir, env) as server:
        yield server.base, server.log_path


def test_serve_prints_its_address(served: tuple[str, Path]) -> None:
    base, log_path = served

    assert f"Serving on {base}" in log_path.read_text()


def test_health_endpoint_reports_ok_in_embedded_mode(served: tuple[str, Path]) -> None:
    # covers: F4
    base, _ = served

    response = httpx.get(f"{base}/healthz", timeout=10.0)

    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["mode"] == "embedded"


def test_health_shows_the_served_heap_settled_and_the_collectors_pauses(
    served: tuple[str, Path],
) -> None:
    # covers: F4, G6 (issue 10: once the engine has started, what the server loaded for good
    # is out of the collector's view, so a full collection no longer walks it and stalls every
    # stream; the collector's pauses since then are there for an operator to see)
    base, _ = served

    collector: dict[str, float] = {}
    for _ in range(100):
        collector = httpx.get(f"{base}/healthz", timeout=10.0).json()["collector"]
        if collector:
            break
        time.sleep(0.1)

    assert collector["frozen_objects"] > 10_000
    # issue 57: the youngest generation is collected after 20,000 allocations, not 700
    assert collector["young_threshold"] == 20_000
    assert 0 <= collector["longest_pause_ms"] <= collector["pause_ms_total"]


def test_static_files_are_served(served: tuple[str, Path]) -> None:
    base, _ = served

    response = httpx.get(f"{base}/static/chat/base.css", timeout=10.0)

    assert response.status_code == 200
    assert ".auth-card" in response.text


def test_demo_user_logs_in_and_reaches_the_admin(served: tuple[str, Path]) -> None:
    # covers: F2, E2
    base, _ = served
    with httpx.Client(base_url=base, timeout=10.0) as client:
        page = client.get("/accounts/login/")
        assert page.status_code == 200
        assert "<form" in page.text and 'name="password"' in page.text
        match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
        assert match, "the login form has no CSRF token"

        wrong = client.post(
            "/accounts/login/",
            data={
                "csrfmiddlewaretoken": match.group(1),
                "username": "demo",
                "password": "not-the-password",
            },
        )
        assert wrong.status_code == 200
        assert 'role="alert"' in wrong.text  # the form shows its error

        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', wrong.text)
        assert token
        signed_in = client.post(
            "/accounts/login/",
            data={
                "csrfmiddlewaretoken": token.group(1),
                "username": "demo",
                "password": "smoke-test-password",
                "next": "/admin/",
            },
        )
        assert signed_in.status_code == 302, signed_in.text
        assert signed_in.headers["location"] == "/admin/"

        admin = client.get("/admin/")
        assert admin.status_code == 200
        assert "demo" in admin.text
        assert 'id="login-form"' not in admin.text  # the admin index, not its login page
