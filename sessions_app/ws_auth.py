"""WebSocket handshake authentication (F2, PROTOCOL "WebSocket: /ws/chat/").

Two ways in:
- `Authorization: Bearer <token>`: a program, not a browser, so no Origin is needed. A bad or
  revoked token is unauthenticated (it never falls back to a cookie). Other schemes (a
  browser behind an HTTP Basic proxy sends `Basic`) are not ours and are ignored.
- the Django session cookie, only when the Origin header names an allowed host (the check of
  channels' `AllowedHostsOriginValidator`): a page on another site cannot ride the browser's
  cookie (cross-site WebSocket hijacking). A cookie with a missing or foreign Origin is
  treated as unauthenticated.

It never refuses the handshake itself: the consumer accepts and closes with 4401, so a client
can tell "not logged in" from a network failure.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import ParseResult, urlparse

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.security.websocket import OriginValidator
from django.conf import settings
from django.contrib.auth.models import AnonymousUser

from .auth import bearer_from_header, user_for_token


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            try:
                return str(value.decode("latin1"))
            except UnicodeDecodeError:
                return None
    return None


def _allowed_hosts() -> list[str]:
    hosts = list(settings.ALLOWED_HOSTS)
    if settings.DEBUG and not hosts:
        hosts = ["localhost", "127.0.0.1", "[::1]"]
    return hosts


def origin_allowed(origin: str | None) -> bool:
    """Whether a browser's Origin is one of ALLOWED_HOSTS (channels' matching rules)."""
    if not origin:
        return False
    try:
        parsed: ParseResult = urlparse(origin)
    except ValueError:
        return False
    if parsed.scheme not in ("http", "https"):
        return False
    return bool(OriginValidator(None, _allowed_hosts()).valid_origin(parsed))


class ChatAuthMiddleware:
    """Puts `user` (a User or AnonymousUser) and `auth` ("bearer", "session" or None) into the
    scope of a WebSocket connection."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        # Cookie -> session -> user, run only when the Origin is allowed.
        self.session_auth = AuthMiddlewareStack(_MarkSession(inner))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        if scope["type"] != "websocket":
            return await self.inner(scope, receive, send)
        token = bearer_from_header(_header(scope, b"authorization"))
        if token is not None:
            user = await database_sync_to_async(user_for_token)(token)
            scope = dict(
                scope,
                user=user if user is not None else AnonymousUser(),
                auth="bearer" if user is not None else None,
            )
            return await self.inner(scope, receive, send)
        if origin_allowed(_header(scope, b"origin")):
            return await self.session_auth(scope, receive, send)
        return await self.inner(dict(scope, user=AnonymousUser(), auth=None), receive, send)


class _MarkSession:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        # channels' AuthMiddleware has resolved its lazy user by now; hand on the real object
        # (it goes into the engine's Inbound and ORM filters).
        user = getattr(scope.get("user"), "_wrapped", None)
        if not getattr(user, "is_authenticated", False):
            return await self.inner(dict(scope, user=AnonymousUser(), auth=None), receive, send)
        return await self.inner(dict(scope, user=user, auth="session"), receive, send)
