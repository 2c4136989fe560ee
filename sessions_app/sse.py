"""Server-Sent Events for the REST API (PROTOCOL "REST API", streaming; SPEC C3, D1, D3, F8).

With `Accept: text/event-stream`, POST .../messages (and .../retry, .../continue) answers 200
with a stream of the WebSocket's frames (`event:` = frame type, `id:` = an increasing integer,
`data:` = the frame as JSON): `queued`, then that dialog's `history_delta`s, that turn's
`turn_snapshot`s and its `turn_updated`, where the stream ends. The stream is a
`ChannelConnection` on its own layer channel (groups, snapshot relay). The turn belongs to the
engine, not to the stream: a client that hangs up stops nothing (C3).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from channels.layers import BaseChannelLayer, get_channel_layer
from django.contrib.auth.models import User
from django.http import (
    HttpRequest,
    HttpResponseBase,
    JsonResponse,
    StreamingHttpResponse,
)
from django.utils.translation import gettext as _

from chatcore.common import events, publish
from chatcore.common.dbthreads import on_db_idempotent
from chatcore.common.errors import NotFound
from chatcore.engine import clientstate
from chatcore.engine.engine import Ack, Engine

from . import logins, selectors
from .connection import ChannelConnection
from .models import Session

logger = logging.getLogger(__name__)

# An SSE stream silent this long gets a comment line, so proxies keep it open.
SSE_KEEPALIVE_SECONDS = 15.0
# An idle inject's history delta is published before its acknowledgement returns; this only
# bounds the wait if the channel layer lost it.
SSE_INJECT_WAIT_SECONDS = 5.0
# A terminal found in the database but not yet on the stream gets this long to arrive.
SSE_TERMINAL_GRACE_SECONDS = 2.0
EVENT_STREAM = "text/event-stream"


def wants_stream(request: HttpRequest) -> bool:
    return EVENT_STREAM in request.headers.get("Accept", "")


def ack_body(ack: Ack) -> dict[str, Any]:
    """A `queued` frame as the REST answer's body (without its `type`)."""
    frame = ack.frame()
    frame.pop("type")
    return frame


