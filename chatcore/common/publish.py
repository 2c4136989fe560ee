"""The only place that sends events to clients (STYLE 3, 4).

It owns the group names and the send functions; the frame shapes are in `events`. Two groups
matter:
- the chat group: every connection of a chat hears history deltas, terminals,
  `session_updated`, `sessions_changed` and notifications of every dialog (D2, D3);
- the session group: connections whose current dialog it is hear its snapshots (D1).
Events travel on the channel layer as `{"type": "chat.event", "frame": {...}}`, or several for
one group as `{"type": "chat.event", "frames": [...]}` (a turn's end: its answer's delta and
its terminal, one publish); consumers and SSE streams relay each frame as it is, in order
(`unfold`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Protocol

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

logger = logging.getLogger(__name__)

EVENT_TYPE = "chat.event"

# A task runner: (name, coroutine) -> a task owned by a supervisor (the engine's).
Spawn = Callable[[str, Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]

_loop_lock = threading.Lock()
_engine_loop: asyncio.AbstractEventLoop | None = None
_spawn: Spawn | None = None


@functools.lru_cache(maxsize=65536)
def chat_group(channel: str, chat_id: str) -> str:
    """A chat's group name (one string per chat, shared by the sockets that join it)."""
    digest = hashlib.sha1(f"{channel}:{chat_id}".encode(), usedforsecurity=False).hexdigest()
    return f"chat.{digest[:32]}"


def session_group(session_pk: str) -> str:
    return f"sess.{session_pk}"


def engine_control_group() -> str:
    return "engine.control"


# --- Joining and hearing groups ---------------------------------------------------------------


class GroupListener(Protocol):
    """Told by the process's channel layer of every message a group gets here (`heard`: one
    sent from this process; the embedded layer), or of every message a channel of this
    process takes (`heard_on`: its group's, another process's too; the Redis layer), and
    when messages may have been lost (`lost`: the layer watch): what the per-process caches
    of the connections' state (`engine.lists`) are dropped by."""

    def heard(self, group: str) -> None: ...

    def heard_on(self, channel: str) -> None: ...

    def lost(self) -> None: ...


def listen(layer: Any, listener: GroupListener) -> bool:
    """Have `layer` tell `listener` of its groups' messages; False when it cannot (a layer
    other than the project's own: then nothing may be cached on its word)."""
    add = getattr(layer, "add_group_listener", None)
    if add is None:
        return False
    add(listener)
    return True


async def join(layer: Any, groups: Iterable[str], channel: str) -> None:
    """`channel` joins every group of `groups`: in one call on a layer that can
    (`group_add_many`: the embedded one, a socket's login, chat and dialog groups at one
    join time), one by one on any other."""
    many = getattr(layer, "group_add_many", None)
    if many is not None:
        await many(list(groups), channel)
        return
    for group in groups:
        await layer.group_add(group, channel)


async def leave(layer: Any, groups: Iterable[str], channel: str) -> None:
    """`channel` leaves every group of `groups` (as `join`)."""
    many = getattr(layer, "group_discard_many", None)
    if many is not None:
        await many(list(groups), channel)
        return
    for group in groups:
        await layer.group_discard(group, channel)


def bind_loop(loop: asyncio.AbstractEventLoop | None, spawn: Spawn | None = None) -> None:
    """Tell sync callers which loop owns the channel layer in this process, and who owns the
    tasks a publish from sync code on that loop starts (the engine's supervisor, F1)."""
    global _engine_loop, _spawn
    with _loop_lock:
        # Binding the same loop again without a runner keeps the engine's runner.
        if spawn is not None or loop is not _engine_loop:
            _spawn = spawn
        _engine_loop = loop


# --- Sending ------------------------------------------------------------------------------


# Publishes the channel layer refused since the process started (shown on `/healthz`).
_failed = 0


def failed_publishes() -> int:
    return _failed


async def apublish(group: str, frame: dict[str, Any]) -> None:
    await _group_send(group, {"type": EVENT_TYPE, "frame": frame})


async def apublish_all(group: str, frames: list[dict[str, Any]]) -> None:
    """Several frames for one group as one message on the layer: one publish, received
    together and relayed in this order (`unfold`)."""
    if len(frames) == 1:
        await apublish(group, frames[0])
    elif frames:
        await _group_send(group, {"type": EVENT_TYPE, "frames": frames})


async def _group_send(group: str, message: dict[str, Any]) -> None:
    global _failed
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        await layer.group_send(group, message)
    except Exception:
        # C3: a failing listener never fails the turn; the failure is logged and counted.
        _failed += 1
        logger.exception("publish to %s failed", group)


def unfold(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A received layer message as messages of one frame each, in order (`apublish_all`);
    any other message as it is."""
    frames = message.get("frames")
    if message.get("type") != EVENT_TYPE or not isinstance(frames, list):
        return [message]
    return [{"type": EVENT_TYPE, "frame": frame} for frame in frames]


def publish(group: str, frame: dict[str, Any]) -> None:
    """Send from sync code: hand over to the engine loop when there is one, else run here."""
    loop = _engine_loop
    if loop is not None and loop.is_running():
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            # Sync code on the engine's loop cannot wait: the send runs as a task of the
            # engine's supervisor, reaped at shutdown, never an unowned one (F1).
            _spawn_send(loop, group, frame)
            return
        future = asyncio.run_coroutine_threadsafe(apublish(group, frame), loop)
        try:
            future.result(timeout=5)
        except Exception:
            logger.warning("publish to %s timed out", group)
        return
    async_to_sync(apublish)(group, frame)


def _spawn_send(loop: asyncio.AbstractEventLoop, group: str, frame: dict[str, Any]) -> None:
    spawn = _spawn
    if spawn is not None:
        try:
            spawn(f"publish:{frame.get('type')}", apublish(group, frame))
            return
        except Exception:
            # The supervisor is closing (shutdown): still send, tracked until done.
            logger.info("publish during shutdown of the supervisor")
    task = loop.create_task(apublish(group, frame), name=f"publish:{frame.get('type')}")
    _unsupervised.add(task)
    task.add_done_callback(_unsupervised.discard)


# Sends started while no supervisor takes tasks (before the engine starts, during its
# shutdown): strong references until done, so none is collected mid-send.
_unsupervised: set[asyncio.Task[Any]] = set()


def publish_to_chat(session: Any, frame: dict[str, Any]) -> None:
    publish(chat_group(session.channel, session.chat_id), frame)


def publish_to_session(session_pk: str, frame: dict[str, Any]) -> None:
    publish(session_group(session_pk), frame)
