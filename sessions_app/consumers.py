"""The web chat's WebSocket, `/ws/chat/` (PROTOCOL "WebSocket: /ws/chat/"; SPEC D, E1, F2,
F3, F6).

A thin channel (STYLE 1, 5): it parses and validates client frames and forwards them through
its `ChannelConnection` (sends, commands, stop, retry, continue) or to the client-state
readers (history, sessions). Relaying the engine's events is its base class's part
(`ws_events.ChatEventsConsumer`). It owns no turn: closing the socket mid-turn neither stops
nor loses anything.

Client frames are handled one at a time, in order (a `send` after `/new` lands in the new
dialog); each connection is its own task, so a slow frame never holds up another connection.

A connect (PROTOCOL "On connect"): the login's, the chat's and the user's other chats' groups
joined in one go; the user's list and, from it, the current dialog (B1) as this process
keeps them (`engine.openings.lists`), else read; the dialog's group; then its newest page, or
for a client that says what it holds (`opening.Holds`) the delta from there, with the running
turn and the queue (`engine.openings.open`, gathered with other sockets' opening meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from channels.exceptions import StopConsumer
from django.conf import settings
from django.contrib.auth.models import User
from django.http.cookie import parse_cookie
from django.utils import translation
from django.utils.translation import gettext as _

from audit.trail import scope_ip
from chatcore.common import events, publish
from chatcore.common.dbthreads import on_db_idempotent
from chatcore.common.errors import BadRequest, ChatError, InternalError, RateLimited
from chatcore.common.ids import owner_chat_id, validate_part
from chatcore.engine import commands, rates, runtime
from chatcore.engine.dialog_settings import dialog_settings_update
from chatcore.engine.lists import SessionList
from chatcore.engine.opening import Holds, Opening

from . import logins, search, selectors
from .connection import ChannelConnection, resolve_attachments
from .frames import optional_int, parse_client_frame
from .models import Session
from .settings_services import settings_changes
from .ws_auth import authenticate
from .ws_events import CHANNEL, ChatEventsConsumer, chat_groups

logger = logging.getLogger(__name__)

# PROTOCOL: unauthenticated connections are accepted, then closed with this code.
CLOSE_UNAUTHENTICATED = 4401
# G5: the channel layer lost frames (a Redis restart): the client reconnects and resyncs
# (like 1012 "service restart", which the WebSocket server library does not let us send).
CLOSE_RESYNC = 4012
# F7: a user's socket past CHAT["USER_SOCKETS_MAX"] gets a `rate_limited` error frame, then
# this close code (429 as in HTTP).
CLOSE_TOO_MANY_SOCKETS = 4429


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


class ChatConsumer(ChatEventsConsumer):
    """The web chat's socket: its lifecycle and the client's frames; relaying what the
    engine publishes is the base class's part (`ws_events`)."""

    language: str = "en"
    registered = False

    # --- connection ------------------------------------------------------------------------

    async def connect(self) -> None:
        # The socket's login, read here rather than by a middleware whose coroutine would
        # wait for the socket's whole life (issue 57).
        await authenticate(self.scope)
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
        self.chat_id = owner_chat_id(user.pk)
        self.conn = ChannelConnection(
            engine=self.engine,
            user=user,
            channel=CHANNEL,
            chat_id=self.chat_id,
            layer=self.channel_layer,
            reply_channel=self.channel_name,
            ip=scope_ip(self.scope),
            via="websocket",
        )
        self.login = self.scope.get("login")
        holds = Holds.from_query(self.scope.get("query_string", b""))
        lists = self.engine.openings.lists
        # F8 and D3: the login's groups (before anything else, so an ending login is never
        # missed) and the chat's (before reading any state, so nothing falls in between), with
        # the other chats the user's last list showed, in one go.
        chats = chat_groups(self.chat_id)
        known = lists.known_groups(user.pk)
        if not known <= chats:
            chats |= known
        logged = self.login.groups() if self.login is not None else ()
        await publish.join(self.channel_layer, (*logged, *chats), self.channel_name)
        if self.login is not None:
            logins.watch().add(self.channel_name, self.login)
        lists.watch(user.pk, self.channel_name, chats)
        self.linked_groups = chats - {self.conn.chat_group}
        listing, current = await self._open_list(holds.dialog_id)
        await self.accept()
        await self.conn.follow(current)
        resume = holds.since is not None and holds.dialog_id == current.dialog_id
        opened = await self.engine.openings.open(
            Opening(current, holds.since, holds.last_id) if resume else Opening(current)
        )
        await self._send_sessions(listing=listing, etag=holds.sessions_etag)
        frame = opened.frame
        self.history_shown(frame["session_id"], frame["history_revision"], opened.recent)
        self.conn.seed(opened.active_turn)
        await self._send(frame)
        self.engine.layer_watch.register(self._layer_lost)

    async def _open_list(self, requested: str | None) -> tuple[SessionList, Session]:
        """The user's list (`_listing`) and the connection's dialog (B1: the requested one,
        else the most recently active within the TTL, else a new one): from the list when it
        shows that dialog, else resolved in the database (a dialog made then is the list's
        newest)."""
        assert self.conn is not None
        listing = await self._listing()
        current = listing.resolved(requested, int(self.engine.cfg["SESSION_TTL_SECONDS"]))
        if current is None:
            with translation.override(self.language):  # B2: a new dialog's welcome
                current = await on_db_idempotent(self.conn.resolve_or_latest)(requested)
            newest = listing.web[0].last_active_at if listing.web else None
            listed = any(s.pk == current.pk for s in listing.web)
            if not listed and (newest is None or current.last_active_at >= newest):
                listing = listing.with_newest(current)  # made just now: the most recent
        return listing, current

    async def dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        # As for client frames (`ChatEventsConsumer.dispatch`): no hop to a thread to close
        # database connections before a connect or after a disconnect (channels' own); their
        # reads run through `on_db`, which does that on the database thread itself.
        if kind == "websocket.connect":
            await self.websocket_connect(message)
        elif kind == "websocket.disconnect":
            await self.disconnect(message["code"])
            raise StopConsumer()
        else:
            await super().dispatch(message)

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
            sockets, mine = self.engine.sockets, (self.scope["user"].pk, self.channel_name)
            if settings.SCALED:  # a Redis round trip off the loop, one for a storm's sockets
                await asyncio.wrap_future(sockets.closes.start(mine))
            else:
                sockets.close(*mine)  # this process's count only

    async def _register(self, user: User) -> bool:
        """F7: count this socket among the user's open ones; past the bound, refuse it with
        a `rate_limited` error frame and close code 4429."""
        limit = int(self.engine.cfg["USER_SOCKETS_MAX"])
        if settings.SCALED:  # a Redis round trip, off the loop, one for a storm's sockets
            started = self.engine.sockets.opens.start((user.pk, self.channel_name, limit))
            opened = await asyncio.wrap_future(started)
        else:
            opened = self.engine.sockets.open(user.pk, self.channel_name, limit)
        if opened:
            self.registered = True
            return True
        await self.accept()
        with translation.override(self.language):
            refusal = RateLimited(
                _("Too many open connections (at most %(n)d); close another tab or app first.")
                % {"n": limit}
            )
        await self._send(events.error_frame_of(refusal))
        await self.close(code=CLOSE_TOO_MANY_SOCKETS)
        return False

    async def disconnect(self, code: int) -> None:
        # The engine keeps running any turn (STYLE 5); only this connection's fan-out ends.
        await self._unregister()
        if self.user is None or self.conn is None:
            return
        self.engine.layer_watch.unregister(self._layer_lost)
        self.engine.openings.lists.unwatch(self.user.pk, self.channel_name)
        if self.sessions_task is not None:
            self.sessions_task.cancel()
        groups = [*self.conn.groups(), *self.linked_groups]
        if self.login is not None:
            logins.watch().discard(self.channel_name)
            groups += self.login.groups()
        await publish.leave(self.channel_layer, groups, self.channel_name)

    async def _layer_lost(self) -> None:
        await self.close(code=CLOSE_RESYNC)

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
            await self._send(events.error_frame_of(exc, client_msg_id))
        except Exception:
            logger.exception("websocket frame failed", extra={"chat_id": self.chat_id})
            await self._send(events.error_frame_of(InternalError(), client_msg_id))

    @staticmethod
    def _parse(text_data: str | None, bytes_data: bytes | None) -> dict[str, Any]:
        return parse_client_frame(text_data, bytes_data)

    async def _target(self, data: dict[str, Any]) -> Session:
        """The dialog a frame is about: its `dialog_id` (one of this user's live dialogs of
        the web chat, else not_found), its `session_id` (that, or a chat-app dialog linked
        to this user), or the connection's current dialog. Writes into a dialog read-only
        for this user are refused on the way to the engine (`read_only`)."""
        assert self.user is not None and self.current is not None
        raw = data.get("dialog_id")
        raw_session = data.get("session_id")
        if raw is not None and raw_session is not None:
            raise BadRequest(_("Name a dialog by dialog_id or by session_id, not both."))
        if raw_session is not None:
            target = await on_db_idempotent(self._session_target)(raw_session)
        elif raw is not None:
            dialog_id = validate_part(raw, field="dialog_id")
            target = await on_db_idempotent(selectors.dialog_get)(
                owner_id=self.user.pk, channel=CHANNEL, chat_id=self.chat_id, dialog_id=dialog_id
            )
        else:
            if self.current_gone:
                assert self.conn is not None
                await self._move(await on_db_idempotent(self.conn.resolve)())
            target = self.current
        assert target is not None
        return target

    def _session_target(self, raw: object) -> Session:
        assert self.user is not None
        if not isinstance(raw, str) or len(raw) > 200:
            raise BadRequest(_("session_id must be a string."))
        # Any live dialog of this user: the web chat's, their API and terminal dialogs (the
        # sidebar lists them, issue 54) and linked chat-app dialogs (A1).
        return selectors.session_get_for_owner(owner_id=self.user.pk, session_id=raw)

    async def _on_send(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        await self._submit(data, client_msg_id, "send")

    async def _on_steer(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        await self._submit(data, client_msg_id, "steer")

    async def _on_inject(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        await self._submit(data, client_msg_id, "inject")

    async def _submit(self, data: dict[str, Any], client_msg_id: str | None, mode: str) -> None:
        assert self.conn is not None
        content = data.get("content")
        if not isinstance(content, str):
            raise BadRequest(_("content must be a string."))
        literal = data.get("literal", False)
        if not isinstance(literal, bool):
            raise BadRequest(_("literal must be true or false."))
        target = await self._target(data)
        attachments = await resolve_attachments(self.conn.user, data.get("attachments"))
        answer = await self.conn.send_or_command(
            content,
            target,
            mode=mode,
            client_msg_id=client_msg_id or "",
            attachments=attachments,
            literal=literal,
        )
        if isinstance(answer, commands.CommandResult):
            await self._command_done(answer, target, client_msg_id)
        else:
            await self._send(answer.frame())

    async def _command_done(
        self, result: commands.CommandResult, target: Session, client_msg_id: str | None
    ) -> None:
        """B3: one `command_result`, then the state frames the command caused."""
        assert self.conn is not None and self.current is not None
        if "history" in result.effects and result.current is not None:
            # /new and /switch move this connection; /delete does when it deleted the
            # connection's own current dialog (a `dialog_id` may name another one).
            moved = not (result.command == "delete" and target.pk != self.current.pk)
            if moved:
                await self.conn.follow(result.current)
        await self._send(
            events.command_result_frame(
                client_msg_id=client_msg_id,
                command=result.command,
                ok=result.ok,
                content=result.content,
            )
        )
        if "sessions" in result.effects:
            await self._send_sessions()
        if "history" in result.effects:
            await self._send_history(self.current)
        if "session" in result.effects and result.current is not None:
            frame = events.session_updated_frame(session=result.current)
            # The same frame also arrives through the chat group; it is not sent twice.
            self.echoed(frame)
            await self._send(frame)

    async def _on_stop(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        # C6: the same path as `/stop`, answered by `command_result` "stop".
        assert self.conn is not None
        target = await self._target(data)
        await self._command_done(await self.conn.stop(target), target, client_msg_id)

    async def _on_retry(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        assert self.conn is not None
        target = await self._target(data)
        await self._send((await self.conn.retry(target, client_msg_id=client_msg_id or "")).frame())

    async def _on_continue(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        # E5: go on with a cut answer; answered by `queued` (mode `continue`) or `error`.
        assert self.conn is not None
        target = await self._target(data)
        ack = await self.conn.continue_answer(target, client_msg_id=client_msg_id or "")
        await self._send(ack.frame())

    async def _on_edit(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        # H1: answered by `queued` (mode `edit`) or `error`.
        assert self.conn is not None
        target = await self._target(data)
        ack = await self.conn.edit(
            target,
            seq=data.get("seq"),
            content=data.get("content"),
            client_msg_id=client_msg_id or "",
        )
        await self._send(ack.frame())

    async def _on_regenerate(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        # H1: answered by `queued` (mode `regenerate`) or `error`.
        assert self.conn is not None
        target = await self._target(data)
        ack = await self.conn.regenerate(
            target, seq=data.get("seq"), client_msg_id=client_msg_id or ""
        )
        await self._send(ack.frame())

    async def _on_branch(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        # H1: answered by `session_history` of the new active path.
        assert self.conn is not None
        target = await self._target(data)
        written = await self.conn.branch(target, seq=data.get("seq"))
        await self._send_history(written, client_msg_id=client_msg_id)

    async def _on_history(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        before_seq = optional_int(data, "before_seq", low=1, high=None)
        limit = optional_int(data, "limit", low=1, high=selectors.HISTORY_PAGE_MAX)
        follow = data.get("follow", False)
        if not isinstance(follow, bool):
            raise BadRequest(_("follow must be true or false."))
        target = await self._target(data)
        if follow and before_seq is None:
            # The dialog becomes this connection's current one: its snapshots stream here
            # (how the web chat opens a linked chat-app dialog, which /switch cannot name).
            self.current_gone = False
            assert self.conn is not None
            await self.conn.follow(target)
        await self._send_history(
            target, before_seq=before_seq, limit=limit, client_msg_id=client_msg_id
        )

    async def _on_sessions(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        await self._send_sessions(client_msg_id)

    async def _on_search(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        # H2: the caller's own live dialogs of this web chat (the ones it can open),
        # answered by `search_results`.
        assert self.user is not None
        limit = optional_int(data, "limit", low=1, high=search.LIMIT_MAX) or 20
        hits, count = await on_db_idempotent(search.search_for_owner)(
            owner_id=self.user.pk, q=data.get("q"), limit=limit, chat=(CHANNEL, self.chat_id)
        )
        await self._send(
            events.search_results_frame(
                q=str(data.get("q")),
                items=[h.as_dict() for h in hits],
                count=count,
                client_msg_id=client_msg_id,
            )
        )

    async def _on_settings(self, data: dict[str, Any], client_msg_id: str | None) -> None:
        """H4: set the dialog's model and/or system prompt; answered by `session_updated`."""
        assert self.conn is not None and self.user is not None
        model, system_prompt = data.get("model"), data.get("system_prompt")
        if model is not None and (not isinstance(model, str) or not model.strip()):
            raise BadRequest(_("model must be a model id."))
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise BadRequest(_("system_prompt must be a string."))
        if model is None and system_prompt is None:
            raise BadRequest(_("Give a model or a system_prompt."))
        target = await self._target(data)
        await on_db_idempotent(selectors.dialog_check_writable)(
            user_id=self.user.pk, session=target
        )
        engine = self.conn.engine
        await rates.acharge(self.user.pk, rates.WRITE, engine.cfg)
        session = await dialog_settings_update(
            engine=engine, session=target, model=model, system_prompt=system_prompt
        )
        frame = events.session_updated_frame(session=session, **settings_changes(session))
        # The same frame also arrives through the chat group; it is not sent twice.
        self.echoed(frame)
        await self._send({**frame, "client_msg_id": client_msg_id} if client_msg_id else frame)

    HANDLERS = {
        "send": _on_send,
        "steer": _on_steer,
        "inject": _on_inject,
        "stop": _on_stop,
        "retry": _on_retry,
        "continue": _on_continue,
        "edit": _on_edit,
        "regenerate": _on_regenerate,
        "branch": _on_branch,
        "history": _on_history,
        "sessions": _on_sessions,
        "search": _on_search,
        "settings": _on_settings,
    }
