"""The web chat's WebSocket, `/ws/chat/` (PROTOCOL "WebSocket: /ws/chat/"; SPEC D, E1, F2,
F3, F6).

A thin channel (STYLE 1, 5): it parses and validates client frames, forwards them to the
engine (sends, commands, stop, retry) or to the client-state readers (history, sessions), and
relays the engine's events. It owns no turn: closing the socket mid-turn neither stops nor
loses anything.

Per connection it keeps only what delivery needs: the current dialog (whose snapshots it
follows) and a `SnapshotRelay`, so every snapshot tail it sends applies contiguously (D1, D3).
Client frames are handled one at a time, in order (a `send` after `/new` lands in the new
dialog); each connection is its own task, so a slow frame never holds up another connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from typing import Any
from urllib.parse import parse_qs

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.contrib.auth.models import User
from django.http.cookie import parse_cookie
from django.utils import translation
from django.utils.translation import gettext as _

from chatcore.common import events, publish
from chatcore.common.errors import BadRequest, ChatError, InternalError, NotFound, RateLimited
from chatcore.common.ids import FIRST_PARTY_CHANNELS, owner_chat_id, validate_part
from chatcore.engine import commands, runtime
from chatcore.engine.clientstate import (
    SnapshotRelay,
    request_full_snapshot,
    session_history_frame,
    sessions_frame,
)
from chatcore.engine.engine import Engine, Inbound
from chatcore.engine.sessions import resolve_dialog

from . import logins, selectors
from .frames import parse_client_frame
from .models import Session

logger = logging.getLogger(__name__)

CHANNEL = "web"
# PROTOCOL: unauthenticated connections are accepted, then closed with this code.
CLOSE_UNAUTHENTICATED = 4401
# G5: the channel layer lost frames (a Redis restart): the client reconnects and resyncs
# (like 1012 "service restart", which the WebSocket server library does not let us send).
CLOSE_RESYNC = 4012
# F7: a user's socket past CHAT["USER_SOCKETS_MAX"] gets a `rate_limited` error frame, then
# this close code (429 as in HTTP).
CLOSE_TOO_MANY_SOCKETS = 4429
# Several `sessions_changed` events within this window produce one `sessions` frame.
SESSIONS_COALESCE_SECONDS = 0.05
# Sent to this connection's own channel to refresh `sessions` (see `_sessions_changed`).
REFRESH_SESSIONS = "sessions.refresh"
# Turns whose terminal this connection relayed; a late snapshot of one is dropped.
ENDED_TURNS_KEPT = 256


def error_frame(exc: ChatError, client_msg_id: str | None) -> dict[str, Any]:
    """The one place a domain error becomes a WebSocket `error` frame (STYLE 9)."""
    frame: dict[str, Any] = {"type": "error", "client_msg_id": client_msg_id, **exc.as_dict()}
    if exc.retry_after is not None:
        frame["retry_after"] = round(exc.retry_after, 1)
    return frame


def _header(scope: dict[str, Any], name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key == name:
            return str(value.decode("latin1"))
    return ""


def _language(scope: dict[str, Any]) -> str:
    """F5: the user's choice (the language cookie set by /i18n/setlang/), else the first
    supported language of the handshake's Accept-Language."""
    chosen = parse_cookie(_header(scope, b"cookie")).get(settings.LANGUAGE_COOKIE_NAME)
    if chosen:
        try:
            return translation.get_supported_language_variant(chosen)
        except LookupError:
            pass
    for part in _header(scope, b"accept-language").split(","):
        code = part.split(";")[0].strip()
        if not code or code == "*":
            continue
        try:
            return translation.get_supported_language_variant(code)
        except LookupError:
            continue
    return settings.LANGUAGE_CODE


def _membership(frame: dict[str, Any]) -> tuple[str | None, frozenset[str]]:
    return frame["current"], frozenset(item["session_id"] for item in frame["items"])


