"""Uploaded files in the admin (SPEC H3, E2): read-only, listed per user (`?owner=<id>`) and
per dialog (`?session=<pk>`) with name, kind, type and size; a dialog's page links to its
files and shows each message's attachments (`attachments_html`). Files are deleted with the
dialogs that used them (purge) or by the sweep, never here.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import Count, QuerySet
from django.http import HttpRequest
from django.template.defaultfilters import filesizeformat
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _

from ..file_models import File


class _ByParam(admin.SimpleListFilter):
    """A filter set from a link (a user's or a dialog's files), shown once it is set."""

    field = ""

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        value = self.value()
        return [(value, value)] if value else []

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(**{self.field: value}).distinct() if value else queryset


class OwnerFilter(_ByParam):
    title = _("owner id")
    parameter_name = "owner"
    field = "owner_id"


class DialogFilter(_ByParam):
    title = _("dialog")
    parameter_name = "session"
    field = "uses__session_id"


@admin.register(File)
class FileAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "owner_link",
        "kind",
        "content_type",
        "size_display",
        "dialogs",
        "created_at",
    )
    list_select_related = ("owner",)
    list_filter = ("kind", OwnerFilter, DialogFilter, ("created_at", admin.DateFieldListFilter))
    search_fields = ("name", "owner__username", "checksum")
    ordering = ("-created_at",)
    show_full_result_count = False
    fields = (
        "name",
        "owner",
        "kind",
        "content_type",
        "size_display",
        "width",
        "height",
        "checksum",
        "storage_key",
        "created_at",
        "dialogs",
    )
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[File]:
        return super().get_queryset(request).annotate(dialog_count=Count("uses"))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description=_("size"), ordering="size")
    def size_display(self, obj: File) -> str:
        return filesizeformat(obj.size)

    @admin.display(description=_("owner"), ordering="owner__username")
    def owner_link(self, obj: File) -> SafeString:
        return format_html(
            '<a href="{}">{}</a>', files_url(owner=obj.owner_id), obj.owner.get_username()
        )

    @admin.display(description=_("dialogs"))
    def dialogs(self, obj: File) -> SafeString:
        uses = obj.uses.select_related("session").order_by("created_at")[:20]
        return format_html_join(
            ", ",
            '<a href="{}">{}</a>',
            (
                (reverse("admin:sessions_app_session_change", args=[u.session_id]), u.session)
                for u in uses
            ),
        )


def files_url(**params: Any) -> str:
    return reverse("admin:sessions_app_file_changelist") + "?" + urlencode(params)


def attachments_html(refs: list[dict[str, Any]]) -> SafeString:
    """A message's attachments on its dialog's page: name, type and size of each."""
    return format_html_join(
        "<br>",
        "📎 {} ({}, {})",
        (
            (r.get("name", ""), r.get("content_type", ""), filesizeformat(r.get("size", 0)))
            for r in refs
        ),
    )
