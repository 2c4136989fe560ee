"""Delivery of turns to external channel sinks (D4): a streaming message on a chat platform.

A `ChannelSink` opens a streaming message, updates it with the answer so far and finishes it
with the terminal. The `DeliveryCoordinator` makes that observable and bounded:

- a sink that fails to open means the terminal goes out as one plain message from the start;
- a failing terminal update is retried within bounds; if it still fails, one plain message
  falls back, exactly once, and the error is logged; a transient failure followed by success
  sends none;
- a sink never reports "target not found" as success (it raises `TargetNotFound`);
- a cancelled or failed turn never re-sends an answer body: only a short partial/failure note,
  and only when a partial exists and the sink failed;
- a persistence failure never sends the text from before the failure as a completed answer;
- cancel and shutdown never produce two terminals: `finish` runs once per handle;
- terminals go out off the turn's path (`finish_later`): the worker takes the dialog's next
  turn while a slow or broken sink is still being retried, and the terminals of one chat
  still go out in the order of its turns.

Sinks are configured per channel in `CHAT["SINKS"]` (`{"channel": "dotted.path.Factory"}`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, Protocol

from django.conf import settings
from django.utils.translation import gettext as _

logger = logging.getLogger(__name__)


class DeliveryError(Exception):
    """A sink could not deliver."""


class TargetNotFound(DeliveryError):
    """The platform message or chat to deliver to does not exist."""


@dataclass(frozen=True)
class Terminal:
    """What the sink's last update says about the turn."""

    status: str  # completed | cancelled | failed
    text: str  # the committed answer for completed; the partial for cancelled/failed
    error_message: str = ""


class ChannelSink(Protocol):
    async def open(self, target: dict[str, Any]) -> Any:
        """Start a streaming message; returns the platform's handle for it."""

    async def update(self, handle: Any, text: str) -> None:
        """Show the answer so far (latest wins)."""

    async def finish(self, handle: Any, terminal: Terminal) -> None:
        """Show the terminal state on the streaming message."""

    async def send_plain(self, target: dict[str, Any], text: str) -> None:
        """Send one ordinary message (the fallback)."""


def fallback_text(terminal: Terminal) -> str | None:
    """The one plain message a failed sink falls back to, or None when there is none to send.
    Never an answer body for a cancelled or failed turn: only a short note, and only with a
    partial."""
    if terminal.status == "completed":
        return terminal.text or None
    if not terminal.text:
        if terminal.status == "failed" and terminal.error_message:
            return terminal.error_message
        return None
    excerpt = terminal.text if len(terminal.text) <= 200 else terminal.text[:200] + "…"
    if terminal.status == "cancelled":
        return _("(stopped) %(partial)s") % {"partial": excerpt}
    return _("(interrupted: %(error)s) %(partial)s") % {
        "error": terminal.error_message or _("failed"),
        "partial": excerpt,
    }


@dataclass
class DeliveryHandle:
    coordinator: DeliveryCoordinator
    sink: ChannelSink | None
    target: dict[str, Any]
    platform_handle: Any = None
    opened: bool = False
    finished: bool = False
    last_text: str = ""
    update_failures: int = 0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Progress waiting for the sink (latest wins) and the task that sends it (`push`).
    _latest: str | None = None
    _pump: asyncio.Task[Any] | None = None

    async def update(self, text: str) -> None:
        """Latest-wins progress; a failing progress update is logged, never fatal."""
        if not self.opened or self.finished or text == self.last_text or self.sink is None:
            return
        try:
            await asyncio.wait_for(
                self.sink.update(self.platform_handle, text), self.coordinator.timeout
            )
            self.last_text = text
        except Exception as exc:
            self.update_failures += 1
            logger.warning("sink update failed: %s", type(exc).__name__)

    def push(
        self, text: str, *, spawn: Callable[[str, Coroutine[Any, Any, Any]], asyncio.Task[Any]]
    ) -> None:
        """Latest-wins progress off the caller's path: a slow sink never holds up the turn's
        snapshots; at most one update runs at a time, the newest text goes next."""
        if self.finished or self.sink is None:
            return
        self._latest = text
        if self._pump is not None and not self._pump.done():
            return
        try:
            self._pump = spawn(f"sink-update:{self.target.get('turn_id', '')}", self._drain())
        except Exception:
            # Shutdown began: progress is dropped, the terminal still goes out.
            self._pump = None

    async def _drain(self) -> None:
        while self._latest is not None and not self.finished:
            text, self._latest = self._latest, None
            await self.update(text)

    async def finish(self, terminal: Terminal) -> str:
        """Deliver the terminal exactly once, after the progress already pushed. Returns
        how: "sink", "plain" or "none"."""
        async with self._lock:
            if self.finished:
                return "none"
            if self._pump is not None and not self._pump.done():
                await asyncio.wait({self._pump})
            self.finished = True
            return await self.coordinator._finish(self, terminal)


