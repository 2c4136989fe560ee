"""Share links (SPEC H2, PROTOCOL "Search, export, import"): a frozen, read-only snapshot of
a dialog's active path, readable without a login at `/s/{id}`. Kept beside `models.py`, which
imports it, so the app's models stay one registry."""

from __future__ import annotations

import secrets

from django.conf import settings
from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _


def new_share_id() -> str:
    """Unguessable: 192 bits of the OS's randomness, URL-safe (32 characters)."""
    return secrets.token_urlsafe(24)


class Share(models.Model):
    """What the page shows is `title` and `messages` as they were when the link was made:
    later messages, renames and the owner's other data never reach it. Revoking deletes the
    row; purging the dialog deletes it too (cascade); while the dialog is deleted the page
    answers 404."""

    id = models.CharField(primary_key=True, max_length=32, default=new_share_id, editable=False)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="shares",
        verbose_name=_("owner"),
    )
    session = models.ForeignKey(
        "sessions_app.Session",
        on_delete=models.CASCADE,
        related_name="shares",
        verbose_name=_("dialog"),
    )
    title = models.CharField(_("title"), max_length=200)
    # [{role, content, created_at, status?, tool_name?, tool_calls?}], oldest first.
    messages = models.JSONField(_("messages"), default=list)
    created_at = models.DateTimeField(_("created"), default=timezone.now)

    class Meta:
        verbose_name = _("share link")
        verbose_name_plural = _("share links")
        app_label = "sessions_app"
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["owner", "created_at"], name="idx_share_owner")]

    def __str__(self) -> str:
        return f"share {self.id[:6]}… of {self.session_id}"
