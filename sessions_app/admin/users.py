"""Users in the admin (H5): Django's own user admin, with an operator's change of a user's
active, staff or superuser flag recorded in the transaction that saves it, and the link to
the user's audit trail."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin
from django.http import HttpRequest

from audit.trail import USER_FLAGS, audit_user_change

from .history import AuditHistoryMixin, admin_actor

User = get_user_model()


class AuditedUserAdmin(AuditHistoryMixin, UserAdmin):
    audit_target_type = "user"

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        # The change view runs in one transaction: the save and its record commit together.
        before: dict[str, Any] = {}
        if change:
            stored = User._default_manager.filter(pk=obj.pk).values(*USER_FLAGS).first()
            before = stored or {}
        super().save_model(request, obj, form, change)
        if change:
            audit_user_change(actor=admin_actor(request), user=obj, before=before)


if admin.site.is_registered(User):
    admin.site.unregister(User)
admin.site.register(User, AuditedUserAdmin)
