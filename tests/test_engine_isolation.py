"""Independent dialogs do not wait for each other's database trouble (issue 10 item 3, A4,
G6): a write being retried waits its backoff on the event loop, not on the database thread,
and a slow context read of one dialog runs on a pool thread of its own. Another dialog's
`/stop` and send are answered meanwhile. The tests check the order of events, never times."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from django.db import OperationalError
from django.db.backends.utils import CursorWrapper

from tests.engine_helpers import (
    history,
    make_dialog,
    send,
    unwrap_engine_statements,
    wrap_engine_statements,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


def _mentions(params: Any, pk: str) -> bool:
    return params is not None and any(str(p) == pk for p in params)


async def test_another_dialogs_stop_and_send_are_answered_while_a_write_is_retried(
    make_engine, user, settings
):
    # covers: A4, G6 (issue 10 item 3: the retry backoff does not hold a database thread)
    # One retry, after a backoff long enough that the other dialog's calls fit in it easily.
    settings.CHAT = {**settings.CHAT, "STORAGE_RETRY_DELAYS_MS": [3000]}
    engine = await make_engine()
    slow = await make_dialog(user, "slow")
    other = await make_dialog(user, "other")
    order: list[str] = []
    failed = threading.Event()
    state = {"failures": 1}

    def fail_once(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        # The slow dialog's admission: its queue item's insert fails once (A4).
        # The turn's INSERT (on PostgreSQL merged with the admission's other writes).
        if 'INSERT INTO "sessions_app_turn"' in sql:
            if _mentions(params, slow.pk):
                order.append("slow dialog: write attempt")
                if state["failures"]:
                    state["failures"] -= 1
                    failed.set()
                    raise OperationalError("injected: database is locked")
        return execute(sql, params, many, context)

    # The engine's queue writes run on the database threads; install the failure there.
    await wrap_engine_statements(fail_once)
    try:
        slow_send = asyncio.ensure_future(send(engine, slow, "kept after a retry"))
        assert await asyncio.to_thread(failed.wait, 30)
        stopped = await engine.stop(other)
        order.append("other dialog: stop answered")
        ack = await send(engine, other, "not held up")
        order.append("other dialog: send answered")
        slow_ack = await asyncio.wait_for(slow_send, 60)
    finally:
        await unwrap_engine_statements(fail_once)
    assert order == [
        "slow dialog: write attempt",
        "other dialog: stop answered",
        "other dialog: send answered",
        "slow dialog: write attempt",
    ]
    assert not stopped.stopped_running and ack.turn_id and slow_ack.turn_id
    await engine.wait_idle()
    # Both sends were kept and answered (C2, A4).
    for session, text in ((slow, "kept after a retry"), (other, "not held up")):
        contents = [m.content for m in await history(session) if m.role == "user"]
        assert text in contents
        assert [m for m in await history(session) if m.role == "assistant"]


async def test_a_slow_history_read_of_one_dialog_does_not_hold_up_another(
    make_engine, fake_model, user, monkeypatch
):
    # covers: F7, G6 (issue 10 item 3: a slow query in one dialog never delays another's
    # stop or admission)
    engine = await make_engine()
    slow = await make_dialog(user, "slow")
    other = await make_dialog(user, "other")
    order: list[str] = []
    reading = threading.Event()
    release = threading.Event()
    real_execute = CursorWrapper._execute

    def slow_history(self: CursorWrapper, sql: str, params: Any, *rest: Any) -> Any:
        # The slow dialog's history read (messages of that dialog, read for its context)
        # blocks, on whichever thread runs it, until the test lets it go.
        if (
            sql.lstrip().upper().startswith("SELECT")
            and "sessions_app_message" in sql
            and _mentions(params, slow.pk)
            and not reading.is_set()
        ):
            reading.set()
            release.wait(60)
            order.append("slow dialog: history read done")
        return real_execute(self, sql, params, *rest)

    monkeypatch.setattr(CursorWrapper, "_execute", slow_history)
    # The read may be the slow dialog's own admission's (PostgreSQL reads a send's context
    # in its admission's round trip, before its locks), so its send answers after it.
    slow_send = asyncio.create_task(send(engine, slow, "a long history"))
    try:
        assert await asyncio.to_thread(reading.wait, 30)
        stopped = await engine.stop(other)
        order.append("other dialog: stop answered")
        ack = await send(engine, other, "not held up")
        order.append("other dialog: send answered")
    finally:
        release.set()
    slow_ack = await asyncio.wait_for(slow_send, 60)
    await engine.wait_idle()
    assert order == [
        "other dialog: stop answered",
        "other dialog: send answered",
        "slow dialog: history read done",
    ]
    assert not stopped.stopped_running and ack.turn_id and slow_ack.turn_id
    for session in (slow, other):
        assert [m for m in await history(session) if m.role == "assistant"]
