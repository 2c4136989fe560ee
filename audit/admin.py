"""The audit trail in the admin (SPEC H5): read-only for everyone, superusers included. No
add, change or delete permission and no bulk action; filters by action, actor and date;
search by target id (exact, as the "Audit trail" links of dialogs, users and tokens do)."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _

from .models import AuditEvent


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ("at", "actor", "action", "target_type", "target_id", "ip", "short_details")
    list_filter = ("action", "actor", ("at", admin.DateFieldListFilter), "target_type")
    date_hierarchy = "at"
    search_fields = ("=target_id",)
    search_help_text = _("The exact id of the dialog, token, chat account or user.")
    fields = (
        "at",
        "actor",
        "actor_user_display",
        "action",
        "target_type",
        "target_id",
        "ip",
        "details_json",
    )
    readonly_fields = fields
    # The trail only grows; counting all of it on every page is the slowest part of the list.
    show_full_result_count = False
    actions = None

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description=_("actor's user"))
    def actor_user_display(self, obj: AuditEvent) -> str:
        # The id only: the user may be gone, the record stays as it was.
        return str(obj.actor_user_id) if obj.actor_user_id is not None else "-"

    @admin.display(description=_("details"))
    def short_details(self, obj: AuditEvent) -> str:
        text = json.dumps(obj.details, ensure_ascii=False, sort_keys=True)
        return text if len(text) <= 120 else text[:119] + "…"

    @admin.display(description=_("details"))
    def details_json(self, obj: AuditEvent) -> str:
        text = json.dumps(obj.details, ensure_ascii=False, sort_keys=True, indent=2)
        return format_html("<pre>{}</pre>", text)
