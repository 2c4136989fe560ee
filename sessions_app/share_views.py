"""The public page of a share link, `/s/{share_id}` (SPEC H2): no login, the frozen snapshot
only (its title and messages; nothing else of the owner, not even their name), rendered by
the chat's own safe Markdown module under the site's Content-Security-Policy."""

from __future__ import annotations

from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.translation import get_language
from django.utils.translation import gettext as _
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe

from chatcore.common.errors import NotFound

from . import shares


def share_strings() -> dict[str, str]:
    """The strings the page's script shows: the Markdown module's."""
    return {
        "copy": _("Copy"),
        "copied": _("Copied"),
        "copy_code": _("Copy code"),
        "image": _("Image: %(label)s"),
        "close": _("Close"),
    }


@never_cache
@require_safe
def share_page(request: HttpRequest, share_id: str) -> HttpResponse:
    try:
        share = shares.share_get_public(share_id=share_id)
    except NotFound as exc:
        raise Http404(str(exc)) from exc
    config = {
        "language": get_language() or settings.LANGUAGE_CODE,
        "strings": share_strings(),
    }
    statuses = {
        "cancelled": _("stopped"),
        "interrupted": _("interrupted"),
        "truncated": _("cut off at the length limit"),
        "filtered": _("stopped by the content filter"),
    }
    messages = [
        {**m, "status": statuses.get(m.get("status", ""), m.get("status", ""))}
        for m in share.messages
    ]
    response = render(
        request,
        "chat/share.html",
        {"share": share, "messages": messages, "chat_config": config},
    )
    # Not for search engines, and the link is not sent on to the sites it links to.
    response["X-Robots-Tag"] = "noindex, nofollow"
    response["Referrer-Policy"] = "no-referrer"
    return response
