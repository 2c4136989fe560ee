"""WebSocket handshake authentication (F2, PROTOCOL "WebSocket: /ws/chat/").

Two ways in:
- `Authorization: Bearer <token>`: a program, not a browser, so no Origin is needed. A bad or
  revoked token is unauthenticated (it never falls back to a cookie). Other schemes (a
  browser behind an HTTP Basic proxy sends `Basic`) are not ours and are ignored.
- the Django session cookie, only when the Origin header is exactly (scheme, host and port)
  the origin of this server's own pages or one of CSRF_TRUSTED_ORIGINS (F8): a page on
  another site, or on another port of the same host, cannot ride the browser's cookie
  (cross-site WebSocket hijacking). A cookie with a missing or foreign Origin is treated as
  unauthenticated.

Either way the scope gets `login` (`sessions_app.logins.Login`): the credential the
connection rides on, so ending it closes the connection (F8).

It never refuses the handshake itself: the consumer accepts and closes with 4401, so a client
can tell "not logged in" from a network failure.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from channels.auth import AuthMiddlewareStack
from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.http.request import split_domain_port, validate_host

from chatcore.common.dbthreads import on_db_idempotent

from .auth import bearer_from_header, token_for_raw
from .logins import login_for_session, login_for_token

DEFAULT_PORTS = {"http": 80, "https": 443}


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            try:
                return str(value.decode("latin1"))
            except UnicodeDecodeError:
                return None
    return None


def _origin_tuple(value: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an origin, with the scheme's default port; None when it is not
    an http(s) origin."""
    try:
        parsed = urlparse(value.strip())
        port = parsed.port
    except ValueError:
        return None
    scheme = parsed.scheme.lower()
    host = (parsed.hostname or "").lower()
    if scheme not in DEFAULT_PORTS or not host or parsed.path not in ("", "/"):
        return None
    return scheme, host, port if port is not None else DEFAULT_PORTS[scheme]


def _own_origin(scope: dict[str, Any]) -> tuple[str, str, int] | None:
    """The origin of the page this server serves at the handshake's Host: its scheme is the
    connection's (wss -> https), or the proxy's when Django trusts its header
    (SECURE_PROXY_SSL_HEADER). A Host outside ALLOWED_HOSTS counts for nothing (DNS
    rebinding)."""
    host = _header(scope, b"host")
    if not host:
        return None
    domain, _port = split_domain_port(host)
    if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return None
    secure = scope.get("scheme") == "wss"
    proxy_header = settings.SECURE_PROXY_SSL_HEADER
    if proxy_header is not None:
        name, expected = proxy_header
        # "HTTP_X_FORWARDED_PROTO" -> b"x-forwarded-proto"
        raw = _header(scope, name.removeprefix("HTTP_").lower().replace("_", "-").encode())
        if raw is not None:
            secure = raw.split(",")[0].strip() == expected
    return _origin_tuple(f"{'https' if secure else 'http'}://{host}")


def _trusted(origin: tuple[str, str, int], pattern: str) -> bool:
    """A CSRF_TRUSTED_ORIGINS entry, Django's way: exact, or `scheme://*.domain` for the
    domain's subdomains; the port always counts."""
    wildcard = "://*." in pattern
    allowed = _origin_tuple(pattern.replace("://*.", "://", 1) if wildcard else pattern)
    if allowed is None:
        return False
    scheme, host, port = allowed
    if origin[0] != scheme or origin[2] != port:
        return False
    return origin[1] == host or (wildcard and origin[1].endswith("." + host))


def origin_allowed(scope: dict[str, Any]) -> bool:
    """F8: whether the handshake's Origin is exactly (scheme, host and port) the origin of
    this server's own pages or one of CSRF_TRUSTED_ORIGINS."""
    raw = _header(scope, b"origin")
    origin = _origin_tuple(raw) if raw else None
    if origin is None:
        return False
    if origin == _own_origin(scope):
        return True
    return any(_trusted(origin, pattern) for pattern in settings.CSRF_TRUSTED_ORIGINS)


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
        raw = bearer_from_header(_header(scope, b"authorization"))
        if raw is not None:
            token = await on_db_idempotent(token_for_raw)(raw)
            if token is None:
                scope = dict(scope, user=AnonymousUser(), auth=None, login=None)
            else:
                login = login_for_token(token.user, token.pk)
                scope = dict(scope, user=token.user, auth="bearer", login=login)
            return await self.inner(scope, receive, send)
        if origin_allowed(scope):
            return await self.session_auth(scope, receive, send)
        return await self.inner(
            dict(scope, user=AnonymousUser(), auth=None, login=None), receive, send
        )


class _MarkSession:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        # channels' AuthMiddleware has resolved its lazy user by now; hand on the real object
        # (it goes into the engine's Inbound and ORM filters).
        user = getattr(scope.get("user"), "_wrapped", None)
        login = login_for_session(user, scope.get("session"))
        if not getattr(user, "is_authenticated", False) or login is None:
            return await self.inner(
                dict(scope, user=AnonymousUser(), auth=None, login=None), receive, send
            )
        return await self.inner(dict(scope, user=user, auth="session", login=login), receive, send)
