"""Background jobs asked for from outside a turn: `/compact`, the admin's actions, the REST
route (B4, B5). They go to this process's engine's scheduler; in scaled mode without an
engine here (a management command) straight to Celery.
"""

from __future__ import annotations

from . import runtime
from .scheduler import CeleryScheduler, NoScheduler, Scheduler


def _scheduler() -> Scheduler:
    from django.conf import settings

    engine = runtime.current_engine()
    if engine is not None:
        return engine.scheduler
    return CeleryScheduler() if settings.SCALED else NoScheduler()


def request_title(*, session_pk: str) -> None:
    """Regenerate a title on request (admin): the job still commits only over a default."""
    _scheduler().schedule("generate_title", session_pk=session_pk)


def request_compaction(*, session_pk: str, manual: bool) -> None:
    _scheduler().schedule("compact_session", session_pk=session_pk, manual=manual)
