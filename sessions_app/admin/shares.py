"""Share links in the admin (SPEC H2): operators see who shared which dialog and can revoke a
link (deleting it); the snapshot itself is not edited."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from ..models import Share
from ..shares import share_delete, share_url
from .history import admin_actor


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

    # A revoke goes through the service, which writes its audit record (H5).
    def delete_model(self, request: HttpRequest, obj: Share) -> None:
        share_delete(share=obj, actor=admin_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Share]) -> None:
        for share in queryset.select_related("session"):
            share_delete(share=share, actor=admin_actor(request))
