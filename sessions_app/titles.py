"""Automatic titles as stored (SPEC B4): the writes of the title job (`chatcore.engine.jobs`).

A machine's title never replaces a person's: it commits only over the default title, or, for
the seed's title at the threshold (`auto`), over the first title made after the first answer.
Failed attempts are counted on the dialog, so a title is retried a bounded number of times.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import F

from chatcore.common import events, publish

from .models import Session, TitleSource
from .services import clean_title
from .storage import storage_retry


def title_commit_if_default(
    *, session_pk: str, title: str, source: str = TitleSource.AUTO
) -> Session | None:
    """Commit an automatic title only over the default one, or, for the threshold's title
    (`auto`), over the first title too, and only while the dialog exists (B4): a person's
    rename always wins, also against a late result."""
    clean = clean_title(title)
    replaces = [TitleSource.DEFAULT]
    if source != TitleSource.FIRST:
        replaces.append(TitleSource.FIRST)

    def write() -> int:
        with transaction.atomic():
            return Session.objects.filter(
                pk=session_pk, title_source__in=replaces, deleted_at__isnull=True
            ).update(
                title=clean,
                title_source=source,
                title_attempts=0,
                state_version=F("state_version") + 1,
            )

    if not storage_retry(write, what="title_commit"):
        return None
    session = Session.objects.get(pk=session_pk)
    publish.publish_to_chat(session, events.session_updated_frame(session=session))
    return session


def title_attempt_failed(*, session_pk: str) -> int:
    """B4: count a failed title attempt; returns how many failed since the last title."""
    Session.objects.filter(pk=session_pk).update(title_attempts=F("title_attempts") + 1)
    found = Session.objects.filter(pk=session_pk).values_list("title_attempts", flat=True)
    return int(found.first() or 0)
