"""A chat-app answer left open by a killed server process is closed by the next one as soon as
it starts, with no platform message needed to wake it (SPEC C11, D4; issue 13). Real `serve`
processes on one SQLite file, the fake Bot API server and the fake model on loopback."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fakemodel import FakeModelServer, Reply
from tests.fakeplatforms import TELEGRAM_TOKEN, FakeTelegram
from tests.procs import ServeProcess, embedded_env, migrate_embedded

pytestmark = [pytest.mark.slow]

SECRET = "restart-s3cret"


@pytest.fixture
def fake_telegram() -> Iterator[FakeTelegram]:
    server = FakeTelegram().start()
    try:
        yield server
    finally:
        server.stop()


def checkpointed(var_dir: Path) -> str:
    """The running turn's checkpointed partial text, in the server's own database."""
    import sqlite3

    with sqlite3.connect(var_dir / "chat.sqlite3", timeout=5) as db:
        row = db.execute(
            "SELECT partial_text FROM sessions_app_turn WHERE status = 'running'"
        ).fetchone()
    return str(row[0] or "") if row else ""


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_an_answer_left_open_by_a_killed_process_is_closed_after_a_restart(
    tmp_path: Path, fake_model: FakeModelServer, fake_telegram: FakeTelegram
) -> None:
    # covers: C11, D4 (the reconcile loop starts with the engine of every serve process)
    env = embedded_env(
        tmp_path,
        LLM_BASE_URL=fake_model.url,
        TELEGRAM_BOT_TOKEN=TELEGRAM_TOKEN,
        TELEGRAM_WEBHOOK_SECRET=SECRET,
        TELEGRAM_API_BASE=fake_telegram.url,
        # A short lease, so the restarted process takes the dead one's dialog over soon.
        CHAT_LEASE_SECONDS="3",
        # ... and closes the open answer a second after the turn ended (5 s by default),
        # looking every second (2 s by default).
        CHAT_DELIVERY_ORPHAN_GRACE_SECONDS="1",
        CHAT_DELIVERY_RECONCILE_SECONDS="1",
    )
    migrate_embedded(env)
    fake_model.script(Reply(text="partial words ", endless=True, delay=0.05))
    update = fake_telegram.update("write forever")
    own = str(update["message"]["message_id"])

    def answer() -> Any:
        return next((m for m in fake_telegram.bot_messages() if m.reply_to == own), None)

    server = ServeProcess(tmp_path, env)
    server.start()
    try:
        response = httpx.post(
            f"{server.base}/channels/telegram/webhook",
            json=update,
            headers={"X-Telegram-Bot-Api-Secret-Token": SECRET},
            timeout=30,
        )
        assert response.status_code == 200 and response.json()["result"] == "send"
        wait_until(lambda: answer() and answer().edits, 30, "the answer to stream")
        # C11: what survives the kill is the turn's last checkpoint (once a second): wait
        # until it holds the words the platform shows.
        wait_until(lambda: checkpointed(tmp_path).startswith("partial words"), 30, "a checkpoint")
    finally:
        assert server.proc is not None
        server.proc.kill()  # no graceful shutdown: the answer stays open on the platform
        server.proc.wait(timeout=10)
        server.proc = None
    open_text = answer().text
    assert open_text.startswith("partial words") and "⚠" not in open_text

    restarted = ServeProcess(tmp_path, env)
    restarted.start()
    try:
        # No update is posted: the new process recovers the turn (C11) and closes its message.
        message = wait_until(
            lambda: (m := answer()) is not None and "⚠" in m.text and m, 90, "the closing edit"
        )
    finally:
        restarted.stop()
    assert message.text.startswith("partial words")
    assert len([e for e in message.edits if "⚠" in e]) == 1
