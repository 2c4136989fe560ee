"""The terminal channel (E4): `python manage.py chat`. One line of stdin is one send; slash
commands work; replies stream to stdout. At end of input it waits for the last turn, then
exits. It runs its own engine, which shares the database (and its leases) with any server.
It is a `ChannelConnection` like the web chat's socket: the same commands, sends and relay."""

from __future__ import annotations

import asyncio
import sys
import uuid
from typing import Any

from channels.layers import get_channel_layer
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import QuerySet

from chatcore.common import publish
from chatcore.common.dbthreads import on_db
from chatcore.common.errors import ChatError
from chatcore.common.ids import owner_chat_id, validate_part
from chatcore.engine import commands, runtime
from chatcore.engine.engine import Engine
from sessions_app.connection import ChannelConnection
from sessions_app.models import Session

CHANNEL = "cli"


class Terminal:
    """Reads lines, forwards them through a `ChannelConnection`, prints what the chat's
    clients would see."""

    def __init__(
        self, *, user: Any, chat_id: str, dialog_id: str | None, out: Any, err: Any
    ) -> None:
        self.user = user
        self.chat_id = chat_id
        self.dialog_id = dialog_id
        self.out = out
        self.err = err
        self.conn: ChannelConnection | None = None
        self.pending: set[str] = set()
        self.printed: dict[str, str] = {}
        self.all_done = asyncio.Event()
        self.all_done.set()

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    async def run(self) -> None:
        engine = Engine(scope=self._scope)
        await engine.start()
        runtime.set_engine(engine)
        layer = get_channel_layer()
        try:
            conn = self.conn = ChannelConnection(
                engine=engine,
                user=self.user,
                channel=CHANNEL,
                chat_id=self.chat_id,
                layer=layer,
                reply_channel=await layer.new_channel("cli."),
                via="terminal",
            )
            current = await on_db(conn.resolve)(self.dialog_id, create=True)
            await conn.join_chat()
            await conn.follow(current)
            listener = engine.supervisor.spawn("cli-listen", self._listen(conn), daemon=True)
            self.err.write(f"[dialog {current.dialog_id}: {current.title}] /help lists commands\n")
            loop = asyncio.get_running_loop()
            while True:
                line = await loop.run_in_executor(None, sys.stdin.readline)
                if not line:
                    break
                text = line.rstrip("\r\n")
                if not text.strip():
                    continue
                await self._handle(conn, text)
            await self.all_done.wait()
            listener.cancel()
        finally:
            await engine.shutdown(grace=5)
            runtime.set_engine(None)

    def _scope(self, qs: QuerySet[Session]) -> QuerySet[Session]:
        # The terminal resumes only its own chat's interrupted work (C11).
        return qs.filter(channel=CHANNEL, chat_id=self.chat_id)

    async def _handle(self, conn: ChannelConnection, text: str) -> None:
        assert conn.current is not None
        try:
            # D5: each line is a client message with its own id (also what it replies to).
            answer = await conn.send_or_command(text, conn.current, client_msg_id=_line_id())
        except ChatError as exc:
            self.write(f"! {exc.message}\n")
            return
        if isinstance(answer, commands.CommandResult):
            if answer.current is not None:
                await conn.follow(answer.current)
            self.write(answer.content + "\n")
        elif answer.turn_id:
            self.pending.add(answer.turn_id)
            self.all_done.clear()

    async def _listen(self, conn: ChannelConnection) -> None:
        while True:
            for message in publish.unfold(await conn.layer.receive(conn.reply_channel)):
                await self._show(conn, message)

    async def _show(self, conn: ChannelConnection, message: dict[str, Any]) -> None:
        frame = message.get("frame") or {}
        kind = frame.get("type")
        turn_id = frame.get("turn_id")
        if kind == "turn_snapshot" and turn_id in self.pending:
            # D1, D3: the same relay as the web chat's; a gap asks for a full snapshot.
            tail = await conn.relay_snapshot(frame)
            if tail is not None:
                self._print_tail(turn_id, tail)
        elif kind == "history_delta" and turn_id in self.pending:
            answers = [
                m for m in frame["messages"] if m["role"] == "assistant" and not m.get("tool_calls")
            ]
            if answers:
                final = "\n\n".join(m["content"] for m in answers)
                known = self.printed.get(turn_id, "")
                # Print whatever the coalesced snapshots did not show.
                if final.startswith(known):
                    self.write(final[len(known) :])
                elif not known:
                    self.write(final)
                self.printed[turn_id] = final
        elif kind == "turn_updated" and turn_id in self.pending:
            conn.relay.forget(turn_id)
            self._print_end(turn_id, frame)
        elif kind == "system_notification":
            self.err.write(f"[{frame.get('level')}] {frame.get('content')}\n")

    def _print_tail(self, turn_id: str, tail: dict[str, Any]) -> None:
        """Printed text cannot be taken back: a full snapshot (offset 0) only adds what goes
        past what is already on the screen."""
        known = self.printed.get(turn_id, "")
        offset = tail["text_offset"]
        if offset > len(known):
            return
        new = (known[:offset] + tail["text"])[len(known) :]
        if new:
            self.write(new)
            self.printed[turn_id] = known + new

    def _print_end(self, turn_id: str, frame: dict[str, Any]) -> None:
        status = frame["status"]
        if self.printed.get(turn_id):
            self.write("\n")
        if status == "failed":
            self.write(f"! {frame.get('error', {}).get('message', 'failed')}\n")
        elif status == "cancelled":
            self.write(f"[{frame.get('reason', 'cancelled')}]\n")
        elif frame.get("notice"):
            # E5: an answer cut at the length limit or withheld by the filter.
            self.write(f"[{frame['notice']['message']}]\n")
        self.write("\n")
        self.pending.discard(turn_id)
        self.printed.pop(turn_id, None)
        if not self.pending:
            self.all_done.set()


def _line_id() -> str:
    return f"cli-{uuid.uuid4().hex[:16]}"


class Command(BaseCommand):
    help = "Chat in the terminal: one line of input is one message; slash commands work."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--chat-id", help="your chat id (u<id> or u<id>.<name>), or just <name>"
        )
        parser.add_argument("--dialog-id", help="dialog to use (created when missing)")
        parser.add_argument("--user", default="cli", help="username (created when missing)")

    def handle(self, *args: Any, **options: Any) -> None:
        username = options["user"]
        user_model = get_user_model()
        user, _created = user_model.objects.get_or_create(username=username)
        if not user.is_active:
            raise CommandError(f"User {username!r} is inactive.")
        chat_id = self._chat_id(user.pk, options.get("chat_id"))
        dialog_id = options.get("dialog_id")
        try:
            if dialog_id is not None:
                validate_part(dialog_id, field="dialog_id")
        except ChatError as exc:
            raise CommandError(exc.message) from exc
        terminal = Terminal(
            user=user, chat_id=chat_id, dialog_id=dialog_id, out=sys.stdout, err=sys.stderr
        )
        asyncio.run(terminal.run())

    @staticmethod
    def _chat_id(user_pk: int, raw: str | None) -> str:
        own = owner_chat_id(user_pk)
        if not raw:
            return own
        try:
            if raw == own or raw.startswith(own + "."):
                validate_part(raw, field="chat_id")
                return raw
            return owner_chat_id(user_pk, raw)
        except ChatError as exc:
            raise CommandError(exc.message) from exc
