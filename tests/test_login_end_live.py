"""Ending a login on real servers (SPEC F8): `manage.py serve` (Daphne) as a subprocess, the
real login form and logout POST over HTTP, a real WebSocket client. Logout closes the cookie
socket with 4401; a logout on one process closes the socket held by another (the channel
layer on Redis); a token revoked by another program ends an SSE stream (the periodic
re-check); and the cookie socket's Origin must match in scheme, host and port."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from websockets.asyncio.client import connect
from websockets.typing import Origin

from tests.fakemodel import FakeModelServer, Reply
from tests.procs import ServeProcess, embedded_env, manage, migrate_embedded
from tests.test_api_sse import sse_events

pytestmark = [pytest.mark.slow]

PASSWORD = "pw-live-12345!"


def prepare(env: dict[str, str]) -> str:
    """Migrate, create a user with a password; returns a bearer token of that user."""
    if env.get("DATABASE_URL"):
        done = manage("migrate", "--noinput", env=env)
        assert done.returncode == 0, done.stdout + done.stderr
    else:
        migrate_embedded(env)
    issued = manage("issue_token", "live", "--create-user", env=env)
    assert issued.returncode == 0, issued.stdout + issued.stderr
    script = (
        "from django.contrib.auth.models import User; "
        f"u = User.objects.get(username='live'); u.set_password({PASSWORD!r}); u.save()"
    )
    changed = manage("shell", "-c", script, env=env)
    assert changed.returncode == 0, changed.stdout + changed.stderr
    return issued.stdout.strip().splitlines()[-1]


def log_in(base: str) -> httpx.Client:
    """A browser: GET the login form, POST it with its CSRF token."""
    client = httpx.Client(base_url=base, timeout=30.0)
    page = client.get("/accounts/login/")
    assert page.status_code == 200
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert token is not None
    done = client.post(
        "/accounts/login/",
        data={"username": "live", "password": PASSWORD, "csrfmiddlewaretoken": token.group(1)},
    )
    assert done.status_code == 302, done.text[:500]
    return client


def log_out(client: httpx.Client) -> None:
    """The chat page's sign-out form: POST with the page's CSRF token."""
    page = client.get("/")
    assert page.status_code == 200
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert token is not None
    done = client.post("/accounts/logout/", data={"csrfmiddlewaretoken": token.group(1)})
    assert done.status_code == 302, done.text[:500]


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/ws/chat/"


def cookie_header(client: httpx.Client) -> dict[str, str]:
    return {"Cookie": f"sessionid={client.cookies['sessionid']}"}


async def open_cookie_socket(base: str, client: httpx.Client, origin: str) -> Any:
    ws = await connect(
        ws_url(base), origin=Origin(origin), additional_headers=cookie_header(client)
    )
    return ws


async def first_frames(ws: Any) -> None:
    for expected in ("sessions", "session_history"):
        frame = json.loads(await asyncio.wait_for(ws.recv(), 15))
        assert frame["type"] == expected


async def closed_code(ws: Any, timeout: float = 5.0) -> int | None:
    """The close code the server sent within `timeout` (F8: 5 s)."""
    with pytest.raises(websockets.ConnectionClosed) as closed:
        while True:
            await asyncio.wait_for(ws.recv(), timeout)
    return closed.value.rcvd.code if closed.value.rcvd is not None else None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """One server for the tests of a login's sockets: each test signs in a login of its own."""
    var_dir = tmp_path_factory.mktemp("login-end-live")
    model = FakeModelServer().start()
    try:
        env = embedded_env(
            var_dir, LLM_BASE_URL=model.url, LLM_MODEL="fake", CHAT_LOGIN_CHECK_SECONDS="3600"
        )
        prepare(env)
        with ServeProcess(var_dir, env) as serve:
            yield serve
    finally:
        model.stop()


