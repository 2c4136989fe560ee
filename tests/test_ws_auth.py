"""`/ws/chat/` authentication through the real ASGI application (PROTOCOL "WebSocket:
/ws/chat/"; SPEC F2, E1): bearer tokens, session cookies and their origins."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import Client, override_settings

from sessions_app import services
from sessions_app.models import ApiToken
from tests.ws_helpers import (
    assert_closed_unauthenticated,
    bearer,
    open_ws,
)

pytestmark = [pytest.mark.django_db(transaction=True)]


# --- Auth (F2) ----------------------------------------------------------------------------


async def test_unauthenticated_is_accepted_then_closed_4401(engine: Any) -> None:
    # covers: F2
    ws, connected = await open_ws([])
    assert connected
    await assert_closed_unauthenticated(ws)


async def session_cookie(user: Any) -> bytes:
    client = Client()
    await sync_to_async(client.force_login)(user)
    name = settings.SESSION_COOKIE_NAME
    return f"{name}={client.cookies[name].value}".encode()


async def test_session_cookie_with_an_allowed_origin(engine: Any, user: Any) -> None:
    # covers: F2, E1
    cookie = await session_cookie(user)
    ws, connected = await open_ws(
        [(b"cookie", cookie), (b"host", b"testserver"), (b"origin", b"http://testserver")]
    )
    assert connected
    sessions = await ws.next()
    assert sessions["type"] == "sessions"
    assert sessions["items"][0]["session_id"].startswith(f"web:u{user.pk}:")
    await ws.close()


@pytest.mark.parametrize(
    "origin", [None, b"http://evil.example", b"null", b"http://testserver.evil.example"]
)
async def test_session_cookie_without_an_allowed_origin_is_unauthenticated(
    engine: Any, user: Any, origin: bytes | None
) -> None:
    # covers: F2 (cross-site WebSocket hijacking)
    headers = [(b"cookie", await session_cookie(user))]
    if origin is not None:
        headers.append((b"origin", origin))
    ws, connected = await open_ws(headers)
    assert connected
    await assert_closed_unauthenticated(ws)


@pytest.mark.parametrize(
    ("host", "origin", "extra", "settings_changes", "allowed"),
    [
        ("testserver", "http://testserver:80", [], {}, True),  # the default port, spelled out
        ("testserver:8000", "http://testserver:8000", [], {}, True),
        ("testserver:8000", "http://testserver:1", [], {}, False),  # another port
        ("testserver:8000", "http://testserver", [], {}, False),
        ("testserver", "https://testserver", [], {}, False),  # another scheme
        ("testserver", "http://testserver/path", [], {}, False),
        ("evil.example", "http://evil.example", [], {}, False),  # Host not in ALLOWED_HOSTS
        (
            "testserver",
            "https://chat.example.com",
            [],
            {"CSRF_TRUSTED_ORIGINS": ["https://chat.example.com"]},
            True,
        ),
        (
            "testserver",
            "https://chat.example.com:8443",
            [],
            {"CSRF_TRUSTED_ORIGINS": ["https://chat.example.com"]},
            False,
        ),
        (
            "testserver",
            "https://a.example.com",
            [],
            {"CSRF_TRUSTED_ORIGINS": ["https://*.example.com"]},
            True,
        ),
        # Behind a TLS proxy that Django trusts, the page's origin is https.
        (
            "testserver",
            "https://testserver",
            [(b"x-forwarded-proto", b"https")],
            {"SECURE_PROXY_SSL_HEADER": ("HTTP_X_FORWARDED_PROTO", "https")},
            True,
        ),
        # ...and an untrusted proxy header changes nothing.
        ("testserver", "https://testserver", [(b"x-forwarded-proto", b"https")], {}, False),
    ],
)
async def test_cookie_origin_matches_scheme_host_and_port(
    engine: Any,
    user: Any,
    host: str,
    origin: str,
    extra: list[tuple[bytes, bytes]],
    settings_changes: dict[str, Any],
    allowed: bool,
) -> None:
    # covers: F8 (Origin: scheme, host and port), F2
    headers = [
        (b"cookie", await session_cookie(user)),
        (b"host", host.encode()),
        (b"origin", origin.encode()),
        *extra,
    ]
    with override_settings(**settings_changes):
        ws, connected = await open_ws(headers)
        assert connected
        if allowed:
            assert (await ws.next())["type"] == "sessions"
            await ws.close()
        else:
            await assert_closed_unauthenticated(ws)


async def test_other_authorization_schemes_leave_the_cookie_path_alone(
    engine: Any, user: Any
) -> None:
    # covers: F2 (a browser behind an HTTP Basic proxy sends `Authorization: Basic` itself)
    headers = [
        (b"authorization", b"Basic dXNlcjpwdw=="),
        (b"cookie", await session_cookie(user)),
        (b"host", b"testserver"),
        (b"origin", b"http://testserver"),
    ]
    ws, connected = await open_ws(headers)
    assert connected
    assert (await ws.next())["type"] == "sessions"
    await ws.close()


async def test_bearer_token_without_origin(engine: Any, user: Any) -> None:
    # covers: F2
    ws, connected = await open_ws(await bearer(user))
    assert connected
    assert (await ws.next())["type"] == "sessions"
    await ws.close()


async def test_revoked_or_unknown_token_is_unauthenticated(engine: Any, user: Any) -> None:
    # covers: F2
    headers = await bearer(user)
    token = await sync_to_async(ApiToken.objects.get)(user=user)
    await sync_to_async(services.api_token_revoke)(token=token)
    ws, _ = await open_ws(headers)
    await assert_closed_unauthenticated(ws)
    ws, _ = await open_ws([(b"authorization", b"Bearer cc_not-a-token")])
    await assert_closed_unauthenticated(ws)
    # A bad bearer never falls back to a session cookie.
    cookie = await session_cookie(user)
    ws, _ = await open_ws(
        [
            (b"authorization", b"Bearer nope"),
            (b"cookie", cookie),
            (b"host", b"testserver"),
            (b"origin", b"http://testserver"),
        ]
    )
    await assert_closed_unauthenticated(ws)
