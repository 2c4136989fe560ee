"""History, turns and memory notes in the admin (SPEC E2): messages and turns are read-only
(the engine writes them, C2, A3). An operator opening another user's message or turn, and
an operator's change of a memory note, are recorded (H5)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.text import Truncator
from django.utils.translation import gettext_lazy as _

from audit.trail import Action, Actor, TargetType, audit_record

from ..models import MemoryNote, Message, Session, Turn
from .display import message_preview
from .history import ViewRecordedMixin, admin_actor

LIST_CONTENT_CHARS = 80


class ReadOnlyAdmin(admin.ModelAdmin):
    """History and turns are written by the engine only (C2, A3)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Message)
class MessageAdmin(ViewRecordedMixin, ReadOnlyAdmin):
    list_display = ("session", "seq", "parent_seq", "role", "short_content", "created_at")
    list_select_related = ("session",)
    list_filter = ("role",)
    search_fields = ("content",)
    # Matches the (session, seq) index and reads a dialog in order when filtered to it.
    ordering = ("session_id", "seq")
    # Counting every message on each page load is the slowest part of this list.
    show_full_result_count = False

    @admin.display(description=_("content"))
    def short_content(self, obj: Message) -> str:
        return message_preview(obj, LIST_CONTENT_CHARS)

    def viewed_dialog(self, obj: Message) -> Session:
        return obj.session

    def view_details(self, request: HttpRequest, obj: Message) -> dict[str, Any]:
        return {"message_seq": obj.seq}


@admin.register(Turn)
class TurnAdmin(ViewRecordedMixin, ReadOnlyAdmin):
    list_display = (
        "session",
        "status",
        "reason",
        "error_kind",
        "mode",
        "model",
        "started_at",
        "finished_at",
    )
    list_select_related = ("session",)
    list_filter = ("status", "mode")
    show_full_result_count = False

    def viewed_dialog(self, obj: Turn) -> Session:
        return obj.session

    def view_details(self, request: HttpRequest, obj: Turn) -> dict[str, Any]:
        return {"turn_number": obj.number}


# --- Memory notes and API tokens ----------------------------------------------------------


@admin.register(MemoryNote)
class MemoryNoteAdmin(admin.ModelAdmin):
    list_display = ("owner", "short_content", "created_at")
    list_select_related = ("owner",)
    search_fields = ("content", "owner__username")
    fields = ("owner", "content")
    raw_id_fields = ("owner",)

    @admin.display(description=_("content"))
    def short_content(self, obj: MemoryNote) -> str:
        return Truncator(obj.content).chars(LIST_CONTENT_CHARS)

    # H5: an operator's writes of someone's memory; the admin's views run them in one
    # transaction with their record (the bulk delete: see delete_queryset).
    def save_model(self, request: HttpRequest, obj: MemoryNote, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        _audit_note(admin_actor(request), obj, "change" if change else "add")

    def delete_model(self, request: HttpRequest, obj: MemoryNote) -> None:
        _audit_note(admin_actor(request), obj, "delete")
        super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[MemoryNote]) -> None:
        with transaction.atomic():
            for note in queryset.select_related("owner"):
                _audit_note(admin_actor(request), note, "delete")
            super().delete_queryset(request, queryset)


def _audit_note(actor: Actor, note: MemoryNote, op: str) -> None:
    audit_record(
        actor=actor,
        action=Action.MEMORY_NOTE_CHANGE,
        target_type=TargetType.MEMORY_NOTE,
        target_id=str(note.pk),
        details={"op": op, "owner": note.owner.get_username()},
    )
