"""The audit record (SPEC H5, PROTOCOL "Audit"): append-only. Rows are only ever inserted by
`audit.trail.audit_record` and removed by the retention purge; `save()` of an existing row,
`delete()` and queryset updates are refused, so no code path can rewrite the trail."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from django.conf import settings
from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

SYSTEM = "system"


class Action(models.TextChoices):
    """The fixed vocabulary. Actions of features that record through `audit_record` from
    their own branches (shares, imports, dialog settings, files) are listed here too, so the
    admin's filter and `manage.py audit --action` know them."""

    DIALOG_RENAME = "dialog.rename", _("dialog renamed")
    DIALOG_DELETE = "dialog.delete", _("dialog deleted")
    DIALOG_RESTORE = "dialog.restore", _("dialog restored")
    DIALOG_PURGE = "dialog.purge", _("dialog purged")
    DIALOG_IMPORT = "dialog.import", _("dialog imported")
    DIALOG_SETTINGS = "dialog.settings", _("dialog settings changed")
    DIALOG_COMPACT = "dialog.compact", _("dialog compaction started")
    SHARE_CREATE = "share.create", _("share link made")
    SHARE_REVOKE = "share.revoke", _("share link revoked")
    FILE_DELETE = "file.delete", _("file deleted")
    TOKEN_ISSUE = "token.issue", _("API token issued")
    TOKEN_REVOKE = "token.revoke", _("API token revoked")
    CHAT_ACCOUNT_LINK = "chat_account.link", _("chat account linked")
    CHAT_ACCOUNT_UNLINK = "chat_account.unlink", _("chat account unlinked")
    USER_CHANGE = "user.change", _("user changed")
    USER_DELETE = "user.delete", _("user deleted")
    MEMORY_NOTE_CHANGE = "memory_note.change", _("memory note changed")
    ADMIN_VIEW_DIALOG = "admin.view_dialog", _("operator opened a dialog")


class TargetType(models.TextChoices):
    DIALOG = "dialog", _("dialog")
    SHARE = "share", _("share link")
    FILE = "file", _("file")
    TOKEN = "token", _("API token")
    CHAT_ACCOUNT = "chat_account", _("chat account")
    USER = "user", _("user")
    MEMORY_NOTE = "memory_note", _("memory note")


class AppendOnly(Exception):
    """Raised by any attempt to change or delete an audit record."""


class AuditEventQuerySet(models.QuerySet["AuditEvent"]):
    def update(self, **kwargs: Any) -> int:
        raise AppendOnly("audit records are never changed")

    def delete(self) -> tuple[int, dict[str, int]]:
        raise AppendOnly("audit records are removed only by the retention purge")

    def purge_older_than(self, cutoff: datetime) -> int:
        """H5: the retention purge, the one way records leave the trail."""
        deleted, _ = models.QuerySet.delete(self.filter(at__lt=cutoff))
        return deleted


class AuditEvent(models.Model):
    id = models.BigAutoField(primary_key=True)
    at = models.DateTimeField(_("time"), default=timezone.now, db_index=True)
    # The username (or `system`) as it was: it stays readable after the user is deleted.
    actor = models.CharField(_("actor"), max_length=150)
    # No constraint and no cascade: deleting a user leaves its records as they are.
    actor_user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        verbose_name=_("actor's user"),
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="+",
    )
    action = models.CharField(_("action"), max_length=32, choices=Action.choices)
    target_type = models.CharField(_("target type"), max_length=16, choices=TargetType.choices)
    target_id = models.CharField(_("target id"), max_length=64)
    details = models.JSONField(_("details"), default=dict, blank=True)
    ip = models.GenericIPAddressField(_("IP address"), null=True, blank=True)

    objects: ClassVar[AuditEventQuerySet] = AuditEventQuerySet.as_manager()  # type: ignore[assignment]

    class Meta:
        verbose_name = _("audit event")
        verbose_name_plural = _("audit events")
        ordering = ["-at", "-id"]
        indexes = [
            models.Index(fields=["target_type", "target_id"], name="idx_audit_target"),
            models.Index(fields=["action", "at"], name="idx_audit_action"),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target_id}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            raise AppendOnly("audit records are never changed")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise AppendOnly("audit records are removed only by the retention purge")
