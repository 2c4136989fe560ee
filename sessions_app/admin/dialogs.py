"""The dialogs' admin (SPEC E2, A7): browse, search and filter dialogs, read their messages in
order, rename, soft delete, restore and purge them.

Every write goes through `services` (or `delete_dialog`), never through a ModelAdmin's default
`save()`/`delete()`, so that renames, deletes and restores bump the state version and reach
connected clients just as they do from the web chat; a soft delete ends the running turn as
any other delete does (C9).
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import async_to_sync
from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import ValidationError
from django.core.paginator import Page, Paginator
from django.db import transaction
from django.db.models import QuerySet
from django.forms.models import BaseInlineFormSet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from audit.trail import Action, audit_dialog
from chatcore.common.errors import ChatError
from chatcore.engine.dialogs import delete_dialog

from .. import branches, search, services
from ..models import Message, Session, TitleSource, Turn
from .display import message_preview
from .files import attachments_html, files_url
from .history import AuditHistoryMixin, ViewRecordedMixin, admin_actor
from .settings import (
    DIALOG_SETTINGS_FIELDSET,
    DialogSettingsAdminMixin,
    DialogSettingsFormMixin,
)

# E2: a dialog can hold thousands of messages; the change page shows them a page at a time.
MESSAGE_PAGE_SIZE = 100
MESSAGE_PAGE_PARAM = "messages_page"
INLINE_CONTENT_CHARS = 1000


class DeletedFilter(admin.SimpleListFilter):
    """A7: soft-deleted dialogs stay visible to operators until they are purged."""

    title = _("state")
    parameter_name = "deleted"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("live", _("Live")), ("deleted", _("Deleted"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "live":
            return queryset.filter(deleted_at__isnull=True)
        if self.value() == "deleted":
            return queryset.filter(deleted_at__isnull=False)
        return queryset


class MessageWindowFormSet(BaseInlineFormSet):
    """An inline formset over one page of a dialog's messages; the page drives the
    navigation links in the inline's template."""

    def __init__(self, *args: Any, page: Page[Any] | None = None, **kwargs: Any) -> None:
        self.page = page
        self.page_range = (
            list(page.paginator.get_elided_page_range(page.number)) if page is not None else []
        )
        super().__init__(*args, **kwargs)


class MessageInline(admin.TabularInline):
    """E2: the read-only, seq-ordered message view of a dialog."""

    model = Message
    formset = MessageWindowFormSet
    template = "admin/sessions_app/session/message_inline.html"
    fields = ("seq", "role", "content_preview", "attachments", "versions", "status", "created_at")
    readonly_fields = fields
    ordering = ("seq",)
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description=_("versions"))
    def versions(self, obj: Message) -> str:
        """H1: at a fork of the active path, which version this is, linked to all of them."""
        forks = self._forks.get(obj.session_id)
        if forks is None:
            forks = Session.objects.filter(pk=obj.session_id).values_list("forks", flat=True)[0]
            self._forks[obj.session_id] = forks or {}
        kin = (forks or {}).get(branches.fork_key(obj.parent_seq), [])
        if len(kin) < 2 or obj.seq not in kin:
            return ""
        url = reverse("admin:sessions_app_message_changelist")
        same: dict[str, str | int] = {"session": obj.session_id}
        if obj.parent_seq is None:
            same["parent_seq__isnull"] = "True"
        else:
            same["parent_seq"] = obj.parent_seq
        query = urlencode(same)
        label = gettext("%(n)d of %(total)d") % {"n": kin.index(obj.seq) + 1, "total": len(kin)}
        return format_html('<a href="{}?{}">{}</a>', url, query, label)

    @cached_property
    def _forks(self) -> dict[str, dict[str, list[int]]]:
        return {}

    @admin.display(description=_("content"))
    def content_preview(self, obj: Message) -> str:
        # Long answers are cut here; the message's own page shows all of it. An answer that
        # only calls tools shows its calls (H5 polish).
        return message_preview(obj, INLINE_CONTENT_CHARS)

    @admin.display(description=_("attachments"))
    def attachments(self, obj: Message) -> str:
        return attachments_html(obj.media_refs or [])  # H3