async def stream(
    *,
    user: User,
    session: Session,
    engine: Engine,
    start: Callable[[], Awaitable[Ack]],
    login: logins.Login | None = None,
) -> HttpResponseBase:
    """Join the dialog's fan-out BEFORE the engine accepts the send, so no frame of its turn
    can pass unseen (D3), then stream that turn. A refusal answers as JSON, as without SSE.
    A steer or inject joins a turn that already runs: the stream then starts from the turn's
    full snapshot, read after joining, so it misses nothing (D3). The stream also joins its
    login's groups: when the login ends it ends too (F8)."""
    layer = get_channel_layer()
    if layer is None:  # no channel layer configured: acknowledge without a stream
        return JsonResponse(ack_body(await start()), status=202)
    conn = ChannelConnection(
        engine=engine,
        user=user,
        channel=session.channel,
        chat_id=session.chat_id,
        layer=layer,
        reply_channel=await layer.new_channel("sse."),
    )
    await conn.join_chat()
    await conn.follow(session)
    if login is not None:
        await logins.join(conn.reply_channel, login)
    try:
        ack = await start()
        joined = None
        if ack.turn_id is not None and ack.mode in ("steer", "inject"):
            joined = await on_db_idempotent(clientstate.active_turn)(session, engine)
    except BaseException:
        await _leave(conn, login)
        raise
    if joined is not None and joined["turn_id"] != ack.turn_id:
        joined = None
    response = StreamingHttpResponse(
        _events(conn, session, ack, joined, login), content_type=EVENT_STREAM
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: do not buffer the stream
    return response


async def _leave(conn: ChannelConnection, login: logins.Login | None) -> None:
    if login is not None:
        await logins.leave(conn.reply_channel, login)
    try:
        await conn.leave()
    except Exception:
        logger.warning("SSE: leaving the dialog's groups failed")


class _Inbox:
    """The stream's channel on the layer. A receive is never cancelled while the stream
    lives: the Redis pub/sub layer drops a channel whose receive is cancelled (and the frames
    sent to it meanwhile), so a keepalive timeout only stops waiting, not receiving."""

    def __init__(self, layer: BaseChannelLayer, channel: str) -> None:
        self.layer = layer
        self.channel = channel
        self._next: asyncio.Future[dict[str, Any]] | None = None
        # The rest of a message that carried several frames (`publish.unfold`).
        self._unfolded: list[dict[str, Any]] = []

    async def get(self, timeout: float) -> dict[str, Any] | None:
        """The next message of one frame, or None after `timeout` seconds of silence."""
        if self._unfolded:
            return self._unfolded.pop(0)
        if self._next is None:
            self._next = asyncio.ensure_future(self.layer.receive(self.channel))
        done, _pending = await asyncio.wait({self._next}, timeout=max(0.0, timeout))
        if not done:
            return None
        received, self._next = self._next, None
        first, *self._unfolded = publish.unfold(received.result())
        return first

    async def close(self) -> None:
        if self._next is not None:
            self._next.cancel()
            await asyncio.gather(self._next, return_exceptions=True)
            self._next = None


async def _events(
    conn: ChannelConnection,
    session: Session,
    ack: Ack,
    joined: dict[str, Any] | None,
    login: logins.Login | None,
) -> AsyncIterator[str]:
    ids = itertools.count(1)
    inbox = _Inbox(conn.layer, conn.reply_channel)

    def event(frame: dict[str, Any]) -> str:
        return f"event: {frame['type']}\nid: {next(ids)}\ndata: {json.dumps(frame)}\n\n"

    try:
        yield event(ack.frame())
        if ack.turn_id is None:
            # C5: an idle inject is no turn; its history delta ends the stream. A steer or
            # inject staged behind queued sends has nothing more to show.
            if ack.session.last_seq > session.last_seq:
                delta = await _idle_inject_delta(inbox, ack)
                if delta is not None:
                    yield event(delta)
            return
        conn.seed(joined)
        if joined is not None:
            yield event(joined)
        async for frame in _turn_frames(inbox, conn, session, ack.turn_id):
            yield event(frame) if frame else ": keepalive\n\n"
    finally:
        # The client may have left (the ASGI handler cancels us): the turn runs on (C3).
        await asyncio.shield(_close(inbox, conn, login))


async def _close(inbox: _Inbox, conn: ChannelConnection, login: logins.Login | None) -> None:
    await inbox.close()
    await _leave(conn, login)


async def _idle_inject_delta(inbox: _Inbox, ack: Ack) -> dict[str, Any] | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SSE_INJECT_WAIT_SECONDS
    while (remaining := deadline - loop.time()) > 0:
        message = await inbox.get(remaining)
        if message is None:
            return None
        frame = message.get("frame") or {}
        if (
            frame.get("type") == "history_delta"
            and frame.get("session_id") == ack.session.session_id
            and frame.get("turn_id") is None
            and frame.get("history_revision") == ack.session.last_seq
        ):
            return dict(frame)
    return None


async def _turn_frames(
    inbox: _Inbox, conn: ChannelConnection, session: Session, turn_id: str
) -> AsyncIterator[dict[str, Any] | None]:
    """The frames one client of this dialog would see for the turn; None = keepalive."""
    session_id = session.session_id
    loop = asyncio.get_running_loop()
    stored: dict[str, Any] | None = None
    give_up = 0.0
    while True:
        wait = SSE_KEEPALIVE_SECONDS if stored is None else give_up - loop.time()
        message = await inbox.get(wait)
        if message is None:
            if stored is not None:
                # The layer lost the terminal: end with the stored one.
                yield stored
                return
            # Silence: also the moment to notice a terminal the layer failed to deliver. It
            # may only be in flight (stored before it is published), so wait a little more.
            stored = await on_db_idempotent(_stored_terminal)(session, turn_id)
            give_up = loop.time() + SSE_TERMINAL_GRACE_SECONDS
            yield None
            continue
        if message.get("type") == logins.LOGIN_ENDED:
            # F8: the login ended; the turn runs on (C3), this stream does not.
            yield events.login_ended_frame(_("Your login ended: sign in again."))
            return
        frame = message.get("frame")
        if not isinstance(frame, dict) or frame.get("session_id") != session_id:
            continue
        kind = frame.get("type")
        if kind == "turn_snapshot":
            if frame.get("turn_id") != turn_id:
                continue
            out = await conn.relay_snapshot(frame)
            if out is not None:
                yield out
        elif kind == "turn_updated":
            if frame.get("turn_id") != turn_id:
                continue
            yield frame
            if clientstate.is_terminal_frame(frame):
                return
        elif kind in ("history_delta", "session_updated", "system_notification"):
            yield frame


def _stored_terminal(session: Session, turn_id: str) -> dict[str, Any] | None:
    try:
        turn = selectors.turn_get_for_owner(owner_id=session.owner_id, turn_id=turn_id)
    except NotFound:
        return None
    if not turn.is_terminal:
        return None
    error = None
    if turn.error_kind:
        error = {"kind": turn.error_kind, "message": turn.error_message}
    return events.turn_updated_frame(
        session_id=session.session_id,
        turn_id=turn_id,
        status=turn.status,
        reason=turn.reason,
        error=error,
        client_msg_id=turn.client_msg_id,
    )
