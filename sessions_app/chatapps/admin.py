"""Operators' view of chat-app accounts and chats (E2). Linking an account to a web user
goes through `store.account_link`, which moves the dialogs of the account's chats to that
user, so they appear in the user's dialog lists."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from audit.trail import Actor
from sessions_app.channel_models import ChannelAccount, ChannelChat

from ..admin.history import AuditHistoryMixin
from . import store


@admin.register(ChannelAccount)
class ChannelAccountAdmin(AuditHistoryMixin, admin.ModelAdmin):
    audit_target_type = "chat_account"
    list_display = ("channel", "external_id", "display_name", "user", "writable", "last_seen_at")
    list_filter = ("channel", "writable")
    search_fields = ("external_id", "display_name", "user__username")
    fields = (
        "channel",
        "external_id",
        "display_name",
        "service_user",
        "user",
        "writable",
        "created_at",
        "last_seen_at",
    )
    readonly_fields = (
        "channel",
        "external_id",
        "display_name",
        "service_user",
        "created_at",
        "last_seen_at",
    )
    raw_id_fields = ("user",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # accounts come from the platforms

    def save_model(
        self, request: HttpRequest, obj: ChannelAccount, form: Any, change: bool
    ) -> None:
        store.account_link(
            account=obj,
            user=obj.user,
            writable=obj.writable,
            actor=Actor.of_request(request, via="admin"),
        )


@admin.register(ChannelChat)
class ChannelChatAdmin(admin.ModelAdmin):
    list_display = ("channel", "chat_id", "title", "is_group", "account", "current_dialog_id")
    list_filter = ("channel", "is_group")
    search_fields = ("chat_id", "title", "account__external_id", "account__display_name")
    readonly_fields = (
        "channel",
        "chat_id",
        "title",
        "is_group",
        "account",
        "current_dialog_id",
        "created_at",
    )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
