"""Share links in the admin (SPEC H2): operators see who shared which dialog and can revoke a
link (deleting it); the snapshot itself is not edited."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from ..models import Share
from ..shares import share_url


@admin.register(Share)
class ShareAdmin(admin.ModelAdmin):
    list_display = ("short_id", "owner", "title", "session", "created_at")
    list_select_related = ("owner", "session")
    search_fields = ("owner__username", "title")
    date_hierarchy = "created_at"
    fields = ("link", "owner", "session", "title", "created_at")
    readonly_fields = fields

    @admin.display(description=_("link"))
    def link(self, obj: Share) -> str:
        return share_url(obj.id)

    @admin.display(description=_("share id"))
    def short_id(self, obj: Share) -> str:
        return obj.id[:8] + "…"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # made by owners from their dialogs

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
