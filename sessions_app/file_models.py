"""Uploaded files and the dialogs that use them (SPEC H3, PROTOCOL "Files and images").

The bytes live in Django's storage (`default_storage`), under `storage_key`; a row never
changes once made. `FileUse` links a file to each dialog a message attached it in, so a
purged dialog deletes the files only it used and an upload nothing uses is swept.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from chatcore.common.ids import new_uuid


class FileKind(models.TextChoices):
    IMAGE = "image", _("image")
    TEXT = "text", _("text")
    DOCUMENT = "document", _("document")


class File(models.Model):
    id = models.UUIDField(primary_key=True, default=new_uuid, editable=False)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="chat_files",
        verbose_name=_("owner"),
    )
    name = models.CharField(_("name"), max_length=255)
    size = models.BigIntegerField(_("size"))
    content_type = models.CharField(_("content type"), max_length=100)
    kind = models.CharField(_("kind"), max_length=16, choices=FileKind.choices)
    # SHA-256 of the bytes, hex.
    checksum = models.CharField(_("checksum"), max_length=64)
    storage_key = models.CharField(_("storage key"), max_length=255)
    thumbnail_key = models.CharField(_("thumbnail key"), max_length=255, blank=True, default="")
    width = models.IntegerField(_("width"), null=True, blank=True)
    height = models.IntegerField(_("height"), null=True, blank=True)
    # What the model is given of a text or PDF file (H3): decoded or extracted once.
    text = models.TextField(_("text"), blank=True, default="")
    created_at = models.DateTimeField(_("created"), default=timezone.now)

    class Meta:
        verbose_name = _("file")
        verbose_name_plural = _("files")
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["owner", "created_at"], name="idx_file_owner"),
            # The sweep of old uploads nothing uses.
            models.Index(fields=["created_at"], name="idx_file_created"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.kind}, {self.size} B)"

    def as_ref(self) -> dict[str, object]:
        """How a message carries it (PROTOCOL: `attachments` items)."""
        return {
            "file_id": str(self.id),
            "name": self.name,
            "size": self.size,
            "content_type": self.content_type,
            "kind": self.kind,
        }


class FileUse(models.Model):
    """A dialog in which a message attached the file."""

    id = models.BigAutoField(primary_key=True)
    file = models.ForeignKey(
        File, on_delete=models.CASCADE, related_name="uses", verbose_name=_("file")
    )
    session = models.ForeignKey(
        "sessions_app.Session",
        on_delete=models.CASCADE,
        related_name="file_uses",
        verbose_name=_("dialog"),
    )
    created_at = models.DateTimeField(_("created"), default=timezone.now)

    class Meta:
        verbose_name = _("file use")
        verbose_name_plural = _("file uses")
        constraints = [
            models.UniqueConstraint(fields=["file", "session"], name="uniq_file_use"),
        ]

    def __str__(self) -> str:
        return f"{self.file_id} in {self.session_id}"
