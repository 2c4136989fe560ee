"""Response headers every page carries (SPEC F8): a Content-Security-Policy that allows only
this site's own scripts (no inline script, no eval) and no framing. `nosniff`, HSTS and
secure cookies come from Django's SecurityMiddleware and the settings switches."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest
from django.http.response import HttpResponseBase

HEADER = "Content-Security-Policy"


class ContentSecurityPolicyMiddleware:
    """Adds `settings.CONTENT_SECURITY_POLICY` to responses that set none of their own."""

    sync_capable = True
    async_capable = True

    def __init__(
        self,
        get_response: Callable[[HttpRequest], HttpResponseBase]
        | Callable[[HttpRequest], Awaitable[HttpResponseBase]],
    ) -> None:
        self.get_response = get_response
        self.policy = "; ".join(
            f"{name} {value}" for name, value in settings.CONTENT_SECURITY_POLICY.items()
        )
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> HttpResponseBase | Awaitable[HttpResponseBase]:
        if self.is_async:
            return self.__acall__(request)
        response = self.get_response(request)
        assert isinstance(response, HttpResponseBase)
        return self._add(response)

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        response = await self.get_response(request)  # type: ignore[misc]
        return self._add(response)

    def _add(self, response: HttpResponseBase) -> HttpResponseBase:
        if HEADER not in response:
            response[HEADER] = self.policy
        return response
