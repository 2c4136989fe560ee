"""Helpers for engine tests: make a dialog, send, and read what clients would see."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg
from asgiref.sync import sync_to_async

from chatcore.common import dbthreads, publish
from chatcore.engine.engine import Engine, Inbound
from sessions_app import services
from sessions_app.models import Message, Session, Turn


async def make_dialog(user: Any, dialog_id: str = "default", channel: str = "web") -> Session:
    return await sync_to_async(services.session_create)(
        owner=user, channel=channel, chat_id=f"u{user.pk}", dialog_id=dialog_id
    )


def chat_group_of(session: Session) -> str:
    return publish.chat_group(session.channel, session.chat_id)


async def send(
    engine: Engine, session: Session, content: str, mode: str = "send", **kw: Any
) -> Any:
    inbound = Inbound(
        owner=session.owner,
        channel=session.channel,
        chat_id=session.chat_id,
        content=content,
        sender_id=str(session.owner_id),
        mode=mode,
        **kw,
    )
    return await engine.submit(inbound, session)


async def history(session: Session) -> list[Message]:
    return await sync_to_async(
        lambda: list(Message.objects.filter(session_id=session.pk).order_by("seq"))
    )()


async def turn(turn_id: str) -> Turn:
    return await sync_to_async(Turn.objects.get)(pk=turn_id)


async def wrap_engine_statements(wrapper: Any) -> None:
    """Install a statement wrapper (`connection.execute_wrapper` style) on the connection of
    every thread the engine's database calls run on."""
    from django.db import connection

    await asyncio.to_thread(
        dbthreads.on_every_thread, lambda: connection.execute_wrappers.append(wrapper)
    )


async def unwrap_engine_statements(wrapper: Any) -> None:
    from django.db import connection

    await asyncio.to_thread(
        dbthreads.on_every_thread, lambda: connection.execute_wrappers.remove(wrapper)
    )


class Exchanges:
    """The round trips on `conn`: how many times the client, with nothing left to send,
    waited for the server's answer (results read while a pipeline is still sending its
    statements are part of the pipeline's one, not one more). At most the round trips made:
    an answer that is back before the client looks for it (psycopg's BEGIN in a pipeline,
    on a busy machine) needs no wait and is not counted, so tests pin an upper bound."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.count = conn, 0
        self.real = conn.wait

    def __enter__(self) -> Exchanges:
        def wait(gen: Any, *args: Any, **kwargs: Any) -> Any:
            return self.real(self._counted(gen), *args, **kwargs)

        self.conn.wait = wait
        return self

    def _counted(self, gen: Any) -> Any:
        sent = None
        try:
            while True:
                wanted = gen.send(sent)
                sent = yield wanted
                # Waiting to read only (nothing left to send), and the answer came in.
                if wanted == psycopg.waiting.Wait.R and sent & psycopg.waiting.Ready.R:
                    self.count += 1
        except StopIteration as stop:
            return stop.value

    def __exit__(self, *exc: Any) -> None:
        del self.conn.wait


class HoldFirst:
    """A statement wrapper on every engine database thread (`async with`): the first
    statement `holds` matches waits there until `release()` (so calls made meanwhile gather
    for a batch); each statement `note` returns a value for is recorded in `seen`."""

    def __init__(self, holds: Any, note: Any = None) -> None:
        self.holds, self.note = holds, note
        self.seen: list[Any] = []
        self._holding, self._released = threading.Event(), threading.Event()

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        noted = self.note(sql, params) if self.note is not None else None
        if noted is not None:
            self.seen.append(noted)
        if self.holds(sql) and not self._holding.is_set():
            self._holding.set()
            self._released.wait(10)
        return execute(sql, params, many, context)

    async def reached(self) -> None:
        """Until the first matching statement is held."""
        assert await asyncio.to_thread(self._holding.wait, 10), "nothing was held"

    def release(self) -> None:
        self._released.set()

    async def __aenter__(self) -> HoldFirst:
        await wrap_engine_statements(self)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.release()
        await unwrap_engine_statements(self)


async def until_waiting(waiting: Any, count: int, what: str) -> None:
    """Until `count` calls wait for a batch (`waiting`: a batcher's list of waiting calls,
    `Gathered._waiting`)."""
    deadline = asyncio.get_running_loop().time() + 10
    while len(waiting()) < count:
        assert asyncio.get_running_loop().time() < deadline, f"{what} did not gather"
        await asyncio.sleep(0.01)


def gated_answers(gate: Any) -> Any:
    """A model reply for the fake model: "the answer to <the last message>", held before its
    end until `gate` is set."""
    from tests.fakemodel import Reply, strip_runtime

    def reply(request: dict[str, Any]) -> Reply:
        question = strip_runtime(request["messages"][-1]["content"])
        return Reply(text=f"the answer to {question}", gate=gate)

    return reply
