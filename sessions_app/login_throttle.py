"""Login throttling (F8) with django-axes: every failed login of the web and admin login
pages is logged and recorded, and a username that keeps failing from one address is refused
for a while (settings `AXES_*`).

`ThrottledBackend` is django-axes' standalone backend for logins that come with a request
(every login page's form passes it); a login without one (a management command, a test
client's `login`) has no address to throttle by and is left to the next backend instead of
failing.
"""

from __future__ import annotations

from typing import Any

from axes.backends import AxesStandaloneBackend
from django.http import HttpRequest


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
