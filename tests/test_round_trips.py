"""Database round trips a send costs before its first token (SPEC G6, STYLE 12): every
statement the engine runs from `submit` until the model receives the request, counted on the
thread that runs the engine's ORM calls."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from django.db.backends.utils import CursorWrapper

from tests.engine_helpers import make_dialog, send
from tests.fakemodel import Reply

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]

# G6 asks for at most 3 for a send to an idle dialog. Today a send costs this many statements
# (commits and SQLite's BEGIN not counted), on whichever thread runs them, before its first
# token: admission (lock the dialog, busy check, queue and admission counts, the counter, the
# insert, the position), taking the lease with its epoch, recovery of interrupted turns, the
# fenced claim with the per-user slot check (F7), recording the user message, and reading the
# context (memory, plan, compaction and history on pool threads). Folding these into fewer
# round trips (one admission statement, claim-on-admit for an idle dialog, the user message in
# the claim's transaction) is the remaining work of G6.
ROUND_TRIPS_BEFORE_FIRST_TOKEN = 25  # 24 on SQLite, 25 on PostgreSQL (the owner-row lock)


async def test_round_trips_before_the_first_token_of_a_send_to_an_idle_dialog(
    make_engine, fake_model, user, settings, monkeypatch
):
    # covers: G6 (pinned; see ROUND_TRIPS_BEFORE_FIRST_TOKEN)
    settings.CHAT = {**settings.CHAT, "LEASE_SECONDS": 600, "CHECKPOINT_SECONDS": 600}
    engine = await make_engine(name="counted")
    session = await make_dialog(user)
    await asyncio.sleep(0.5)  # the engine's first sweep runs at start; let it pass
    statements: list[str] = []
    lock = threading.Lock()
    counting = threading.Event()
    real_execute = CursorWrapper._execute

    def count(self: CursorWrapper, sql: str, params: Any, *ignored: Any) -> Any:
        # Every thread: the ORM thread and the pool threads that read the context.
        if counting.is_set() and not sql.startswith("BEGIN"):
            with lock:
                statements.append(sql)
        return real_execute(self, sql, params, *ignored)

    monkeypatch.setattr(CursorWrapper, "_execute", count)
    gate = threading.Event()
    fake_model.script(Reply(text="first token", gate=gate))
    try:
        counting.set()
        await send(engine, session, "hello")
        await fake_model.requests_made(1)
        with lock:
            before_first_token = list(statements)
    finally:
        counting.clear()
        gate.set()
    await engine.wait_idle(session.pk)
    assert len(before_first_token) <= ROUND_TRIPS_BEFORE_FIRST_TOKEN, "\n".join(before_first_token)
