"""H5 in the operators' admin: the "Audit trail" link of a dialog's, a user's and a token's
page (the audit list filtered to that object), the record of an operator reading another
user's dialog, message or turn, and the actor of an operator's action."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.urls import reverse

from audit.trail import Action, Actor, audit_dialog

from ..models import Session


def admin_actor(request: HttpRequest) -> Actor:
    """The operator making a change in the admin, with the address it came from."""
    return Actor.of_request(request, via="admin")


def history_url(target_type: str, target_id: object) -> str:
    query = urlencode({"target_type": target_type, "target_id": str(target_id)})
    return f"{reverse('admin:audit_auditevent_changelist')}?{query}"


class AuditHistoryMixin(admin.ModelAdmin):
    """Adds the "Audit trail" link to the object tools of the change page."""

    change_form_template = "admin/audit/history_change_form.html"
    audit_target_type = ""

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        context = dict(extra_context or {})
        if request.user.has_perm("audit.view_auditevent"):
            context["audit_history_url"] = history_url(self.audit_target_type, unquote(object_id))
        return super().change_view(request, object_id, form_url, context)


class ViewRecordedMixin(admin.ModelAdmin):
    """H5: an operator reading another user's conversation on this change page is recorded
    (`admin.view_dialog`, once per page shown), in the transaction that reads it."""

    def viewed_dialog(self, obj: Any) -> Session | None:
        """The dialog whose conversation the page shows (None: nothing to record)."""
        return None

    def view_details(self, request: HttpRequest, obj: Any) -> dict[str, Any]:
        return {}

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        with transaction.atomic():
            response = super().change_view(request, object_id, form_url, extra_context)
            shown = (getattr(response, "context_data", None) or {}).get("original")
            session = self.viewed_dialog(shown) if shown is not None else None
            if (
                request.method == "GET"
                and response.status_code == 200
                and session is not None
                and session.owner_id != request.user.pk
            ):
                audit_dialog(
                    actor=admin_actor(request),
                    action=Action.ADMIN_VIEW_DIALOG,
                    session=session,
                    **self.view_details(request, shown),
                )
        return response
