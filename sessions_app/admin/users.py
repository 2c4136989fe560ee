"""Users in the admin (H5): Django's own user admin, with an operator's change of a user's
active, staff or superuser flag, and a user's deletion, recorded in the transaction that
makes it, and the link to the user's audit trail. (A user with dialogs cannot be deleted
here: their messages are read-only in the admin.)"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse

from audit.trail import USER_FLAGS, Action, Actor, TargetType, audit_record, audit_user_change

from .history import AuditHistoryMixin, admin_actor

User = get_user_model()


class AuditedUserAdmin(AuditHistoryMixin, UserAdmin):
    audit_target_type = "user"

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        # Besides what was done to the user, what the user did (by the actor's id, which
        # outlives a rename).
        context = dict(extra_context or {})
        if request.user.has_perm("audit.view_auditevent"):
            query = urlencode({"actor_user__id__exact": unquote(object_id)})
            context["audit_actor_url"] = f"{reverse('admin:audit_auditevent_changelist')}?{query}"
        return super().change_view(request, object_id, form_url, context)

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        # The change view runs in one transaction: the save and its record commit together.
        before: dict[str, Any] = {}
        if change:
            stored = User._default_manager.filter(pk=obj.pk).values(*USER_FLAGS).first()
            before = stored or {}
        super().save_model(request, obj, form, change)
        if change:
            audit_user_change(actor=admin_actor(request), user=obj, before=before)

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        _audit_delete(admin_actor(request), obj)  # the delete view is one transaction
        super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        with transaction.atomic():
            for user in queryset:
                _audit_delete(admin_actor(request), user)
            super().delete_queryset(request, queryset)


def _audit_delete(actor: Actor, user: Any) -> None:
    audit_record(
        actor=actor,
        action=Action.USER_DELETE,
        target_type=TargetType.USER,
        target_id=str(user.pk),
        details={"user": user.get_username(), "email": user.email},
    )


if admin.site.is_registered(User):
    admin.site.unregister(User)
admin.site.register(User, AuditedUserAdmin)
