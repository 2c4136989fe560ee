"""Ending a login ends its connections (SPEC F8, PROTOCOL "Other URLs"), through the real ASGI
application: a cookie socket opened after the real login form, then logout, deactivation
(directly and through the admin), token revocation and deletion each close that login's
sockets with 4401 and leave every other login's sockets open; the periodic re-check closes
them when no signal fired (a bulk update, an expired session); an SSE stream ends too."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from channels.testing import ApplicationCommunicator, WebsocketCommunicator
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.sessions.models import Session as DjangoSession
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from chatcore.asgi import application
from sessions_app import services
from sessions_app.models import ApiToken
from tests.fakemodel import Reply

pytestmark = [pytest.mark.django_db(transaction=True)]

PASSWORD = "pw-12345!"
# Long enough that only the signal path can close a socket within a test's wait.
NO_RECHECK = 3600
CLOSED_4401 = {"type": "websocket.close", "code": 4401}


def login_check(seconds: float) -> Any:
    return override_settings(CHAT={**settings.CHAT, "LOGIN_CHECK_SECONDS": seconds})


@pytest.fixture
def signals_only() -> Iterator[None]:
    with login_check(NO_RECHECK):
        yield


class Browser:
    """A Django test client signed in through the real login form."""

    def __init__(self) -> None:
        self.client = Client()

    def login(self, username: str, password: str = PASSWORD) -> None:
        response = self.client.post(reverse("login"), {"username": username, "password": password})
        assert response.status_code == 302, response.content[:500]

    def logout(self) -> None:
        response = self.client.post(reverse("logout"))
        assert response.status_code == 302

    @property
    def cookie(self) -> bytes:
        name = settings.SESSION_COOKIE_NAME
        return f"{name}={self.client.cookies[name].value}".encode()


async def browser_for(username: str) -> Browser:
    browser = Browser()
    await sync_to_async(browser.login)(username)
    return browser


@pytest_asyncio.fixture
async def sockets(engine: Any) -> AsyncIterator[Callable[..., Any]]:
    opened: list[WebsocketCommunicator] = []

    async def open_socket(headers: list[tuple[bytes, bytes]]) -> WebsocketCommunicator:
        comm = WebsocketCommunicator(application, "/ws/chat/", headers=headers)
        connected, _ = await comm.connect(timeout=10)
        assert connected
        opened.append(comm)
        for expected in ("sessions", "session_history"):
            assert json.loads(await comm.receive_from(10))["type"] == expected
        return comm

    yield open_socket
    for comm in opened:
        await comm.disconnect()


def cookie_headers(browser: Browser) -> list[tuple[bytes, bytes]]:
    return [
        (b"cookie", browser.cookie),
        (b"host", b"testserver"),
        (b"origin", b"http://testserver"),
    ]


async def bearer_headers(user: Any) -> tuple[ApiToken, list[tuple[bytes, bytes]]]:
    token, raw = await sync_to_async(services.api_token_issue)(user=user, name="ws")
    return token, [(b"authorization", f"Bearer {raw}".encode())]


async def assert_closed_4401(comm: WebsocketCommunicator, timeout: float = 5.0) -> None:
    """The next output is the close (F8: within 5 s); nothing else was sent first."""
    assert await comm.receive_output(timeout=timeout) == CLOSED_4401


async def assert_open(comm: WebsocketCommunicator) -> None:
    await comm.send_json_to({"type": "sessions", "client_msg_id": "still-open"})
    answer = json.loads(await comm.receive_from(10))
    assert answer["type"] == "sessions" and answer["client_msg_id"] == "still-open"


# --- Signals: the login's own sockets close at once -----------------------------------------


async def test_logout_closes_that_sessions_sockets_only(
    signals_only: None, sockets: Any, user: Any
) -> None:
    # covers: F8 (logout), E1
    browser = await browser_for(user.username)
    other_browser = await browser_for(user.username)
    _token, bearer = await bearer_headers(user)
    mine = await sockets(cookie_headers(browser))
    second_tab = await sockets(cookie_headers(browser))
    other_login = await sockets(cookie_headers(other_browser))
    program = await sockets(bearer)

    await sync_to_async(browser.logout)()

    await assert_closed_4401(mine)
    await assert_closed_4401(second_tab)
    await assert_open(other_login)
    await assert_open(program)


async def test_a_logged_out_socket_can_no_longer_act(
    signals_only: None, sockets: Any, user: Any
) -> None:
    # covers: F8 (the issue's repro: after logout, /new must not run)
    from sessions_app.models import Session

    browser = await browser_for(user.username)
    comm = await sockets(cookie_headers(browser))
    before = await sync_to_async(Session.objects.filter(owner=user).count)()
    await sync_to_async(browser.logout)()
    await assert_closed_4401(comm)
    await comm.send_json_to({"type": "send", "content": "/new", "client_msg_id": "late"})
    assert await comm.receive_nothing(timeout=0.5)
    assert await sync_to_async(Session.objects.filter(owner=user).count)() == before
    # And the cookie no longer opens a socket.
    late = WebsocketCommunicator(application, "/ws/chat/", headers=cookie_headers(browser))
    connected, _ = await late.connect(timeout=10)
    assert connected
    assert await late.receive_output(timeout=5) == CLOSED_4401


async def test_deactivating_a_user_closes_all_their_sockets(
    signals_only: None, sockets: Any, user: Any, other_user: Any
) -> None:
    # covers: F8 (deactivation)
    browser = await browser_for(user.username)
    _token, bearer = await bearer_headers(user)
    cookie_socket = await sockets(cookie_headers(browser))
    token_socket = await sockets(bearer)
    _other_token, other_bearer = await bearer_headers(other_user)
    bystander = await sockets(other_bearer)

    def deactivate() -> None:
        account = get_user_model().objects.get(pk=user.pk)
        account.is_active = False
        account.save()

    await sync_to_async(deactivate)()

    await assert_closed_4401(cookie_socket)
    await assert_closed_4401(token_socket)
    await assert_open(bystander)


async def test_deactivating_a_user_in_the_admin_closes_their_sockets(
    signals_only: None, sockets: Any, user: Any, make_user: Any
) -> None:
    # covers: F8 (deactivation through the admin), E2
    admin_user = await sync_to_async(make_user)("root", staff=True)
    _token, bearer = await bearer_headers(user)
    comm = await sockets(bearer)

    def deactivate_in_admin() -> None:
        operator = Client()
        operator.force_login(admin_user)
        url = reverse("admin:auth_user_change", args=[user.pk])
        joined = timezone.localtime(user.date_joined)
        response = operator.post(
            url,
            {
                "username": user.username,
                "first_name": "",
                "last_name": "",
                "email": user.email,
                # is_active left out: the checkbox is cleared.
                "date_joined_0": joined.strftime("%Y-%m-%d"),
                "date_joined_1": joined.strftime("%H:%M:%S"),
                "initial-date_joined_0": joined.strftime("%Y-%m-%d"),
                "initial-date_joined_1": joined.strftime("%H:%M:%S"),
                "last_login_0": "",
                "last_login_1": "",
            },
        )
        assert response.status_code == 302, response.content.decode()[:2000]
        assert not get_user_model().objects.get(pk=user.pk).is_active

    await sync_to_async(deactivate_in_admin)()
    await assert_closed_4401(comm)


@pytest.mark.parametrize("how", ["revoke", "delete", "admin_revoke"])
async def test_revoking_a_token_closes_its_sockets_only(
    signals_only: None, sockets: Any, user: Any, make_user: Any, how: str
) -> None:
    # covers: F8 (revocation)
    token, bearer = await bearer_headers(user)
    _kept, other_bearer = await bearer_headers(user)
    comm = await sockets(bearer)
    same_user_other_token = await sockets(other_bearer)

    def end() -> None:
        if how == "revoke":
            services.api_token_revoke(token=token)
        elif how == "delete":
            ApiToken.objects.get(pk=token.pk).delete()
        else:
            operator = Client()
            operator.force_login(make_user("root", staff=True))
            response = operator.post(
                reverse("admin:sessions_app_apitoken_changelist"),
                {"action": "revoke_selected", "_selected_action": [token.pk]},
            )
            assert response.status_code == 302

    await sync_to_async(end)()
    await assert_closed_4401(comm)
    await assert_open(same_user_other_token)


# --- The periodic re-check: no signal fired -------------------------------------------------


async def test_recheck_closes_sockets_of_a_bulk_deactivated_user(sockets: Any, user: Any) -> None:
    # covers: F8 (fallback when no signal fires)
    with login_check(1):
        browser = await browser_for(user.username)
        _token, bearer = await bearer_headers(user)
        cookie_socket = await sockets(cookie_headers(browser))
        token_socket = await sockets(bearer)
        await sync_to_async(
            lambda: get_user_model().objects.filter(pk=user.pk).update(is_active=False)
        )()
        await assert_closed_4401(cookie_socket)
        await assert_closed_4401(token_socket)


async def test_recheck_closes_sockets_of_an_expired_session_or_bulk_revoked_token(
    sockets: Any, user: Any, other_user: Any
) -> None:
    # covers: F8 (a session that expires, a token revoked by a bulk update)
    with login_check(1):
        browser = await browser_for(user.username)
        token, bearer = await bearer_headers(other_user)
        cookie_socket = await sockets(cookie_headers(browser))
        token_socket = await sockets(bearer)
        _kept_token, kept_bearer = await bearer_headers(other_user)
        kept = await sockets(kept_bearer)
        past = timezone.now() - timezone.timedelta(seconds=1)
        await sync_to_async(lambda: DjangoSession.objects.update(expire_date=past))()
        await sync_to_async(
            lambda: ApiToken.objects.filter(pk=token.pk).update(revoked_at=timezone.now())
        )()
        await assert_closed_4401(cookie_socket)
        await assert_closed_4401(token_socket)
        await assert_open(kept)


async def test_recheck_closes_sockets_after_a_password_change(sockets: Any, user: Any) -> None:
    # covers: F8 (Django's session verification: the password hash in the session)
    with login_check(1):
        browser = await browser_for(user.username)
        comm = await sockets(cookie_headers(browser))

        def change_password() -> None:
            account = get_user_model().objects.get(pk=user.pk)
            account.set_password("a-new-password-123")
            account.save()

        await sync_to_async(change_password)()
        await assert_closed_4401(comm)


# --- SSE --------------------------------------------------------------------------------------


async def read_sse_until_end(comm: ApplicationCommunicator, timeout: float = 5.0) -> list[str]:
    """Body chunks until the response ends (more_body false)."""
    chunks = []
    while True:
        message = await comm.receive_output(timeout=timeout)
        assert message["type"] == "http.response.body", message
        chunks.append(message.get("body", b"").decode())
        if not message.get("more_body", False):
            return chunks


@pytest.mark.parametrize("how", ["revoke", "deactivate", "logout"])
async def test_revocation_ends_an_sse_stream(
    signals_only: None, engine: Any, fake_model: Any, user: Any, how: str
) -> None:
    # covers: F8 (SSE), E3
    import threading

    gate = threading.Event()
    fake_model.script(Reply(text="a long answer", gate=gate))
    token, raw = await sync_to_async(services.api_token_issue)(user=user, name="sse")
    browser = await browser_for(user.username)
    if how == "logout":
        csrf = browser.client.cookies[settings.CSRF_COOKIE_NAME].value
        auth = [(b"cookie", browser.cookie + f"; csrftoken={csrf}".encode())]
        auth.append((b"x-csrftoken", csrf.encode()))
    else:
        auth = [(b"authorization", f"Bearer {raw}".encode())]
    created = await sync_to_async(services.session_create)(
        owner=user, channel="api", chat_id=f"u{user.pk}", dialog_id="d"
    )
    body = json.dumps({"content": "hello"}).encode()
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "path": f"/api/v1/sessions/{created.session_id}/messages",
        "raw_path": f"/api/v1/sessions/{created.session_id}/messages".encode(),
        "query_string": b"",
        "root_path": "",
        "scheme": "http",
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 5000),
        "headers": [
            (b"host", b"testserver"),
            (b"accept", b"text/event-stream"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *auth,
        ],
    }
    comm = ApplicationCommunicator(application, scope)
    try:
        await comm.send_input({"type": "http.request", "body": body, "more_body": False})
        start = await comm.receive_output(timeout=10)
        assert start["type"] == "http.response.start" and start["status"] == 200, start
        first = await comm.receive_output(timeout=10)
        assert "event: queued" in first["body"].decode()

        def end() -> None:
            if how == "revoke":
                services.api_token_revoke(token=token)
            elif how == "deactivate":
                account = get_user_model().objects.get(pk=user.pk)
                account.is_active = False
                account.save()
            else:
                browser.logout()

        await sync_to_async(end)()
        rest = "".join(await read_sse_until_end(comm))
        assert "event: error" in rest and '"code": "unauthorized"' in rest
        assert "event: turn_updated" not in rest
    finally:
        gate.set()
        await comm.wait(timeout=10)