class SessionAdminForm(DialogSettingsFormMixin, forms.ModelForm):
    class Meta:
        model = Session
        fields = ("title", "model", "system_prompt")

    def clean_title(self) -> str:
        # The same rules as a rename from the web chat (B4), reported as a form error.
        try:
            return services.clean_title(self.cleaned_data.get("title"))
        except ChatError as exc:
            raise ValidationError(exc.message) from exc


@admin.register(Session)
class SessionAdmin(
    DialogSettingsAdminMixin, ViewRecordedMixin, AuditHistoryMixin, admin.ModelAdmin
):
    form = SessionAdminForm
    audit_target_type = "dialog"
    inlines = (MessageInline,)
    list_display = (
        "session_id_display",
        "title",
        "owner",
        "channel",
        "message_count",
        "last_active_at",
        "is_deleted_display",
    )
    list_select_related = ("owner",)
    list_filter = (
        "channel",
        ("last_active_at", admin.DateFieldListFilter),
        DeletedFilter,
    )
    date_hierarchy = "last_active_at"
    # Messages are searched through the search index (H2, `get_search_results`).
    search_fields = ("title", "dialog_id", "chat_id", "channel", "owner__username")
    actions = (
        "soft_delete_selected",
        "restore_selected",
        "purge_selected",
        "regenerate_title_selected",
        "compact_selected",
    )
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "session_id_display",
                    "title",
                    "title_source",
                    "owner",
                    "channel",
                    "chat_id",
                    "dialog_id",
                )
            },
        ),
        (
            _("Activity"),
            {
                "fields": (
                    "created_at",
                    "last_active_at",
                    "deleted_at",
                    "message_count",
                    "total_message_count",
                    "files_link",
                )
            },
        ),
        DIALOG_SETTINGS_FIELDSET,
        (
            _("Engine state"),
            {
                "classes": ("collapse",),
                "fields": (
                    "last_seq",
                    "state_version",
                    "turn_counter",
                    "lease_owner",
                    "lease_expires_at",
                    "plan",
                ),
            },
        ),
    )
    # Everything but the title is read-only (E2): the rest belongs to the engine.
    readonly_fields = (
        "session_id_display",
        "title_source",
        "owner",
        "channel",
        "chat_id",
        "dialog_id",
        "created_at",
        "last_active_at",
        "deleted_at",
        "message_count",
        "total_message_count",
        "files_link",
        "last_seq",
        "state_version",
        "turn_counter",
        "lease_owner",
        "lease_expires_at",
        "plan",
        "usage_display",
    )

    @admin.display(description=_("files"))
    def files_link(self, obj: Session) -> str:
        # H3: the files this dialog's messages attached.
        count = obj.file_uses.count()
        return format_html('<a href="{}">{}</a>', files_url(session=obj.pk), count)

    @admin.display(description=_("session id"))
    def session_id_display(self, obj: Session) -> str:
        return obj.session_id

    @admin.display(description=_("deleted"), boolean=True, ordering="deleted_at")
    def is_deleted_display(self, obj: Session) -> bool:
        return obj.is_deleted

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Session], search_term: str
    ) -> tuple[QuerySet[Session], bool]:
        """Django's search over the fields above, or a message holding every word, found
        through the same index as the users' search (H2), of anyone's dialog."""
        found, may_have_duplicates = super().get_search_results(request, queryset, search_term)
        if not search_term.strip():
            return found, may_have_duplicates
        pks = search.session_pks_matching(q=search_term)
        return found | queryset.filter(pk__in=pks), may_have_duplicates

    def has_add_permission(self, request: HttpRequest) -> bool:
        # Dialogs are created by their owners through a channel, which checks the chat (A1).
        return False

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        # The bulk delete would bypass services; purge_selected replaces it.
        actions.pop("delete_selected", None)
        return actions

    def get_formset_kwargs(
        self, request: HttpRequest, obj: Any, inline: Any, prefix: str
    ) -> dict[str, Any]:
        params = super().get_formset_kwargs(request, obj, inline, prefix)
        if isinstance(inline, MessageInline) and obj is not None and obj.pk is not None:
            params["queryset"], params["page"] = self._message_window(request, obj, params)
        return params

    def _message_window(
        self, request: HttpRequest, obj: Session, params: dict[str, Any]
    ) -> tuple[QuerySet[Message], Page[Any]]:
        # A formset cannot take a sliced queryset, so the page is cut out by its seq range.
        queryset: QuerySet[Message] = params["queryset"].filter(session=obj).order_by("seq")
        path = branches.active_path(obj)
        if path is not None:
            # H1: a forked dialog shows its active path; the versions column marks its forks.
            paginator = Paginator(path, MESSAGE_PAGE_SIZE)
            page = paginator.get_page(request.GET.get(MESSAGE_PAGE_PARAM))
            return queryset.filter(seq__in=list(page.object_list)), page
        paginator = Paginator(queryset.values_list("seq", flat=True), MESSAGE_PAGE_SIZE)
        page = paginator.get_page(request.GET.get(MESSAGE_PAGE_PARAM))
        seqs = list(page.object_list)
        if seqs:
            queryset = queryset.filter(seq__gte=seqs[0], seq__lte=seqs[-1])
        return queryset, page

    def save_model(self, request: HttpRequest, obj: Session, form: Any, change: bool) -> None:
        # Only the title is editable, and a rename goes through the service so that it wins
        # over automatic titles (B4) and reaches connected clients; a default save() would
        # also write back stale counters of a dialog that is being used right now.
        if change and "title" in form.changed_data:
            try:
                services.session_rename(
                    session=obj,
                    title=form.cleaned_data["title"],
                    source=TitleSource.OPERATOR,
                    actor=admin_actor(request),
                )
            except ChatError as exc:
                self.message_user(request, exc.message, level=messages.ERROR)
        if change:
            self.save_dialog_settings(request, obj, form)

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        # The message inline is read-only; nothing of a dialog's history is written here.
        return None

    def construct_change_message(
        self, request: HttpRequest, form: Any, formsets: Any, add: bool = False
    ) -> Any:
        # The unsaved read-only inline has nothing to report (and no saved-object lists).
        return super().construct_change_message(request, form, [], add)

    def delete_model(self, request: HttpRequest, obj: Session) -> None:
        services.session_purge(session=obj, actor=admin_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Session]) -> None:
        for session in queryset:
            services.session_purge(session=session, actor=admin_actor(request))

    def viewed_dialog(self, obj: Session) -> Session:
        return obj

    def view_details(self, request: HttpRequest, obj: Session) -> dict[str, Any]:
        return {"messages_page": request.GET.get(MESSAGE_PAGE_PARAM) or "1"}

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> tuple[Any, ...]:
        # Purging cascades in the database (A7). Listing every message would make the page
        # unusable, and the read-only message and turn admins must not veto the purge.
        sessions = list(objs)
        return [str(s) for s in sessions], self._purge_summary(sessions), set(), []

    def _purge_summary(self, sessions: list[Session]) -> dict[str, int]:
        pks = [s.pk for s in sessions]
        return {
            str(Session._meta.verbose_name_plural): len(sessions),
            str(Message._meta.verbose_name_plural): Message.objects.filter(session__in=pks).count(),
            str(Turn._meta.verbose_name_plural): Turn.objects.filter(session__in=pks).count(),
        }

    @admin.action(permissions=["change"], description=_("Soft delete selected dialogs"))
    def soft_delete_selected(self, request: HttpRequest, queryset: QuerySet[Session]) -> None:
        done = 0
        for session in queryset.filter(deleted_at__isnull=True):
            try:
                # C9: the one delete; it ends a running turn, wherever it runs, as stale.
                async_to_sync(delete_dialog)(engine=None, session=session, by=admin_actor(request))
            except ChatError as exc:
                self._report_failure(request, session, exc)
                continue
            done += 1
        self.message_user(
            request,
            ngettext("Soft-deleted %(n)d dialog.", "Soft-deleted %(n)d dialogs.", done)
            % {"n": done},
            level=messages.SUCCESS,
        )

    @admin.action(permissions=["change"], description=_("Regenerate title of selected dialogs"))
    def regenerate_title_selected(self, request: HttpRequest, queryset: QuerySet[Session]) -> None:
        # B4: the same background job as automatic titles, over a title reset to the default.
        from chatcore.engine import background

        done = 0
        for session in queryset.filter(deleted_at__isnull=True):
            services.title_reset(session=session, actor=admin_actor(request))
            background.request_title(session_pk=session.pk)
            done += 1
        self.message_user(
            request,
            ngettext(
                "Title generation started for %(n)d dialog.",
                "Title generation started for %(n)d dialogs.",
                done,
            )
            % {"n": done},
            level=messages.SUCCESS,
        )

    @admin.action(permissions=["change"], description=_("Compact selected dialogs"))
    def compact_selected(self, request: HttpRequest, queryset: QuerySet[Session]) -> None:
        # B5: the same background job as /compact.
        from chatcore.engine import background

        done = 0
        for session in queryset.filter(deleted_at__isnull=True):
            with transaction.atomic():  # H5: the operator's request is recorded
                audit_dialog(
                    actor=admin_actor(request), action=Action.DIALOG_COMPACT, session=session
                )
            background.request_compaction(session_pk=session.pk, manual=True)
            done += 1
        self.message_user(
            request,
            ngettext(
                "Compaction started for %(n)d dialog.",
                "Compaction started for %(n)d dialogs.",
                done,
            )
            % {"n": done},
            level=messages.SUCCESS,
        )

    @admin.action(permissions=["change"], description=_("Restore selected dialogs"))
    def restore_selected(self, request: HttpRequest, queryset: QuerySet[Session]) -> None:
        done = 0
        for session in queryset.filter(deleted_at__isnull=False):
            try:
                services.session_restore(session=session, actor=admin_actor(request))
            except ChatError as exc:
                # A7: a live dialog has taken the id; the operator resolves it by hand.
                self._report_failure(request, session, exc)
                continue
            done += 1
        self.message_user(
            request,
            ngettext("Restored %(n)d dialog.", "Restored %(n)d dialogs.", done) % {"n": done},
            level=messages.SUCCESS if done else messages.WARNING,
        )

    @admin.action(permissions=["delete"], description=_("Hard delete (purge) selected dialogs"))
    def purge_selected(
        self, request: HttpRequest, queryset: QuerySet[Session]
    ) -> HttpResponse | None:
        # A purge cannot be undone, so it asks first, like Django's own bulk delete.
        if request.POST.get("post") != "yes":
            sessions = list(queryset.select_related("owner"))
            context = {
                **self.admin_site.each_context(request),
                "title": gettext("Purge dialogs"),
                "opts": self.opts,
                "sessions": sessions,
                "summary": self._purge_summary(sessions),
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
                "media": self.media,
            }
            request.current_app = self.admin_site.name
            return TemplateResponse(
                request, "admin/sessions_app/session/purge_confirmation.html", context
            )
        done = 0
        for session in queryset:
            try:
                services.session_purge(session=session, actor=admin_actor(request))
            except ChatError as exc:
                self._report_failure(request, session, exc)
                continue
            done += 1
        self.message_user(
            request,
            ngettext("Purged %(n)d dialog.", "Purged %(n)d dialogs.", done) % {"n": done},
            level=messages.SUCCESS,
        )
        return None

    def _report_failure(self, request: HttpRequest, session: Session, exc: ChatError) -> None:
        self.message_user(request, f"{session.session_id}: {exc.message}", level=messages.ERROR)