async def test_logout_form_closes_the_cookie_socket(server: ServeProcess) -> None:
    # covers: F8 (logout), F2 (Origin), E1
    browser = await asyncio.to_thread(log_in, server.base)
    try:
        ws = await open_cookie_socket(server.base, browser, server.base)
        await first_frames(ws)
        await asyncio.to_thread(log_out, browser)
        assert await closed_code(ws) == 4401
    finally:
        browser.close()


@pytest.mark.parametrize(
    "origin",
    [
        "http://127.0.0.1:1",  # the same host, another port
        "https://127.0.0.1:{port}",  # another scheme
        "http://localhost:{port}",  # another host
    ],
)
async def test_cookie_socket_origin_must_match_scheme_host_and_port(
    server: ServeProcess, origin: str
) -> None:
    # covers: F8 (Origin), F2
    browser = await asyncio.to_thread(log_in, server.base)
    try:
        ws = await open_cookie_socket(server.base, browser, origin.format(port=server.port))
        assert await closed_code(ws) == 4401
        ws = await open_cookie_socket(server.base, browser, server.base)
        await first_frames(ws)
        await ws.close()
    finally:
        browser.close()


def test_a_revoked_token_ends_an_sse_stream_on_a_real_server(
    tmp_path: Path, fake_model: FakeModelServer
) -> None:
    # covers: F8 (SSE; revoked by another program: the server's periodic re-check)
    # The re-check every second (default 3 s): the revocation is seen sooner, the same way.
    env = embedded_env(
        tmp_path, LLM_BASE_URL=fake_model.url, LLM_MODEL="fake", CHAT_LOGIN_CHECK_SECONDS="1"
    )
    token = prepare(env)
    gate = threading.Event()
    fake_model.script(Reply(text="held until the test ends", gate=gate))
    revoke = (
        "from django.utils import timezone; from sessions_app.models import ApiToken; "
        "ApiToken.objects.update(revoked_at=timezone.now())"
    )
    try:
        with (
            ServeProcess(tmp_path, env) as serve,
            httpx.Client(
                base_url=f"{serve.base}/api/v1",
                headers={"Authorization": f"Bearer {token}"},
                timeout=30.0,
            ) as client,
        ):
            sid = client.post("/sessions", json={"dialog_id": "live"}).json()["session_id"]
            with client.stream(
                "POST",
                f"/sessions/{sid}/messages",
                json={"content": "hello"},
                headers={"Accept": "text/event-stream"},
            ) as response:
                assert response.status_code == 200
                events = sse_events(response.iter_lines())
                assert next(events)["event"] == "queued"
                revoked = manage("shell", "-c", revoke, env=env)
                assert revoked.returncode == 0, revoked.stderr
                rest = list(events)
            assert rest[-1]["event"] == "error"
            assert rest[-1]["data"]["code"] == "unauthorized"
            assert "turn_updated" not in [e["event"] for e in rest]
            assert client.get(f"/sessions/{sid}").status_code == 401
    finally:
        gate.set()


@pytest.mark.redis
async def test_logout_on_one_process_closes_the_socket_on_another(
    tmp_path: Path, fake_model: FakeModelServer, redis_url: str
) -> None:
    # covers: F8 (across server processes: the login's group on the Redis channel layer)
    shared_db = f"sqlite:///{tmp_path / 'shared.sqlite3'}"
    envs = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        envs.append(
            embedded_env(
                folder,
                DATABASE_URL=shared_db,
                REDIS_URL=redis_url,
                LLM_BASE_URL=fake_model.url,
                CHAT_LOGIN_CHECK_SECONDS="3600",
            )
        )
    prepare(envs[0])
    with (
        ServeProcess(tmp_path / "a", envs[0]) as first,
        ServeProcess(tmp_path / "b", envs[1]) as second,
    ):
        browser = await asyncio.to_thread(log_in, first.base)
        try:
            ws = await open_cookie_socket(second.base, browser, second.base)
            await first_frames(ws)
            await asyncio.to_thread(log_out, browser)
            assert await closed_code(ws) == 4401
        finally:
            browser.close()
