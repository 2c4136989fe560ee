"""A dialog's lifecycle (SPEC A7): a soft delete hides it at once, a restore brings it back,
a purge removes it with its messages and the files only it used (H3) once the retention
period is over. Every step is audited (H5) and told to the chat's clients."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from django.utils.translation import gettext as _

from audit.trail import Action, Actor, audit_dialog
from chatcore.common import events, publish
from chatcore.common.errors import BadRequest, NotFound

from .files import session_delete_with_files
from .models import Session, Turn, TurnStatus
from .storage import storage_retry


def session_soft_delete(*, session: Session, actor: Actor | None = None) -> Session:
    """Hide a dialog at once (A7). Queued sends end as cancelled (stale); a running turn sees
    the state change and commits nothing (C9)."""

    def write() -> list[Turn]:
        with transaction.atomic():
            now = timezone.now()
            updated = Session.objects.filter(pk=session.pk, deleted_at__isnull=True).update(
                deleted_at=now,
                state_version=F("state_version") + 1,
                generation=F("generation") + 1,
            )
            if not updated:
                raise NotFound(_("Dialog not found."))
            audit_dialog(
                actor=actor, action=Action.DIALOG_DELETE, session=session, title=session.title
            )
            queued = list(Turn.objects.filter(session=session, status=TurnStatus.QUEUED))
            Turn.objects.filter(pk__in=[t.pk for t in queued]).update(
                status=TurnStatus.CANCELLED, reason="stale", finished_at=now
            )
            Turn.objects.filter(session=session, status=TurnStatus.RUNNING).update(
                cancel_requested=True
            )
            return queued

    dropped = storage_retry(write, what="session_soft_delete", session=session)
    session.refresh_from_db()
    for turn in dropped:
        publish.publish_to_chat(
            session,
            events.turn_updated_frame(
                session_id=session.session_id,
                turn_id=str(turn.pk),
                status=TurnStatus.CANCELLED,
                reason="stale",
                client_msg_id=turn.client_msg_id,
            ),
        )
    publish.publish_to_chat(
        session, events.sessions_changed_frame(session_id=session.session_id, change="deleted")
    )
    return session


def session_restore(*, session: Session, actor: Actor | None = None) -> Session:
    """Bring back a soft-deleted dialog unless a live one has taken its id (A7)."""
    if session.deleted_at is None:
        return session
    if Session.objects.filter(
        channel=session.channel,
        chat_id=session.chat_id,
        dialog_id=session.dialog_id,
        deleted_at__isnull=True,
    ).exists():
        raise BadRequest(
            _("A live dialog %(id)s exists; rename or delete it first.") % {"id": session.dialog_id}
        )

    def write() -> None:
        with transaction.atomic():
            Session.objects.filter(pk=session.pk).update(
                deleted_at=None,
                state_version=F("state_version") + 1,
                generation=F("generation") + 1,
                last_active_at=timezone.now(),
            )
            audit_dialog(
                actor=actor, action=Action.DIALOG_RESTORE, session=session, title=session.title
            )

    storage_retry(write, what="session_restore", session=session)
    session.refresh_from_db()
    publish.publish_to_chat(
        session, events.sessions_changed_frame(session_id=session.session_id, change="restored")
    )
    return session


def session_purge(*, session: Session, actor: Actor | None = None) -> None:
    """Physical delete with cascade (A7), and the files only it used (H3)."""
    _purge_one(session.pk, actor or Actor.system())


def sessions_purge_expired(*, now: datetime | None = None) -> int:
    """Purge dialogs soft-deleted longer than the retention period (A7). Idempotent."""
    now = now or timezone.now()
    cutoff = now - timedelta(days=settings.CHAT["RETENTION_DAYS"])
    count = 0
    for pk in list(Session.objects.filter(deleted_at__lt=cutoff).values_list("pk", flat=True)):
        _purge_one(pk, Actor.system(via="sweep"))
        count += 1
    return count


def _purge_one(pk: str, actor: Actor) -> None:
    def write() -> None:
        with transaction.atomic():
            # H5: the record names the dialog as it was; nothing is recorded if it is gone.
            gone = Session.objects.select_for_update().filter(pk=pk).first()
            if gone is not None:
                session_delete_with_files(session_pk=pk)  # H3: and the files only it used
                audit_dialog(
                    actor=actor, action=Action.DIALOG_PURGE, session=gone, title=gone.title
                )

    storage_retry(write, what="purge")
