"""Login throttling (F8) with django-axes: every failed login of the web and admin login
pages is logged and recorded, and a username that keeps failing from one address is refused
for a while (settings `AXES_*`).

The address is the connection's (`REMOTE_ADDR`); behind a proxy that appends the client's
address to `X-Forwarded-For` (deploy/nginx.conf), with DJANGO_TRUST_X_FORWARDED_FOR=1, the
last address of that header (`client_address`): the one the proxy saw, which a client cannot
forge (what a client sends itself comes before it).

`ThrottledBackend` is django-axes' standalone backend for logins that come with a request
(every login page's form passes it); a login without one (a management command, a test
client's `login`) has no address to throttle by and is left to the next backend instead of
failing.
"""

from __future__ import annotations

from typing import Any

from axes.backends import AxesStandaloneBackend
from django.conf import settings
from django.http import HttpRequest


def client_address(request: HttpRequest) -> str | None:
    """The address failed logins are counted by (settings.AXES_CLIENT_IP_CALLABLE)."""
    if settings.TRUST_X_FORWARDED_FOR:
        forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
        last = forwarded.rsplit(",", 1)[-1].strip()
        if last:
            return last
    address = request.META.get("REMOTE_ADDR")
    return str(address) if address else None


class ThrottledBackend(AxesStandaloneBackend):
    def authenticate(
        self,
        request: HttpRequest | None,
        username: str | None = None,
        password: str | None = None,
        **kwargs: Any,
    ) -> None:
        if request is None:
            return None
        return super().authenticate(request, username, password, **kwargs)
