"""Deleting a dialog (SPEC A7, C9): the one path for every caller.

The REST `DELETE /sessions/{id}`, the `/delete` command and the operators' admin all call
`delete_dialog`, so a delete always ends the running turn as stale, drops the queued sends,
hides the dialog at once and tells the chat's clients, whichever door it came through.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from channels.layers import get_channel_layer

from audit.trail import Actor
from chatcore.common import publish
from chatcore.common.dbthreads import on_db
from sessions_app import selectors, services
from sessions_app.models import Session

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger(__name__)


async def delete_dialog(*, engine: Engine | None, session: Session, by: Actor) -> None:
    """Cancel the running turn (it finds itself stale and commits nothing, C9), drop the
    queued turns (cancelled, `stale`), soft-delete the dialog (A7) and publish all of it.

    `engine` is this process's engine when the caller runs in its loop (a channel); without
    one (an operator's admin request), the cancel reaches whichever engine runs the turn
    through the engines' control group. `by` is who deleted it, recorded in the same
    transaction as the delete (H5)."""
    running = await on_db(selectors.turn_running)(session_pk=session.pk)
    # The soft delete flags the running turn in its own transaction (C9), before the turn is
    # woken: whenever it commits, it finds itself stale and writes nothing ...
    await on_db(services.session_soft_delete)(session=session, actor=by)
    if running is not None:
        # ... and this wakes it wherever it runs, rather than at its next checkpoint.
        if engine is not None:
            await engine.signal_cancel(str(running.pk))
        else:
            await _signal_cancel(str(running.pk))
    logger.info(
        "dialog deleted",
        extra={"session_id": session.session_id, "by": by.name},
    )


async def _signal_cancel(turn_id: str) -> None:
    layer = get_channel_layer()
    if layer is not None:
        await layer.group_send(
            publish.engine_control_group(), {"type": "engine.cancel", "turn_id": turn_id}
        )
