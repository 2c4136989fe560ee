"""Chat apps (Telegram, Feishu): the platform's accounts and chats, inbound de-duplication
and the platform messages that stream turns (SPEC A1, D4, D5). Kept beside `models.py`, which
imports it, so the app's models stay one registry."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _


class ChannelAccount(models.Model):
    """A person on a chat platform (A1, F6, F7). The engine acts for them as `identity`: the
    Django user an operator linked them to, else their own service user (no password, so it
    cannot log in). Per-user limits therefore apply to the account (or to the linked person
    as a whole)."""

    id = models.BigAutoField(primary_key=True)
    channel = models.CharField(_("channel"), max_length=64)
    external_id = models.CharField(_("external id"), max_length=128)
    display_name = models.CharField(_("display name"), max_length=200, blank=True, default="")
    service_user = models.OneToOneField(
        settings.AUTH_USER_MODEL,
        on_delete=models.PROTECT,
        related_name="channel_account",
        verbose_name=_("service user"),
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="linked_channel_accounts",
        verbose_name=_("linked user"),
        help_text=_("A web user who sees this account's chat-app dialogs in their sidebar."),
    )
    writable = models.BooleanField(
        _("writable"),
        default=False,
        help_text=_("The linked user may also write into these dialogs from the web and the API."),
    )
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    last_seen_at = models.DateTimeField(_("last seen"), default=timezone.now)

    class Meta:
        verbose_name = _("chat account")
        verbose_name_plural = _("chat accounts")
        constraints = [
            models.UniqueConstraint(fields=["channel", "external_id"], name="uniq_channel_account")
        ]
        ordering = ["channel", "external_id"]

    def __str__(self) -> str:
        return f"{self.channel}:{self.external_id} ({self.display_name})"

    @property
    def identity_id(self) -> int:
        return self.user_id or self.service_user_id


class ChannelChat(models.Model):
    """A platform chat (private or group). Its dialogs belong to the account that connected
    it (A1): the first account whose message reached the bot from it. `current_dialog_id`
    keeps the chat's current dialog across restarts (B1)."""

    id = models.BigAutoField(primary_key=True)
    channel = models.CharField(_("channel"), max_length=64)
    chat_id = models.CharField(_("chat id"), max_length=64)
    is_group = models.BooleanField(_("group"), default=False)
    title = models.CharField(_("title"), max_length=200, blank=True, default="")
    account = models.ForeignKey(
        ChannelAccount, on_delete=models.PROTECT, related_name="chats", verbose_name=_("account")
    )
    current_dialog_id = models.CharField(_("current dialog"), max_length=64, blank=True, default="")
    created_at = models.DateTimeField(_("created"), default=timezone.now)

    class Meta:
        verbose_name = _("platform chat")
        verbose_name_plural = _("platform chats")
        constraints = [
            models.UniqueConstraint(fields=["channel", "chat_id"], name="uniq_channel_chat")
        ]

    def __str__(self) -> str:
        return f"{self.channel}:{self.chat_id}"


class ChannelEvent(models.Model):
    """An inbound platform event (Telegram update_id, Feishu event_id): the unique row is the
    durable de-duplication across redeliveries and processes (D5). A process takes the event
    (`claim`, `claimed_at`) before handling it; `done_at` is set in the transaction that
    accepts its work, so a redelivery of an event taken but never accepted (its process died)
    is handled again once the claim is old, and an accepted one never is."""

    id = models.BigAutoField(primary_key=True)
    channel = models.CharField(max_length=64)
    event_id = models.CharField(max_length=128)
    received_at = models.DateTimeField(default=timezone.now, db_index=True)
    claim = models.CharField(max_length=32, blank=True, default="")
    claimed_at = models.DateTimeField(default=timezone.now)
    done_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["channel", "event_id"], name="uniq_channel_event")
        ]

    def __str__(self) -> str:
        return f"{self.channel}:{self.event_id}"


class ChannelDelivery(models.Model):
    """The platform message that streams one turn (D4). Whoever finishes it first claims it
    (`finished_at`), so a turn ends on the platform exactly once, also when the process that
    opened it died and another one closes the interrupted turn."""

    id = models.BigAutoField(primary_key=True)
    turn = models.OneToOneField("Turn", on_delete=models.CASCADE, related_name="channel_delivery")
    channel = models.CharField(max_length=64)
    chat_id = models.CharField(max_length=64)
    message_id = models.CharField(max_length=128)
    target = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        indexes = [
            models.Index(fields=["channel", "chat_id", "message_id"], name="idx_delivery_msg")
        ]

    def __str__(self) -> str:
        return f"{self.channel}:{self.chat_id}:{self.message_id}"
