"""Celery tasks (STYLE 7): thin wrappers that take ids and call engine functions. Each is
idempotent (titles commit only over a default title; compactions only past the newest one),
acknowledged late, time-limited in settings, and retried only for transient failures."""

from __future__ import annotations

import asyncio
import logging

from celery import shared_task
from django.db import DatabaseError

logger = logging.getLogger(__name__)


@shared_task(
    acks_late=True,
    autoretry_for=(DatabaseError,),
    retry_backoff=True,
    max_retries=3,
    # B4: the job retries a failed title itself, after CHAT_TITLE_RETRY_DELAYS (85 s by
    # default) and up to four model calls.
    soft_time_limit=300,
    time_limit=330,
)
def generate_title(session_pk: str, stage: str = "auto") -> str | None:
    from chatcore.engine import jobs

    return asyncio.run(jobs.generate_title(session_pk=session_pk, stage=stage))


@shared_task(
    acks_late=True,
    autoretry_for=(DatabaseError,),
    retry_backoff=True,
    max_retries=3,
    soft_time_limit=90,
    time_limit=120,
)
def compact_session(session_pk: str, manual: bool = False) -> int | None:
    from chatcore.engine import jobs

    return asyncio.run(jobs.compact_session(session_pk=session_pk, manual=manual))


@shared_task(acks_late=True, soft_time_limit=300, time_limit=360)
def purge_deleted_sessions() -> int:
    from audit.trail import audit_purge_expired
    from sessions_app import files, services

    count = services.sessions_purge_expired()
    if count:
        logger.info("purged %d dialogs past retention", count)
    # H5: audit records past CHAT_AUDIT_RETENTION_DAYS go in the same sweep.
    records = audit_purge_expired()
    if records:
        logger.info("purged %d audit records past retention", records)
    # H3: uploads older than a day that no message attached.
    swept = files.files_sweep_unused()
    if swept:
        logger.info("swept %d unused uploads", swept)
    return count


@shared_task(acks_late=True, soft_time_limit=30, time_limit=60)
def evict_idle_session_states() -> None:
    """A6 in scaled mode: every server process drops its idle in-memory dialog state."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    from chatcore.common import publish

    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(publish.engine_control_group(), {"type": "engine.evict"})
