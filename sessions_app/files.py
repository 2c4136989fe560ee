"""Uploaded files (SPEC H3): storing an upload, the owner-only lookup, a send's attachments,
the dialogs that use a file, and deleting what nothing uses any more.

The bytes go through Django's storage API (`default_storage`). An upload is inspected and
stored off the event loop and off the database threads (`file_store_bytes`), then its row
is written (`file_create`). Deleting a row deletes its bytes once the deletion commits
(`_delete_bytes`, connected in `apps.py`), whichever way it was deleted: a purge, the sweep,
the owner deleted.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import IO, Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.files.base import ContentFile
from django.core.files.base import File as DjangoFile
from django.core.files.storage import default_storage
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from chatcore.common.errors import BadRequest, NotFound, TooLarge
from chatcore.common.ids import new_uuid

from .file_kinds import Inspected, inspect
from .file_models import File, FileUse
from .models import Session

logger = logging.getLogger(__name__)

# An upload nothing attached is swept once it is this old.
UNUSED_UPLOAD_AGE = timedelta(days=1)
NAME_MAX = 255


def upload_limit() -> int:
    return int(settings.CHAT["UPLOAD_MAX_BYTES"])


def too_large() -> TooLarge:
    return TooLarge(
        _("The file is too large (at most %(n)s MB).")
        % {"n": f"{upload_limit() / (1024 * 1024):g}"}
    )


@dataclass
class StoredBytes:
    """An upload whose bytes are in storage, and what its row will say."""

    id: Any
    name: str
    size: int
    checksum: str
    storage_key: str
    thumbnail_key: str
    inspected: Inspected

    def discard(self) -> None:
        for key in (self.storage_key, self.thumbnail_key):
            if key:
                default_storage.delete(key)


def _clean_name(name: str) -> str:
    # Only the last path component, without control characters; never empty.
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    base = "".join(ch for ch in base if ch.isprintable()).strip()
    if len(base) > NAME_MAX:
        stem, dot, ext = base.rpartition(".")
        base = (stem[: NAME_MAX - len(ext) - 1] + dot + ext) if dot and len(ext) < 16 else base
        base = base[:NAME_MAX]
    return base or "file"


def file_store_bytes(*, stream: IO[bytes], name: str, size: int) -> StoredBytes:
    """Inspect an upload (H3: its kind from its bytes) and put it in storage. Blocking: run
    it on a worker thread. Refusals raise and store nothing."""
    if size > upload_limit():
        raise too_large()
    if size == 0:
        raise BadRequest(_("The file is empty."))
    clean = _clean_name(name)
    inspected = inspect(stream, name=clean)
    digest = hashlib.sha256()
    stream.seek(0)
    while chunk := stream.read(256 * 1024):
        digest.update(chunk)
    stream.seek(0)
    file_id = new_uuid()
    hexid = file_id.hex
    key = default_storage.save(f"uploads/{hexid[:2]}/{hexid}", DjangoFile(stream))
    thumb = ""
    try:
        if inspected.thumbnail is not None:
            thumb = default_storage.save(
                f"thumbnails/{hexid[:2]}/{hexid}.jpg", ContentFile(inspected.thumbnail)
            )
    except Exception:
        default_storage.delete(key)
        raise
    return StoredBytes(file_id, clean, size, digest.hexdigest(), key, thumb, inspected)


def file_create(*, owner_id: int, stored: StoredBytes) -> File:
    """The row of an upload whose bytes are stored; on a failure the bytes are deleted."""
    found = stored.inspected
    try:
        return File.objects.create(
            id=stored.id,
            owner_id=owner_id,
            name=stored.name,
            size=stored.size,
            content_type=found.content_type,
            kind=str(found.kind),
            checksum=stored.checksum,
            storage_key=stored.storage_key,
            thumbnail_key=stored.thumbnail_key,
            width=found.width,
            height=found.height,
            text=found.text,
        )
    except Exception:
        stored.discard()
        raise


def file_get_for_owner(*, owner_id: int, file_id: str) -> File:
    """The caller's own file; anyone else's, or an unknown id, is not found (H3)."""
    try:
        return File.objects.get(pk=file_id, owner_id=owner_id)
    except (File.DoesNotExist, ValueError, ValidationError):
        # A malformed id fails the UUID field's validation: not found either.
        raise NotFound(_("File not found.")) from None


def attachments_check(raw: object) -> list[str]:
    """A send's `attachments` as given: a list of at most ATTACHMENTS_MAX file ids."""
    if raw is None:
        return []
    limit = int(settings.CHAT["ATTACHMENTS_MAX"])
    if not isinstance(raw, list) or not all(isinstance(i, str) and len(i) <= 64 for i in raw):
        raise BadRequest(_("attachments must be a list of file ids."))
    if len(raw) > limit:
        raise BadRequest(_("At most %(n)d attachments per message.") % {"n": limit})
    return list(dict.fromkeys(raw))


def attachments_resolve(*, owner_id: int, file_ids: Sequence[str]) -> list[dict[str, Any]]:
    """The attachments of a send, as its message will carry them: each id must be one of the
    sender's own files, else the send is refused and nothing is stored. One query."""
    if not file_ids:
        return []
    wanted: list[tuple[str, uuid.UUID | None]] = []
    for file_id in file_ids:
        try:
            wanted.append((file_id, uuid.UUID(file_id)))
        except ValueError:
            wanted.append((file_id, None))
    found = {
        f.pk: f for f in File.objects.filter(owner_id=owner_id, pk__in=[u for _i, u in wanted if u])
    }
    for file_id, parsed in wanted:
        if parsed is None or parsed not in found:
            raise BadRequest(_("Attachment %(id)s is not one of your files.") % {"id": file_id})
    return [found[parsed].as_ref() for _i, parsed in wanted if parsed is not None]


def file_uses_record(*, session_pk: str, refs: Iterable[dict[str, Any]]) -> None:
    """The files a message of the dialog attached, in the transaction that stores it."""
    ids = {str(r["file_id"]) for r in refs if r.get("file_id")}
    if ids:
        FileUse.objects.bulk_create(
            [FileUse(file_id=i, session_id=session_pk) for i in sorted(ids)],
            ignore_conflicts=True,
        )


def session_delete_with_files(*, session_pk: str) -> None:
    """A purge (A7, H3): the dialog with everything it holds, and the files no other dialog
    uses (rows in the same transaction, bytes once it commits)."""
    with transaction.atomic():
        used = list(FileUse.objects.filter(session_id=session_pk).values_list("file_id", flat=True))
        Session.objects.filter(pk=session_pk).delete()
        if used:
            for file in File.objects.filter(pk__in=used, uses__isnull=True):
                file.delete()


def files_sweep_unused(*, now: Any = None) -> int:
    """H3: uploads older than a day that no message attached. Idempotent."""
    cutoff = (now or timezone.now()) - UNUSED_UPLOAD_AGE
    count = 0
    for file in File.objects.filter(created_at__lt=cutoff, uses__isnull=True).iterator():
        file.delete()
        count += 1
    return count


def file_bytes(file: File) -> bytes:
    with default_storage.open(file.storage_key, "rb") as handle:
        return bytes(handle.read())


def delete_bytes_on_commit(sender: Any, instance: File, **kwargs: Any) -> None:
    """`post_delete` of File: its bytes leave storage once the deletion commits."""
    keys = [k for k in (instance.storage_key, instance.thumbnail_key) if k]

    def delete() -> None:
        for key in keys:
            try:
                default_storage.delete(key)
            except Exception:
                logger.exception("could not delete stored file %s", key)

    transaction.on_commit(delete)
