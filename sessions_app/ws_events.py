"""What the engine publishes, relayed to one `/ws/chat/` socket (PROTOCOL "WebSocket:
/ws/chat/"; SPEC D1-D3, F8).

The base of the web chat's consumer: the frames it sends (`sessions`, `session_history`) and
the events of the chat's groups it relays: snapshot tails of the current dialog only, each
applying contiguously through the `ChannelConnection`'s relay (D1, D3); deltas a history
already held are not sent twice; a burst of dialog changes yields one `sessions` refresh; an
ended login stops everything (F8). `consumers.ChatConsumer` adds the connection's lifecycle
and the client's frames.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

from channels.generic.websocket import AsyncWebsocketConsumer
from django.contrib.auth.models import User

from chatcore.common import events, publish
from chatcore.common.dbthreads import on_db_idempotent
from chatcore.engine.clientstate import session_history_frame, sessions_frame
from chatcore.engine.engine import Engine

from . import logins, selectors
from .connection import ChannelConnection
from .models import Session

logger = logging.getLogger(__name__)

CHANNEL = "web"
# The user's first-party chats besides the web chat, listed in its sidebar (issue 54).
OWN_OTHER_CHANNELS = ("api", "cli")
# Several `sessions_changed` events within this window produce one `sessions` frame.
SESSIONS_COALESCE_SECONDS = 0.05
# Sent to this connection's own channel to refresh `sessions` (see `_sessions_changed`).
REFRESH_SESSIONS = "sessions.refresh"
# Turns whose terminal this connection relayed; a late snapshot of one is dropped.
ENDED_TURNS_KEPT = 256


def _membership(frame: dict[str, Any]) -> tuple[str | None, frozenset[str]]:
    return frame["current"], frozenset(item["session_id"] for item in frame["items"])


class ChatEventsConsumer(AsyncWebsocketConsumer):
    """The relaying half of the web chat's socket (see the module docstring)."""

    user: User | None = None
    engine: Engine
    conn: ChannelConnection | None = None
    chat_id: str = ""
    # F8: the credential this connection rides on; once it ends, nothing more is sent.
    login: logins.Login | None = None
    login_over = False
    # Chat groups of the chat-app dialogs linked to this user (their deltas and terminals).
    linked_groups: frozenset[str] = frozenset()
    sessions_pending = False
    sessions_task: asyncio.Task[None] | None = None
    # What the last `sessions` frame told the client: the current dialog and which dialogs
    # exist (`sessions_changed` is about creation, deletion and restore).
    sessions_shown: tuple[str | None, frozenset[str]] | None = None
    # The current dialog was deleted elsewhere and no other was left: the next frame that
    # needs it resolves one as in B1.
    current_gone = False

    def start_relaying(self) -> None:
        """Per-connection state, set once the connection is authenticated."""
        self.ended: deque[str] = deque(maxlen=ENDED_TURNS_KEPT)
        self.echoed_updates: dict[str, dict[str, Any]] = {}
        # Per dialog, the message ids of the last `session_history` (latest page) sent.
        self.history_sent: dict[str, frozenset[str]] = {}
        # Per dialog, the revision of that `session_history` (H1: a path change it already
        # shows is not sent again).
        self.revision_sent: dict[str, int] = {}

    @property
    def current(self) -> Session | None:
        return self.conn.current if self.conn is not None else None

    async def _move(self, session: Session) -> None:
        """The current dialog changed without a command of this connection: tell the client
        (`sessions`, then the new `session_history`)."""
        self.current_gone = False
        assert self.conn is not None
        await self.conn.follow(session)
        await self._send_sessions()
        await self._send_history(session)

    # --- sending ---------------------------------------------------------------------------

    async def _send(self, frame: dict[str, Any]) -> None:
        if self.login_over:
            return
        await self.send(text_data=events.frame_text(frame))

    async def _send_sessions(self, client_msg_id: str | None = None) -> None:
        assert self.user is not None
        frame = await on_db_idempotent(sessions_frame)(
            owner_id=self.user.pk,
            channel=CHANNEL,
            chat_id=self.chat_id,
            current=self.current,
            linked=True,
        )
        await self._join_linked(frame)
        self.sessions_shown = _membership(frame)
        if client_msg_id is not None:
            frame = {**frame, "client_msg_id": client_msg_id}
        await self._send(frame)

    async def _join_linked(self, frame: dict[str, Any]) -> None:
        """Follow the chats of the other dialogs a `sessions` frame lists (linked chat-app
        dialogs, the user's API and terminal dialogs): their deltas, terminals and renames
        reach this connection as the web chat's do."""
        groups = {
            publish.chat_group(item["channel"], item["chat_id"])
            for item in frame["items"]
            if (item["channel"], item["chat_id"]) != (CHANNEL, self.chat_id)
        }
        # The user's own API and terminal chats even before they hold a dialog: one made by
        # `POST /sessions` appears in the list at once (its `sessions_changed`).
        groups |= {publish.chat_group(channel, self.chat_id) for channel in OWN_OTHER_CHANNELS}
        for group in groups - self.linked_groups:
            await self.channel_layer.group_add(group, self.channel_name)
        for group in self.linked_groups - groups:
            await self.channel_layer.group_discard(group, self.channel_name)
        self.linked_groups = frozenset(groups)

    async def _send_history(
        self,
        session: Session,
        *,
        before_seq: int | None = None,
        limit: int | None = None,
        client_msg_id: str | None = None,
    ) -> None:
        kwargs: dict[str, Any] = {"session": session, "engine": self.engine}
        if before_seq is not None:
            kwargs["before_seq"] = before_seq
        if limit is not None:
            kwargs["limit"] = limit
        frame = await on_db_idempotent(session_history_frame)(**kwargs)
        if before_seq is None:
            self.history_sent[frame["session_id"]] = frozenset(m["id"] for m in frame["messages"])
            self.revision_sent[frame["session_id"]] = frame["history_revision"]
            if self.conn is not None and self.current is not None and session.pk == self.current.pk:
                # The client replaces its view of the running turn with `active_turn`; tails
                # continue from there (D3).
                self.conn.seed(frame["active_turn"])
        if client_msg_id is not None:
            frame["client_msg_id"] = client_msg_id
        await self._send(frame)

    # --- published events -----------------------------------------------------------------

    async def dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == publish.EVENT_TYPE:
            # Relaying touches no database: skip channels' per-message close_old_connections,
            # a round trip to a sync thread for every snapshot frame (STYLE 6).
            for one in publish.unfold(message):
                await self.chat_event(one)
            return
        if kind == "websocket.receive":
            # Nor for a client frame: its reads run through `on_db`, which does that cleanup
            # on the database thread itself, and the engine's writes reset a broken
            # connection on failure (`storage`); a separate hop would only delay a send's
            # admission, and so its first token.
            await self.websocket_receive(message)
            return
        await super().dispatch(message)

    async def chat_event(self, message: dict[str, Any]) -> None:
        frame = message.get("frame")
        if self.user is None or not isinstance(frame, dict):
            return
        kind = frame.get("type")
        if kind == "turn_snapshot":
            await self._relay_snapshot(frame)
        elif kind == "sessions_changed":
            self._sessions_changed(frame)
        elif kind == "session_updated":
            if self.echoed_updates.get(frame.get("session_id", "")) == frame:
                del self.echoed_updates[frame["session_id"]]
                return
            await self._send(frame)
        elif kind == "turn_updated":
            if self.conn is not None:
                self.conn.relay.forget(frame["turn_id"])
            self.ended.append(frame["turn_id"])
            await self._send(frame)
        elif kind == "path_changed":
            # H1: the active path changed (here or in another process): the client replaces
            # its view of the dialog it shows; other dialogs load theirs when opened.
            current = self.current
            if (
                current is not None
                and frame.get("session_id") == current.session_id
                and self.revision_sent.get(current.session_id, -1) < frame["history_revision"]
            ):
                await self._send_history(current)
        elif kind == "history_delta":
            # D2: every dialog of the chat; a delta whose messages a `session_history` sent
            # after it was published already holds (e.g. the welcome of a dialog created on
            # connect or by /new) is not sent again. Compared by message id, not revision: a
            # re-created dialog reuses its session id and starts again at seq 1.
            shown = self.history_sent.get(frame["session_id"])
            if shown is not None and all(m["id"] in shown for m in frame["messages"]):
                return
            await self._send(frame)
        else:
            # system_notification, and frames this version does not know: relayed as they are.
            await self._send(frame)

    async def login_ended(self, message: dict[str, Any]) -> None:
        """F8: the login ended (logout, token revoked, user deactivated), here or in another
        process: close as an unauthenticated connection is closed."""
        if self.login_over:
            return
        self.login_over = True
        await self.close(code=logins.CLOSE_LOGIN_ENDED)

    async def _relay_snapshot(self, frame: dict[str, Any]) -> None:
        """D1, D3: snapshots of the current dialog only, each applying contiguously to what
        this client has; a gap asks the turn's process for a full snapshot (it arrives on
        this connection's own channel)."""
        if (
            self.conn is None
            or self.current is None
            or frame.get("session_id") != self.current.session_id
        ):
            return  # a frame still in flight from the dialog this connection left
        if frame.get("turn_id") in self.ended:
            return
        out = await self.conn.relay_snapshot(frame)
        if out is not None:
            await self._send(out)

    def _sessions_changed(self, frame: dict[str, Any]) -> None:
        """A dialog of the chat was created, deleted or restored. A burst of these yields one
        refresh, which comes back through this connection's own channel, so it runs in order
        with everything else this connection handles (no locks). The creation of a dialog
        this client already lists (this connection's own first dialog, its own `/new`)
        changes nothing it sees: no read."""
        if self.sessions_pending:
            return
        if (
            frame.get("change") == "created"
            and self.sessions_shown is not None
            and frame.get("session_id") in self.sessions_shown[1]
        ):
            return
        self.sessions_pending = True
        self.sessions_task = asyncio.get_running_loop().create_task(self._schedule_refresh())

    async def _schedule_refresh(self) -> None:
        await asyncio.sleep(SESSIONS_COALESCE_SECONDS)
        self.sessions_pending = False
        await self.channel_layer.send(self.channel_name, {"type": REFRESH_SESSIONS})

    async def sessions_refresh(self, message: dict[str, Any]) -> None:
        if self.user is not None:
            await self._refresh_sessions()

    async def _refresh_sessions(self) -> None:
        """One fresh `sessions` frame, none when nothing this client sees changed."""
        assert self.user is not None and self.current is not None
        user, current = self.user, self.current

        def read() -> tuple[dict[str, Any], bool, Session | None]:
            frame = sessions_frame(
                owner_id=user.pk,
                channel=CHANNEL,
                chat_id=self.chat_id,
                current=current,
                linked=True,
            )
            # By primary key: a re-created dialog may carry the deleted one's id.
            if selectors.live_sessions_for_owner(owner_id=user.pk).filter(pk=current.pk).exists():
                return frame, False, None
            # Deleted elsewhere (another tab, the API, an operator): move to the most recent
            # live dialog, as `/delete` does; never create one from here.
            remaining = selectors.dialog_list_for_chat(
                owner_id=user.pk, channel=CHANNEL, chat_id=self.chat_id, limit=1
            )
            return frame, True, remaining[0] if remaining else None

        frame, gone, replacement = await on_db_idempotent(read)()
        if replacement is not None:
            await self._move(replacement)
            return
        self.current_gone = gone
        await self._join_linked(frame)
        if _membership(frame) == self.sessions_shown:
            return  # e.g. the echo of this connection's own /new or /delete
        self.sessions_shown = _membership(frame)
        await self._send(frame)
