"""Who is calling the REST API (F2): a bearer token, or the browser's Django session.

Both authenticators are async (django-ninja awaits them in async operations) and reach the
ORM only through `on_db` / `request.auser()` (STYLE 6). An `Authorization` header
always decides alone: a bad or revoked token answers 401 and never falls back to a cookie.
The session authenticator checks CSRF on unsafe methods, because django-ninja's views are
csrf-exempt at the middleware level and leave that check to cookie-based auth.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import wraps
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.translation import gettext as _
from ninja.errors import HttpError
from ninja.security import APIKeyCookie, HttpBearer
from ninja.utils import check_csrf

from chatcore.common.dbthreads import on_db_idempotent

from .auth import bearer_from_header, token_for_raw, user_for_token
from .logins import Login, login_for_session, login_for_token

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


class CsrfFailed(HttpError):
    """A browser-session call of an unsafe method without a valid CSRF token."""

    def __init__(self) -> None:
        super().__init__(403, _("CSRF check failed: send the X-CSRFToken header."))


class BearerTokenAuth(HttpBearer):
    """`Authorization: Bearer <token>`: tokens are hashed at rest; revoked tokens and inactive
    users are refused; the last use is recorded (`sessions_app.auth.user_for_token`)."""

    def __call__(self, request: HttpRequest) -> Awaitable[User | None] | None:
        raw = bearer_from_header(request.headers.get("Authorization"))
        if raw is None:
            return None
        return self.authenticate(request, raw)

    async def authenticate(self, request: HttpRequest, token: str) -> User | None:
        found = await on_db_idempotent(token_for_raw)(token)
        if found is None:
            return None
        request.chat_login = login_for_token(found.user, found.pk)  # type: ignore[attr-defined]
        return found.user


class SessionCookieAuth(APIKeyCookie):
    """The signed-in browser user (`request.user`), with a CSRF check on unsafe methods."""

    param_name = settings.SESSION_COOKIE_NAME

    def __init__(self, csrf: bool = True) -> None:
        super().__init__(csrf=csrf)

    def __call__(self, request: HttpRequest) -> Awaitable[User | None] | None:
        if "Authorization" in request.headers:
            return None
        return self.authenticate(request, request.COOKIES.get(self.param_name))

    async def authenticate(self, request: HttpRequest, key: str | None) -> User | None:
        auser = getattr(request, "auser", None)
        if auser is None:  # no AuthenticationMiddleware
            return None
        user = await auser()
        if not user.is_authenticated or not user.is_active:
            return None
        # Only a signed-in user is held to CSRF: an anonymous call answers 401, not 403.
        if (
            self.csrf
            and request.method not in SAFE_METHODS
            and not getattr(request, "_ninja_csrf_exempt", False)
            and check_csrf(request) is not None
        ):
            raise CsrfFailed()
        request.chat_login = login_for_session(user, request.session)  # type: ignore[attr-defined]
        return user


def request_login(request: HttpRequest) -> Login | None:
    """F8: the login an authenticated API request rides on (its SSE stream ends with it)."""
    return getattr(request, "chat_login", None)


def api_auth() -> list[Any]:
    """The authenticators of every operation, in the order they are tried."""
    return [BearerTokenAuth(), SessionCookieAuth(csrf=True)]


def docs_guard(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """`docs_decorator`: the interactive docs are for signed-in users or a valid token. The
    OpenAPI document itself stays public, so client generators and tools can fetch it."""
    from ninja.openapi.views import openapi_json

    if getattr(view, "func", None) is openapi_json:
        return view

    @wraps(view)
    def guarded(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.user.is_authenticated:
            return view(request, *args, **kwargs)
        header = request.headers.get("Authorization")
        if header is None:
            return redirect_to_login(request.get_full_path())
        if user_for_token(bearer_from_header(header)) is None:
            return JsonResponse(
                {"code": "unauthorized", "message": _("Invalid or revoked token.")}, status=401
            )
        return view(request, *args, **kwargs)

    return guarded
