"""Database writes that survive a bad moment: the retry every write of `services` and the
engine's queue runs under (A4), and the reset of a broken connection (G5)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import TypeVar

from django.conf import settings
from django.db import DatabaseError, IntegrityError, close_old_connections, connection
from django.utils.translation import gettext as _

from chatcore.common import events, publish
from chatcore.common.dbthreads import Lane, on_db
from chatcore.common.errors import StorageError

from .models import Session

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Set while `astorage_retry` runs an attempt on a database thread: the `storage_retry` calls
# inside it make one attempt each and leave the waiting to the event loop (A4, G6).
_ATTEMPT_ONLY: ContextVar[bool] = ContextVar("storage_attempt_only", default=False)


def storage_retry(operation: Callable[[], T], *, what: str, session: Session | None = None) -> T:
    """Run a write, retrying database errors after each configured delay (A4).

    When the last attempt fails too, the error is logged, the session's clients get a system
    notification (not stored in history), and `StorageError` is raised so that no caller
    updates its memory as if the write had succeeded.
    """
    if _ATTEMPT_ONLY.get():
        return operation()
    delays = list(settings.CHAT["STORAGE_RETRY_DELAYS_MS"])
    attempt = 0
    while True:
        try:
            return operation()
        except IntegrityError:
            raise
        except DatabaseError as exc:
            if attempt < len(delays):
                logger.warning(
                    "storage write %s failed, retrying: %s",
                    what,
                    exc,
                    extra={"attempt": attempt + 1, "session_id": _sid(session)},
                )
                time.sleep(delays[attempt] / 1000)
                reset_broken_connection()
                attempt += 1
                continue
            logger.error(
                "storage write %s failed after %d attempts: %s",
                what,
                attempt + 1,
                exc,
                extra={"session_id": _sid(session)},
            )
            if session is not None:
                publish.publish_to_chat(session, _failure_notice(session))
            raise StorageError() from exc


async def astorage_retry(
    operation: Callable[[], T],
    *,
    what: str,
    session: Session | None = None,
    lane: Lane | None = None,
) -> T:
    """`storage_retry` for async callers: each attempt runs on the database thread (in
    `lane`'s next trip, if given), and the backoff between attempts waits on the event loop,
    so the thread serves other dialogs meanwhile (a `/stop` or an admission elsewhere is not
    held up by this write's retries). `operation` must be safe to run again after a failed
    attempt (a transaction that rolled back)."""
    delays = list(settings.CHAT["STORAGE_RETRY_DELAYS_MS"])
    attempt = 0
    while True:
        token = _ATTEMPT_ONLY.set(True)
        try:
            return await (lane.run(operation) if lane is not None else on_db(operation)())
        except IntegrityError:
            raise
        except DatabaseError as exc:
            if attempt < len(delays):
                logger.warning(
                    "storage write %s failed, retrying: %s",
                    what,
                    exc,
                    extra={"attempt": attempt + 1, "session_id": _sid(session)},
                )
                await asyncio.sleep(delays[attempt] / 1000)
                await on_db(reset_broken_connection)()
                attempt += 1
                continue
            logger.error(
                "storage write %s failed after %d attempts: %s",
                what,
                attempt + 1,
                exc,
                extra={"session_id": _sid(session)},
            )
            if session is not None:
                await publish.apublish(
                    publish.chat_group(session.channel, session.chat_id),
                    _failure_notice(session),
                )
            raise StorageError() from exc
        finally:
            _ATTEMPT_ONLY.reset(token)


def _failure_notice(session: Session) -> dict[str, object]:
    return events.notification_frame(
        session_id=session.session_id,
        level="error",
        content=_("Saving to the database failed; the last change was not kept."),
    )


def reset_broken_connection() -> None:
    """G5: after a database error, drop this thread's connection if it is broken (the server
    restarted, or an operator ended it), so the next query connects again. Engine calls run
    outside Django's request cycle, which would otherwise do this."""
    if not connection.in_atomic_block:
        close_old_connections()


async def areset_broken_connection() -> None:
    """`reset_broken_connection` from the event loop, on a database thread. An error of its
    own is logged: the caller goes on (G5)."""
    try:
        await on_db(reset_broken_connection)()
    except Exception:
        logger.exception("could not reset the database connection")


def _sid(session: Session | None) -> str | None:
    return session.session_id if session is not None else None
