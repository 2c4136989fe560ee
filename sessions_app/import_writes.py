"""Writing an imported dialog (SPEC H2): a document `importer` has read and checked whole is
written in one transaction as a new dialog of the caller's web chat, every branch with its head
(H1), only the importer's own files attached (H3), with its audit record (H5)."""

from __future__ import annotations

import uuid

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from audit.trail import Action, Actor, audit_dialog
from chatcore.common import events, publish
from chatcore.common.ids import SessionKey, owner_chat_id

from . import branches
from .files import file_uses_record
from .importer import ImportedDialog, ImportedMessage
from .models import File, Message, Session, TitleSource
from .services import USER_KINDS, new_dialog_id
from .storage import storage_retry

WRITE_BATCH = 1000


def dialog_import(
    *, owner: User, dialog: ImportedDialog, announce: bool = True, actor: Actor | None = None
) -> Session:
    """Write a checked dialog as a new dialog of `owner`'s web chat, in one transaction, with
    its audit record (H5; `actor` None: the owner)."""
    now = timezone.now()
    key = SessionKey.build("web", owner_chat_id(owner.pk), new_dialog_id())

    def write() -> Session:
        with transaction.atomic():
            session = Session(
                owner=owner,
                channel=key.channel,
                chat_id=key.chat_id,
                dialog_id=key.dialog_id,
                created_at=dialog.created_at or now,
                last_active_at=now,
            )
            session.title = dialog.title or session.default_title
            session.title_source = TitleSource.USER if dialog.title else TitleSource.DEFAULT
            # H1: every branch, each message after its parent (so a parent's seq is always
            # the smaller), the head as the document's; the forks kept on the row.
            path = dialog.messages
            n = len(path)
            session.last_seq = n
            session.head_seq = dialog.head + 1 if dialog.head is not None else 0
            kids: dict[int | None, list[int]] = {}
            for seq, m in enumerate(path, start=1):
                kids.setdefault(m.parent + 1 if m.parent is not None else None, []).append(seq)
            session.forks = {
                branches.fork_key(parent): seqs for parent, seqs in kids.items() if len(seqs) > 1
            }
            session.forked = bool(session.forks)
            session.total_message_count = n
            session.message_count = sum(1 for m in path if m.kind in USER_KINDS)
            session.state_version = 1
            session.save(force_insert=True)
            rows = (
                Message(
                    session=session,
                    seq=seq,
                    parent_seq=m.parent + 1 if m.parent is not None else None,
                    role=m.role,
                    content=m.content,
                    created_at=m.created_at or now,
                    tool_calls=m.tool_calls,
                    tool_call_id=m.tool_call_id,
                    tool_name=m.tool_name,
                    media_refs=m.media_refs,
                    source={"kind": m.kind, "imported": True},
                    status=m.status,
                )
                for seq, m in enumerate(path, start=1)
            )
            _own_attachments(owner, path)
            batch: list[Message] = []
            for row in rows:
                batch.append(row)
                if len(batch) >= WRITE_BATCH:
                    Message.objects.bulk_create(batch)
                    batch = []
            if batch:
                Message.objects.bulk_create(batch)
            file_uses_record(
                session_pk=session.pk, refs=[ref for m in path for ref in m.media_refs]
            )
            audit_dialog(
                actor=actor or Actor.of_user(owner),
                action=Action.DIALOG_IMPORT,
                session=session,
                messages=n,
            )
            if announce:
                transaction.on_commit(lambda: _announce(session))
            return session

    return storage_retry(write, what="dialog_import")


def _own_attachments(owner: User, messages: list[ImportedMessage]) -> None:
    """H3: an attachment comes along only when it is one of the importer's own files here
    (another user's file, or one of another server, is left out): a model would otherwise be
    sent a file its owner never showed this user."""
    ids = {str(ref["file_id"]) for m in messages for ref in m.media_refs}
    if not ids:
        return
    valid = set()
    for value in ids:
        try:
            valid.add(uuid.UUID(value))
        except ValueError:
            continue
    own = {
        str(pk)
        for pk in File.objects.filter(owner=owner, pk__in=valid).values_list("pk", flat=True)
    }
    own |= {pk.replace("-", "") for pk in own}
    for m in messages:
        m.media_refs = [ref for ref in m.media_refs if str(ref["file_id"]) in own]


def _announce(session: Session) -> None:
    publish.publish_to_chat(
        session, events.sessions_changed_frame(session_id=session.session_id, change="created")
    )
