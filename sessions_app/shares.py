"""Share links (SPEC H2, PROTOCOL "Search, export, import"): make, list, revoke, and read the
public snapshot. A share freezes the dialog's active path when it is made: the page reads the
snapshot, never the dialog, so later messages and renames do not reach it."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.db import transaction
from django.utils.translation import gettext as _

from audit.trail import Action, Actor, TargetType, audit_record
from chatcore.common.errors import NotFound

from . import branches
from .models import Message, Session, Share
from .storage import storage_retry

# Shown on the page: what the people in the dialog wrote, and the tools' names (not the
# system's notes, such as the welcome message).
SHARED_ROLES = ("user", "assistant", "tool")


def share_url(share_id: str) -> str:
    return f"/s/{share_id}"


def share_item(share: Share, session: Session | None = None) -> dict[str, Any]:
    dialog = session or share.session
    return {
        "share_id": share.id,
        "session_id": dialog.session_id,
        "title": share.title,
        "url": share_url(share.id),
        "created_at": share.created_at.isoformat(),
    }


def _snapshot_message(message: Message) -> dict[str, Any]:
    item: dict[str, Any] = {
        "role": message.role,
        "content": message.content,
        "created_at": message.created_at.isoformat(),
    }
    if message.status:
        item["status"] = message.status
    if message.tool_name:
        item["tool_name"] = message.tool_name
    if message.tool_calls:
        item["tool_calls"] = [
            str((call.get("function") or {}).get("name") or call.get("name") or "tool")
            for call in message.tool_calls
            if isinstance(call, dict)
        ]
    return item


def share_create(*, owner: User, session: Session, actor: Actor | None = None) -> Share:
    """Freeze the active path of the caller's dialog (found through the owner-scoped
    selectors) into a new share, with its audit record (H5; `actor` None: the owner)."""

    def write() -> Share:
        with transaction.atomic():
            messages = Message.objects.filter(
                session_id=session.pk, role__in=SHARED_ROLES
            ).order_by("seq")
            path = branches.active_path(session)  # H1: a forked dialog's shown branch only
            on_path = set(path) if path is not None else None
            snapshot = [
                _snapshot_message(m)
                for m in messages.iterator(chunk_size=500)
                if on_path is None or m.seq in on_path
            ]
            share = Share.objects.create(
                owner=owner, session=session, title=session.title, messages=snapshot
            )
            _audit(actor or Actor.of_user(owner), Action.SHARE_CREATE, share, session)
            return share

    return storage_retry(write, what="share_create")


def share_list_for_owner(*, owner_id: int) -> list[dict[str, Any]]:
    shares = Share.objects.filter(owner_id=owner_id).select_related("session").defer("messages")
    return [share_item(s) for s in shares.order_by("-created_at")]


def share_revoke(*, owner_id: int, share_id: str, actor: Actor) -> Share:
    """Delete the caller's share (another user's is not found); the page then answers 404."""
    share = (
        Share.objects.filter(pk=share_id, owner_id=owner_id)
        .select_related("session")
        .defer("messages")
        .first()
    )
    if share is None:
        raise NotFound(_("Share link not found."))
    share_delete(share=share, actor=actor)
    return share


def share_delete(*, share: Share, actor: Actor) -> None:
    """Revoke a share (its owner, or an operator in the admin), with its audit record."""

    def write() -> None:
        with transaction.atomic():
            if Share.objects.filter(pk=share.pk).delete()[0]:
                _audit(actor, Action.SHARE_REVOKE, share, share.session)

    storage_retry(write, what="share_revoke")


def _audit(actor: Actor, action: Action, share: Share, session: Session) -> None:
    audit_record(
        actor=actor,
        action=action,
        target_type=TargetType.SHARE,
        target_id=str(share.pk),
        details={"session_id": session.session_id, "owner_id": share.owner_id},
    )


def share_get_public(*, share_id: str) -> Share:
    """The snapshot behind a link, while the link stands and its dialog is not deleted."""
    share = (
        Share.objects.filter(pk=share_id, session__deleted_at__isnull=True)
        .only("id", "title", "messages", "created_at")
        .first()
    )
    if share is None:
        raise NotFound(_("Share link not found."))
    return share