def _optional_int(data: dict[str, Any], name: str, *, low: int, high: int | None) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        bounds = f"{low}..{high}" if high is not None else f">= {low}"
        raise BadRequest(
            _("%(name)s must be an integer (%(bounds)s).") % {"name": name, "bounds": bounds}
        )
    return value


class ChatConsumer(AsyncWebsocketConsumer):
    user: User | None = None
    engine: Engine
    chat_id: str = ""
    chat_group: str = ""
    session_group: str = ""
    current: Session | None = None
    language: str = "en"
    # F8: the credential this connection rides on; once it ends, nothing more is sent.
    login: logins.Login | None = None
    login_over = False
    registered = False
    # Chat groups of the chat-app dialogs linked to this user (their deltas and terminals).
    linked_groups: frozenset[str] = frozenset()

    # --- connection ------------------------------------------------------------------------

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.accept()
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.language = _language(self.scope)
        self.engine = await runtime.get_engine()
        if not await self._register(user):
            return
        self.user = user
        self.relay = SnapshotRelay()
        self.ended: deque[str] = deque(maxlen=ENDED_TURNS_KEPT)
        self.sessions_pending = False
        self.sessions_task: asyncio.Task[None] | None = None
        # What the last `sessions` frame told the client: the current dialog and which
        # dialogs exist (`sessions_changed` is about creation, deletion and restore).
        self.sessions_shown: tuple[str | None, frozenset[str]] | None = None
        self.echoed_updates: dict[str, dict[str, Any]] = {}
        # Per dialog, the message ids of the last `session_history` (latest page) sent.
        self.history_sent: dict[str, frozenset[str]] = {}
        # The current dialog was deleted elsewhere and no other was left: the next frame
        # that needs it resolves one as in B1.
        self.current_gone = False
        self.chat_id = owner_chat_id(user.pk)
        self.chat_group = publish.chat_group(CHANNEL, self.chat_id)
        self.login = self.scope.get("login")
        if self.login is not None:
            # F8: before anything else, so an ending login is never missed.
            await logins.join(self.channel_name, self.login)
        requested = parse_qs(self.scope.get("query_string", b"").decode("latin1")).get(
            "dialog_id", [None]
        )[0]
        with translation.override(self.language):
            # D3: join the fan-out before reading any state, so nothing falls in between.
            await self.channel_layer.group_add(self.chat_group, self.channel_name)
            current = await database_sync_to_async(self._initial_dialog)(requested)
            await self.accept()
            await self._follow(current)
            await self._send_sessions()
            await self._send_history(current)
        self.engine.layer_watch.register(self._layer_lost)

    async def websocket_connect(self, message: dict[str, Any]) -> None:
        try:
            await super().websocket_connect(message)
        except BaseException:
            # A connect that failed half-way must not keep counting against the user (F7).
            await self._unregister()
            raise

    async def _unregister(self) -> None:
        if self.registered:
            self.registered = False
            await sync_to_async(self.engine.sockets.close, thread_sensitive=False)(
                self.scope["user"].pk, self.channel_name
            )

    async def _register(self, user: User) -> bool:
        """F7: count this socket among the user's open ones; past the bound, refuse it with
        a `rate_limited` error frame and close code 4429."""
        limit = int(self.engine.cfg["USER_SOCKETS_MAX"])
        opened = await sync_to_async(self.engine.sockets.open, thread_sensitive=False)(
            user.pk, self.channel_name, limit
        )
        if opened:
            self.registered = True
            return True
        await self.accept()
        with translation.override(self.language):
            refusal = RateLimited(
                _("Too many open connections (at most %(n)d); close another tab or app first.")
                % {"n": limit}
            )
        await self._send(error_frame(refusal, None))
        await self.close(code=CLOSE_TOO_MANY_SOCKETS)
        return False

    def _initial_dialog(self, requested: str | None) -> Session:
        """B1, with `?dialog_id=` picking a dialog when it exists."""
        assert self.user is not None
        if requested:
            try:
                return resolve_dialog(
                    owner=self.user, channel=CHANNEL, chat_id=self.chat_id, dialog_id=requested
                )
            except ChatError:
                pass
        return resolve_dialog(owner=self.user, channel=CHANNEL, chat_id=self.chat_id)

    async def disconnect(self, code: int) -> None:
        # The engine keeps running any turn (STYLE 5); only this connection's fan-out ends.
        await self._unregister()
        if self.user is None:
            return
        if self.login is not None:
            await logins.leave(self.channel_name, self.login)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.layer_watch.unregister(self._layer_lost)
        if self.sessions_task is not None:
            self.sessions_task.cancel()
        for group in (self.chat_group, self.session_group, *self.linked_groups):
            if group:
                await self.channel_layer.group_discard(group, self.channel_name)

    async def _layer_lost(self) -> None:
        await self.close(code=CLOSE_RESYNC)

    async def _follow(self, session: Session) -> None:
        """Make `session` the current dialog: its snapshots reach this connection (and no
        other dialog's). The caller then sends its `session_history`, which re-seeds the
        relay."""
        group = publish.session_group(session.pk)
        if group != self.session_group:
            await self.channel_layer.group_add(group, self.channel_name)
            if self.session_group:
                await self.channel_layer.group_discard(self.session_group, self.channel_name)
            self.session_group = group
        self.current = session
        self.relay.reset()

    async def _move(self, session: Session) -> None:
        """The current dialog changed without a command of this connection: tell the client
        (`sessions`, then the new `session_history`)."""
        self.current_gone = False
        await self._follow(session)
        await self._send_sessions()
        await self._send_history(session)

    # --- sending ---------------------------------------------------------------------------

    async def _send(self, frame: dict[str, Any]) -> None:
        if self.login_over:
            return
        await self.send(
            text_data=json.dumps(frame, ensure_ascii=False, separators=(",", ":"), default=str)
        )

    async def _send_sessions(self, client_msg_id: str | None = None) -> None:
        assert self.user is not None
        frame = await database_sync_to_async(sessions_frame)(
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
        """Follow the chats of the linked chat-app dialogs a `sessions` frame lists (their
        deltas, terminals and renames reach this connection as the web chat's do)."""
        groups = {
            publish.chat_group(item["channel"], item["chat_id"])
            for item in frame["items"]
            if item["channel"] not in FIRST_PARTY_CHANNELS
        }
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
        frame = await database_sync_to_async(session_history_frame)(**kwargs)
        if before_seq is None:
            self.history_sent[frame["session_id"]] = frozenset(m["id"] for m in frame["messages"])
            if self.current is not None and session.pk == self.current.pk:
                # The client replaces its view of the running turn with `active_turn`; tails
                # continue from there (D3).
                self.relay.reset()
                self.relay.seed(frame["active_turn"])
        if client_msg_id is not None:
            frame["client_msg_id"] = client_msg_id
        await self._send(frame)

    # --- client frames ---------------------------------------------------------------------

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.user is None or self.login_over:
            return
        with translation.override(self.language):
            await self._handle(text_data, bytes_data)

    async def _handle(self, text_data: str | None, bytes_data: bytes | None) -> None:
        client_msg_id: str | None = None
        try:
            data = self._parse(text_data, bytes_data)
            raw_id = data.get("client_msg_id")
            if raw_id is not None and not isinstance(raw_id, str):
                raise BadRequest(_("client_msg_id must be a string."))
            client_msg_id = raw_id
            kind = data.get("type")
            handler = self.HANDLERS.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise BadRequest(_("Unknown frame type %(type)r.") % {"type": str(kind)[:40]})
            await handler(self, data, client_msg_id)
        except ChatError as exc:
            await self._send(error_frame(exc, client_msg_id))
        except Exception:
            logger.exception("websocket frame failed", extra={"chat_id": self.chat_id})
            await self._send(error_frame(InternalError(), client_msg_id))

    @staticmethod
    def _parse(text_data: str | None, bytes_data: bytes | None) -> dict[str, Any]:
        return parse_client_frame(text_data, bytes_data)

    async def _target(self, data: dict[str, Any], *, write: bool = False) -> Session:
        """The dialog a frame is about: its `dialog_id` (one of this user's live dialogs of
        the web chat, else not_found), its `session_id` (that, or a chat-app dialog linked
        to this user), or the connection's current dialog. A `write` into a dialog that is
        read-only for this user is refused (`read_only`)."""
        assert self.user is not None and self.current is not None
        raw = data.get("dialog_id")
        raw_session = data.get("session_id")
        if raw is not None and raw_session is not None:
            raise BadRequest(_("Name a dialog by dialog_id or by session_id, not both."))
        if raw_session is not None:
            target = await database_sync_to_async(self._session_target)(raw_session)
        elif raw is not None:
            dialog_id = validate_part(raw, field="dialog_id")
            target = await database_sync_to_async(selectors.dialog_get)(
                owner_id=self.user.pk, channel=CHANNEL, chat_id=self.chat_id, dialog_id=dialog_id
            )
        else:
            if self.current_gone:
                await self._move(await database_sync_to_async(self._initial_dialog)(None))
            target = self.current
        if write:
            await database_sync_to_async(selectors.dialog_check_writable)(
                user_id=self.user.pk, session=target
            )
        return target

    def _session_target(self, raw: object) -> Session:
        assert self.user is not None
        if not isinstance(raw, str) or len(raw) > 200:
            raise BadRequest(_("session_id must be a string."))
        session = selectors.session_get_for_owner(owner_id=self.user.pk, session_id=raw)
        own_chat = session.channel == CHANNEL and session.chat_id == self.chat_id
        if not own_chat and session.channel in FIRST_PARTY_CHANNELS:
            # Dialogs of the API or the terminal are not part of the web chat.
            raise NotFound(_("Dialog not found."))
        return session

    async def _on_send(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        await self._submit(data, client_msg_id, "send")

    async def _on_steer(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        await self._submit(data, client_msg_id, "steer")

    async def _on_inject(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        await self._submit(data, client_msg_id, "inject")

    async def _submit(self, data: dict[str, Any], client_msg_id: str | None, mode: str) -> None:
        assert self.user is not None
        content = data.get("content")
        if not isinstance(content, str):
            raise BadRequest(_("content must be a string."))
        target = await self._target(data)
        if mode == "send" and commands.is_command(content):
            await self._command(content, target, client_msg_id)
            return
        # The engine refuses a send, steer or inject into a read-only dialog (`read_only`).
        inbound = Inbound(
            owner=self.user,
            channel=CHANNEL,
            chat_id=self.chat_id,
            content=content,
            sender_id=str(self.user.pk),
            mode=mode,
            client_msg_id=client_msg_id or "",
        )
        ack = await self.engine.submit(inbound, target)
        await self._send(ack.frame())

    async def _command(self, text: str, target: Session, client_msg_id: str | None) -> None:
        """B3: one `command_result` (or an error), then the state frames it causes."""
        assert self.user is not None and self.current is not None
        if commands.writes_dialog(text):
            await database_sync_to_async(selectors.dialog_check_writable)(
                user_id=self.user.pk, session=target
            )
        ctx = commands.CommandContext(
            owner=self.user,
            channel=CHANNEL,
            chat_id=self.chat_id,
            current=target,
            engine=self.engine,
        )
        result = await commands.run_command(ctx, text)
        if "history" in result.effects and result.current is not None:
            # /new and /switch move this connection; /delete does when it deleted the
            # connection's own current dialog (a `dialog_id` may name another one).
            moved = not (result.command == "delete" and target.pk != self.current.pk)
            if moved:
                await self._follow(result.current)
        await self._send(
            {
                "type": "command_result",
                "client_msg_id": client_msg_id,
                "command": result.command,
                "ok": result.ok,
                "content": result.content,
            }
        )
        if "sessions" in result.effects:
            await self._send_sessions()
        if "history" in result.effects:
            await self._send_history(self.current)
        if "session" in result.effects and result.current is not None:
            frame = events.session_updated_frame(session=result.current)
            # The same frame also arrives through the chat group; it is not sent twice.
            self.echoed_updates[frame["session_id"]] = frame
            await self._send(frame)

    async def _on_stop(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        # C6: the same path as `/stop`, answered by `command_result` "stop".
        await self._command("/stop", await self._target(data), client_msg_id)

    async def _on_retry(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        assert self.user is not None
        target = await self._target(data, write=True)
        ack = await self.engine.retry(target, owner=self.user, client_msg_id=client_msg_id or "")
        await self._send(ack.frame())

    async def _on_continue(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        # E5: go on with a cut answer; answered by `queued` (mode `continue`) or `error`.
        assert self.user is not None
        target = await self._target(data, write=True)
        ack = await self.engine.continue_answer(
            target, owner=self.user, client_msg_id=client_msg_id or ""
        )
        await self._send(ack.frame())

    async def _on_history(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        before_seq = _optional_int(data, "before_seq", low=1, high=None)
        limit = _optional_int(data, "limit", low=1, high=selectors.HISTORY_PAGE_MAX)
        follow = data.get("follow", False)
        if not isinstance(follow, bool):
            raise BadRequest(_("follow must be true or false."))
        target = await self._target(data)
        if follow and before_seq is None:
            # The dialog becomes this connection's current one: its snapshots stream here
            # (how the web chat opens a linked chat-app dialog, which /switch cannot name).
            self.current_gone = False
            await self._follow(target)
        await self._send_history(
            target, before_seq=before_seq, limit=limit, client_msg_id=client_msg_id
        )

    async def _on_sessions(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        await self._send_sessions(client_msg_id)

    HANDLERS = {
        "send": _on_send,
        "steer": _on_steer,
        "inject": _on_inject,
        "stop": _on_stop,
        "retry": _on_retry,
        "continue": _on_continue,
        "history": _on_history,
        "sessions": _on_sessions,
    }

    # --- published events -----------------------------------------------------------------

    async def dispatch(self, message: dict[str, Any]) -> None:
        if message.get("type") == publish.EVENT_TYPE:
            # Relaying touches no database: skip channels' per-message close_old_connections,
            # a round trip to the one ORM thread for every snapshot frame (STYLE 6).
            await self.chat_event(message)
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
            self._sessions_changed()
        elif kind == "session_updated":
            if self.echoed_updates.get(frame.get("session_id", "")) == frame:
                del self.echoed_updates[frame["session_id"]]
                return
            await self._send(frame)
        elif kind == "turn_updated":
            self.relay.forget(frame["turn_id"])
            self.ended.append(frame["turn_id"])
            await self._send(frame)
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
        if self.current is None or frame.get("session_id") != self.current.session_id:
            return  # a frame still in flight from the dialog this connection left
        turn_id = frame.get("turn_id")
        if turn_id in self.ended:
            return
        out, ask = self.relay.relay(frame)
        if ask:
            await request_full_snapshot(str(turn_id), self.channel_name)
        if out is not None:
            await self._send(out)

    def _sessions_changed(self) -> None:
        """A dialog of the chat was created, deleted or restored. A burst of these yields one
        refresh, which comes back through this connection's own channel, so it runs in order
        with everything else this connection handles (no locks)."""
        if self.sessions_pending:
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

        frame, gone, replacement = await database_sync_to_async(read)()
        if replacement is not None:
            await self._move(replacement)
            return
        self.current_gone = gone
        await self._join_linked(frame)
        if _membership(frame) == self.sessions_shown:
            return  # e.g. the echo of this connection's own /new or /delete
        self.sessions_shown = _membership(frame)
        await self._send(frame)
