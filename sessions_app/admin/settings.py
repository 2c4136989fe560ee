"""A dialog's settings in the admin (SPEC H4): its model (one the model server offers, or the
default) and its system prompt, editable on the dialog's page; its token usage beside them;
and the usage table per dialog, user or day (`usage/`, sortable by every column)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils import timezone
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from chatcore.common.errors import ChatError
from chatcore.common.llm_models import SYSTEM_PROMPT_MAX
from chatcore.engine import runtime
from chatcore.engine.dialog_settings import catalog_for

from .. import settings_services, usage
from ..models import Session
from .history import admin_actor

DIALOG_SETTINGS_FIELDSET: Any = (
    _("Model and instructions"),
    {"fields": ("model", "system_prompt", "usage_display")},
)
GROUPS = {
    "dialog": _("Dialog"),
    "user": _("User"),
    "model": _("Model"),
    "day": _("Day"),
}
PERIODS = {"1": _("Today"), "7": _("Last 7 days"), "30": _("Last 30 days"), "all": _("All time")}
COLUMNS = ("key", "turns", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens")


class DialogSettingsFormMixin(forms.ModelForm):
    """The model as a choice among what the model server offers now (the dialog's own kept
    even when the list no longer has it), the system prompt with its length limit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # This process's engine when it runs one (the admin inside `serve`), else a catalog
        # made from the settings (the admin under a plain WSGI server).
        catalog = catalog_for(runtime.current_engine())
        ids = catalog.ids()  # blocking when the list is stale: a sync caller
        own = self.instance.model if self.instance is not None else ""
        choices = [("", gettext("Default (%(model)s)") % {"model": catalog.default})]
        choices += [(name, name) for name in ids]
        if own and own not in ids:
            choices.append((own, gettext("%(model)s (no longer listed)") % {"model": own}))
        self.fields["model"] = forms.ChoiceField(
            label=gettext("Model"), choices=choices, required=False
        )
        self.fields["system_prompt"] = forms.CharField(
            label=gettext("System prompt"),
            required=False,
            max_length=SYSTEM_PROMPT_MAX,
            strip=True,
            widget=forms.Textarea(attrs={"rows": 6}),
            help_text=gettext(
                "Instructions the model follows in this dialog, after the platform's own."
            ),
        )


class DialogSettingsAdminMixin(admin.ModelAdmin):
    @admin.display(description=_("tokens used"))
    def usage_display(self, obj: Session) -> str:
        if obj.pk is None:
            return "-"
        used = usage.session_usage(session_pk=obj.pk)
        return gettext(
            "%(prompt)d prompt (%(cached)d cached), %(completion)d completion in %(turns)d answers"
        ) % {
            "prompt": used["prompt_tokens"],
            "cached": used["cached_tokens"],
            "completion": used["completion_tokens"],
            "turns": used["turns"],
        }

    def save_dialog_settings(self, request: HttpRequest, obj: Session, form: Any) -> None:
        """H4: a changed model or system prompt goes through the service, which tells the
        dialog's connected clients (`session_updated`)."""
        changed = {
            name: form.cleaned_data[name]
            for name in ("model", "system_prompt")
            if name in form.changed_data
        }
        if not changed:
            return
        try:
            settings_services.session_settings_update(
                session=obj, actor=admin_actor(request), **changed
            )
        except ChatError as exc:
            self.message_user(request, exc.message, level=messages.ERROR)

    def get_urls(self) -> list[URLPattern]:
        usage_url = path(
            "usage/",
            self.admin_site.admin_view(self.usage_view),
            name="sessions_app_session_usage",
        )
        return [usage_url, *super().get_urls()]

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        return super().changelist_view(request, {**(extra_context or {}), "has_usage_link": True})

    def usage_view(self, request: HttpRequest) -> HttpResponse:
        """H4: tokens the model reported, summed per dialog, user or day; every column sorts
        (`?o=column` ascending, `?o=-column` descending)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        group = request.GET.get("group", "day")
        group = group if group in GROUPS else "day"
        period = request.GET.get("period", "30")
        period = period if period in PERIODS else "30"
        order = request.GET.get("o", "-key" if group == "day" else "-total_tokens")
        column = order.lstrip("-")
        column = column if column in COLUMNS else "total_tokens"
        descending = order.startswith("-")
        since = None
        if period != "all":
            today = timezone.localtime().replace(hour=0, minute=0, second=0, microsecond=0)
            since = today - timedelta(days=int(period) - 1)
        rows = usage.usage_rows(group=group, since=since)
        for row in rows:
            row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
        rows.sort(key=lambda row: (row[column], row["key"]), reverse=descending)
        headers = [
            {
                "name": name,
                "label": label,
                "sorted": name == column,
                "descending": descending,
                "order": ("" if name == column and descending else "-") + name,
            }
            for name, label in (
                ("key", GROUPS[group]),
                ("turns", gettext("Answers")),
                ("prompt_tokens", gettext("Prompt tokens")),
                ("cached_tokens", gettext("Cached")),
                ("completion_tokens", gettext("Completion tokens")),
                ("total_tokens", gettext("Total")),
            )
        ]
        context = {
            **self.admin_site.each_context(request),
            "title": gettext("Token usage"),
            "opts": self.opts,
            "rows": rows,
            "headers": headers,
            "group": group,
            "groups": GROUPS,
            "period": period,
            "periods": PERIODS,
            "order": order,
            "totals": usage.usage_sum_rows(rows),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/sessions_app/session/usage.html", context)
