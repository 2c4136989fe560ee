"""A running turn as this process holds it (`LocalTurn`), its snapshots to clients (D1) and
its checkpoints to the turn record (C11).

Snapshots are coalesced to at most SNAPSHOT_FPS frames a second and carry only the new tail
of the text, so bytes grow with the answer; checkpoints write the partial text at most every
CHECKPOINT_SECONDS, never per token, and pick up a stop requested from another process: one
pass, one transaction, for all the turns of the process (`checkpoint_loop`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError

from chatcore.common import events, publish
from chatcore.common.dbthreads import on_db
from sessions_app.models import Session

from . import recovery
from .delivery import DeliveryHandle
from .lease import Lease
from .turns.runner import TurnSnapshot

logger = logging.getLogger(__name__)


@dataclass
class LocalTurn:
    turn_id: str
    session: Session
    snapshot: TurnSnapshot
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    frame: int = 0
    published_offset: int = 0
    published_version: int = 0
    delivery: DeliveryHandle | None = None
    ended: bool = False
    lease: Lease | None = None
    # C11: the partial text as of this turn's last successful checkpoint.
    checkpointed: str = ""
    # A snapshot publish is under way (the turn's end lets it land rather than cancel it).
    publishing: bool = False
    # The turn's snapshots winding down after its end (the publish under way landing, then
    # the final flush): it runs beside the commit, and the terminal waits for it (D1).
    drained: asyncio.Task[None] | None = None
    # The publish of the `history_delta` of the turn's user message, which goes out before
    # the turn's first snapshot.
    announced: asyncio.Task[None] | None = None

    @property
    def may_speak(self) -> bool:
        """G2: frames that are not database writes (snapshots) go out only while the lease
        is confirmed recently enough; a thawed process stays quiet until it knows."""
        return self.lease is None or self.lease.trusted


def snapshot_frame(local: LocalTurn, *, full: bool) -> dict[str, Any]:
    """A `turn_snapshot` frame: the whole text (`full`, for a client joining mid-turn) or the
    tail after the last frame sent to the session group."""
    snap = local.snapshot
    text = snap.text
    offset = 0 if full else min(local.published_offset, len(text))
    local.frame += 1
    return events.turn_snapshot_frame(
        session_id=local.session.session_id,
        turn_id=local.turn_id,
        text=text[offset:],
        tools=snap.tools_dicts(),
        frame=local.frame,
        text_offset=offset,
    )


async def publish_snapshots(
    local: LocalTurn,
    *,
    fps: int,
    spawn: Callable[[str, Coroutine[Any, Any, Any]], asyncio.Task[Any]],
) -> None:
    """Coalesce to at most `fps` frames a second, each with the new tail of the text; an
    external sink gets the text through its own task (`DeliveryHandle.push`, D4)."""
    interval = 1.0 / max(1, fps)
    snap = local.snapshot
    # Made by the worker before its runner started (a first token may be read at once); a
    # publisher started on its own makes one.
    first_sent = snap.first_sent = snap.first_sent or asyncio.Event()
    while not local.ended:
        await snap.changed.wait()
        snap.changed.clear()
        if local.ended:
            return
        if snap.version == local.published_version or not local.may_speak:
            first_sent.set()  # nothing goes out now: the runner does not wait for it
            continue
        await send_snapshot(local)
        first_sent.set()
        if local.delivery is not None:
            local.delivery.push(snap.text, spawn=spawn)
        if local.ended:
            return
        await asyncio.sleep(interval)


async def send_snapshot(local: LocalTurn) -> None:
    """Send the tail since the last frame that was sent. It counts as sent only once the
    layer took it: the turn's end lets a publish under way land (`publishing`), and one
    cancelled anyway (stuck) is sent again by the final flush, so the last tokens always
    reach clients before `turn_updated`, and no tail twice (D1)."""
    if local.announced is not None and not local.announced.done():
        # The question reaches the clients before the first piece of its answer.
        await asyncio.wait([local.announced])
    version = local.snapshot.version
    frame = snapshot_frame(local, full=False)
    local.publishing = True
    try:
        await publish.apublish(publish.session_group(local.session.pk), frame)
    finally:
        local.publishing = False
    local.published_version = version
    local.published_offset = frame["text_offset"] + len(frame["text"])


async def flush_snapshot(local: LocalTurn) -> None:
    """One last frame before the terminal when the coalescer held back a change (or its last
    publish was cancelled before the layer took it)."""
    if local.snapshot.version != local.published_version and local.may_speak:
        await send_snapshot(local)


async def checkpoint_loop(
    turns: Mapping[str, LocalTurn],
    *,
    interval: float,
    reset_db: Callable[[], Awaitable[None]],
) -> None:
    """C11: every `interval` seconds, one checkpoint pass for all the turns this process runs
    (`turns`, by turn id): a single task per process, not one per turn."""
    while True:
        await asyncio.sleep(interval)
        await checkpoint_pass(list(turns.values()), reset_db=reset_db)


async def checkpoint_pass(
    turns: list[LocalTurn], *, reset_db: Callable[[], Awaitable[None]]
) -> None:
    """One transaction for all running turns (`recovery.checkpoint_all`): the partial text of
    each turn whose text changed since its last checkpoint goes to its turn record (never to
    messages, never per token); a turn whose lease was taken over writes nothing and is
    cancelled (G2); a stop requested from elsewhere reaches its turn (C6 fallback). A
    database error is logged and the pass is tried again at the next beat (G5)."""
    running = [local for local in turns if not local.ended]
    if not running:
        return
    items = []
    for local in running:
        text = local.snapshot.text
        changed = None if text == local.checkpointed else text
        items.append((local, text, recovery.Checkpoint(local.turn_id, changed, local.lease)))
    try:
        found = await on_db(recovery.checkpoint_all)([item for _l, _t, item in items])
    except DatabaseError:
        # G5: try again at the next beat on a fresh connection.
        logger.warning("checkpoint failed", extra={"turns": len(items)})
        await reset_db()
        return
    for local, text, _item in items:
        if local.turn_id in found.lost:
            logger.error("lost the lease during a turn", extra={"turn_id": local.turn_id})
            local.cancel.set()
            continue
        local.checkpointed = text
        if local.turn_id in found.cancel:
            local.cancel.set()
