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
connection rides on, so ending it closes the connection (F8). A login found is reused by the
next sockets of the same token or session for a few seconds (`login_cache`: a reconnect storm
looks each login up once); a session is read with Django's own session store and
`django.contrib.auth.get_user` (its password-hash check included) on a database thread.

It never refuses the handshake itself: the consumer accepts and closes with 4401, so a client
can tell "not logged in" from a network failure.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlparse

from django.conf import settings
from django.contrib.auth import get_user
from django.contrib.auth.models import AnonymousUser
from django.http.cookie import parse_cookie
from django.http.request import split_domain_port, validate_host

from chatcore.common import dbthreads
from chatcore.common.dbthreads import on_db_idempotent
from chatcore.engine import runtime
from chatcore.engine.engine import Engine
from chatcore.engine.gather import Gathered

from . import login_cache
from .auth import bearer_from_header, hash_token, token_for_raw, tokens_for_raw
from .logins import Login, login_for_session, login_for_token, session_store
from .models import ApiToken

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


async def authenticate(scope: dict[str, Any]) -> None:
    """Sets `user` (a User or AnonymousUser), `auth` ("bearer", "session" or None) and `login`
    in the scope of a WebSocket connection (its own: the router made it for this socket). The
    consumer calls it first thing, rather than a middleware whose coroutine would wait for
    the socket's whole life (issue 57)."""
    found: tuple[Any, Login] | None = None
    auth = None
    raw = bearer_from_header(_header(scope, b"authorization"))
    if raw is not None:
        found = await _token_login(raw)
        auth = "bearer"
    elif origin_allowed(scope):
        found = await _session_login(scope)
        auth = "session"
    if found is None:
        scope.update(user=AnonymousUser(), auth=None, login=None)
    else:
        scope.update(user=found[0], auth=auth, login=found[1])


# The token lookups of each engine's sockets, gathered (`_token_lookups`).
_lookups: weakref.WeakKeyDictionary[Engine, Gathered[str, ApiToken | None]] = (
    weakref.WeakKeyDictionary()
)


async def _token_lookups() -> Gathered[str, ApiToken | None]:
    """Token lookups made while others are under way go together (`gather.Gathered`): one
    statement for the sockets of a storm, under the engine's supervisor (F1)."""
    engine = await runtime.get_engine()
    lookups = _lookups.get(engine)
    if lookups is None:
        lookups = _lookups[engine] = Gathered(
            "token-lookups",
            tokens_for_raw,
            spawn=engine.supervisor.spawn,
            alone_limit=max(1, dbthreads.thread_count() // 3),
            max_batch=128,
        )
    return lookups


# Lookups under way, by cache key: the sockets of one login that open together (every tab of
# a user, back after a restart) wait for the first one's lookup instead of each making one.
_under_way: dict[str, asyncio.Future[Any]] = {}
# What a lookup that failed or was cancelled leaves its waiters: each looks up on its own.
_FAILED = object()


async def _shared(
    key: str, lookup: Callable[[], Awaitable[tuple[Any, Login] | None]]
) -> tuple[Any, Login] | None:
    loop = asyncio.get_running_loop()
    pending = _under_way.get(key)
    if pending is not None and pending.get_loop() is loop:
        shared = await asyncio.shield(pending)
        if shared is not _FAILED:
            return shared
    mine: asyncio.Future[Any] = loop.create_future()
    _under_way[key] = mine
    outcome: Any = _FAILED
    try:
        found = await lookup()
        outcome = found
        return found
    finally:
        if _under_way.get(key) is mine:
            del _under_way[key]
        mine.set_result(outcome)


async def _token_login(raw: str) -> tuple[Any, Login] | None:
    cache = login_cache.cache()
    key = login_cache.token_key(hash_token(raw.strip()))
    found = cache.get(key)
    if found is not None:
        return found
    return await _shared(key, lambda: _read_token_login(raw, key))


async def _read_token_login(raw: str, key: str) -> tuple[Any, Login] | None:
    lookups = await _token_lookups()
    token = await lookups(raw, lambda: on_db_idempotent(token_for_raw)(raw))
    if token is None:
        return None
    login = login_for_token(token.user, token.pk)
    login_cache.cache().put(key, token.user, login)
    return token.user, login


async def _session_login(scope: dict[str, Any]) -> tuple[Any, Login] | None:
    """The login of the session the cookie names: its user when the session is live and
    its password hash still holds (Django's `get_user`, which flushes one that does not)."""
    key = parse_cookie(_header(scope, b"cookie") or "").get(settings.SESSION_COOKIE_NAME)
    if not key:
        return None
    cache = login_cache.cache()
    cached = login_cache.session_key_of(key)
    found = cache.get(cached)
    if found is not None:
        return found

    async def read() -> tuple[Any, Login] | None:
        found = await on_db_idempotent(_read_session_login)(key)
        if found is not None:
            cache.put(cached, *found)
        return found

    return await _shared(cached, read)


class _SessionRequest:
    """What `get_user` reads of a request: its session."""

    def __init__(self, session: Any) -> None:
        self.session = session


def _read_session_login(key: str) -> tuple[Any, Login] | None:
    session = session_store()(session_key=key)
    user = get_user(_SessionRequest(session))  # type: ignore[arg-type]
    login = login_for_session(user, session)
    if not getattr(user, "is_authenticated", False) or login is None:
        return None
    return user, login