class DeliveryCoordinator:
    def __init__(self, *, retries: int = 3, backoff: float = 0.2, timeout: float = 10.0) -> None:
        self.retries = retries
        self.backoff = backoff
        self.timeout = timeout
        # The last pending terminal of each chat: the next one of that chat waits for it.
        self._pending: dict[str, asyncio.Task[Any]] = {}

    async def start(self, sink: ChannelSink, target: dict[str, Any]) -> DeliveryHandle:
        """Open the streaming message. A failed open is recorded on the handle, whose terminal
        then goes out as one plain message."""
        handle = DeliveryHandle(coordinator=self, sink=sink, target=target)
        try:
            handle.platform_handle = await asyncio.wait_for(sink.open(target), self.timeout)
            handle.opened = True
        except Exception as exc:
            logger.warning(
                "sink open failed, the terminal will be a plain message: %s", type(exc).__name__
            )
        return handle

    def finish_later(
        self,
        handle: DeliveryHandle,
        terminal: Terminal,
        *,
        spawn: Callable[[str, Coroutine[Any, Any, Any]], asyncio.Task[Any]],
    ) -> bool:
        """Deliver the terminal as a task of `spawn` (the engine's supervisor, so shutdown
        gives it the grace period), after the chat's previous terminal. False when `spawn`
        refuses (shutdown began): the caller then finishes in place."""
        key = str(handle.target.get("chat_id", ""))
        previous = self._pending.get(key)

        async def deliver() -> None:
            if previous is not None and not previous.done():
                await asyncio.wait({previous})
            await handle.finish(terminal)

        try:
            task = spawn(f"delivery:{handle.target.get('turn_id', '')}", deliver())
        except Exception:
            return False
        self._pending[key] = task
        task.add_done_callback(lambda done: self._forget(key, done))
        return True

    def pending(self) -> list[asyncio.Task[Any]]:
        """Terminals still on their way to a sink."""
        return [t for t in self._pending.values() if not t.done()]

    def _forget(self, key: str, task: asyncio.Task[Any]) -> None:
        if self._pending.get(key) is task:
            del self._pending[key]

    async def _finish(self, handle: DeliveryHandle, terminal: Terminal) -> str:
        assert handle.sink is not None
        if handle.opened:
            for attempt in range(self.retries + 1):
                try:
                    await asyncio.wait_for(
                        handle.sink.finish(handle.platform_handle, terminal), self.timeout
                    )
                    return "sink"
                except Exception as exc:
                    logger.warning(
                        "sink finish failed (attempt %d): %s", attempt + 1, type(exc).__name__
                    )
                    if attempt < self.retries:
                        await asyncio.sleep(self.backoff * (2**attempt))
            logger.error("sink finish failed after retries; falling back to a plain message")
        text = fallback_text(terminal)
        if text is None:
            return "none"
        try:
            await asyncio.wait_for(handle.sink.send_plain(handle.target, text), self.timeout)
            return "plain"
        except Exception:
            logger.exception("plain fallback delivery failed")
            return "none"


def sink_for_channel(channel: str) -> ChannelSink | None:
    path = settings.CHAT.get("SINKS", {}).get(channel)
    if not path:
        return None
    module_name, _sep, attr = path.rpartition(".")
    factory = getattr(import_module(module_name), attr)
    sink: ChannelSink = factory()
    return sink
