"""API tokens in the admin (SPEC F2, F8): issue (the key is shown once) and revoke."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from .. import services
from ..models import ApiToken
from .history import AuditHistoryMixin, admin_actor


@admin.register(ApiToken)
class ApiTokenAdmin(AuditHistoryMixin, admin.ModelAdmin):
    """F2: tokens are issued here or by a management command; only a hash is stored, so the
    key is shown once, right after it is issued."""

    audit_target_type = "token"
    list_display = ("user", "name", "prefix", "created_at", "last_used_at", "is_revoked")
    list_select_related = ("user",)
    list_filter = (("revoked_at", admin.EmptyFieldListFilter),)
    search_fields = ("name", "prefix", "user__username")
    raw_id_fields = ("user",)
    actions = ("revoke_selected",)
    # key_hash is in neither list: it is never displayed.
    add_fields = ("user", "name")
    change_fields = ("user", "name", "prefix", "created_at", "last_used_at", "revoked_at")

    @admin.display(description=_("revoked"), boolean=True, ordering="revoked_at")
    def is_revoked(self, obj: ApiToken) -> bool:
        return obj.revoked_at is not None

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return self.change_fields if obj is not None else self.add_fields

    # F8: a token acts as its user, so only superusers issue (and see, and revoke) tokens of
    # other users; other staff manage their own.
    def get_queryset(self, request: HttpRequest) -> QuerySet[ApiToken]:
        queryset = super().get_queryset(request)
        if request.user.is_superuser:
            return queryset
        return queryset.filter(user_id=request.user.pk)

    def formfield_for_foreignkey(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        if db_field.name == "user" and not request.user.is_superuser:
            kwargs["queryset"] = get_user_model().objects.filter(pk=request.user.pk or 0)
            kwargs["initial"] = request.user.pk
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # An issued token is immutable; revoking is an action.
        return self.change_fields if obj is not None else ()

    def save_model(self, request: HttpRequest, obj: ApiToken, form: Any, change: bool) -> None:
        if change:
            # Nothing is editable, and a save() would write back a stale revoked_at.
            return
        token, raw = services.api_token_issue(
            user=form.cleaned_data["user"],
            name=form.cleaned_data.get("name") or "",
            actor=admin_actor(request),
        )
        # The admin logs and redirects to `obj`, so it becomes the issued row.
        for field in ApiToken._meta.concrete_fields:
            setattr(obj, field.attname, getattr(token, field.attname))
        obj._state.adding = False
        obj._state.db = token._state.db
        self.message_user(
            request,
            gettext(
                "New API token for %(user)s: %(key)s — copy it now, it will not be shown again."
            )
            % {"user": token.user, "key": raw},
            level=messages.WARNING,
        )

    @admin.action(permissions=["change"], description=_("Revoke selected tokens"))
    def revoke_selected(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> None:
        done = 0
        for token in queryset.filter(revoked_at__isnull=True):
            services.api_token_revoke(token=token, actor=admin_actor(request))
            done += 1
        self.message_user(
            request,
            ngettext("Revoked %(n)d token.", "Revoked %(n)d tokens.", done) % {"n": done},
            level=messages.SUCCESS,
        )
