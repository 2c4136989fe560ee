"""History, turns and memory notes in the admin (SPEC E2): messages and turns are read-only
(the engine writes them, C2, A3)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils.text import Truncator
from django.utils.translation import gettext_lazy as _

from ..models import MemoryNote, Message, Turn

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
class MessageAdmin(ReadOnlyAdmin):
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
        return Truncator(obj.content).chars(LIST_CONTENT_CHARS)


@admin.register(Turn)
class TurnAdmin(ReadOnlyAdmin):
    list_display = (
        "session",
        "status",
        "reason",
        "error_kind",
        "mode",
        "started_at",
        "finished_at",
    )
    list_select_related = ("session",)
    list_filter = ("status", "mode")
    show_full_result_count = False


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
