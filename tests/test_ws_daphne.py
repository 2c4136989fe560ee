"""`/ws/chat/` on a real Daphne server (`manage.py serve` as a subprocess, embedded mode, its
own SQLite file) with a real WebSocket client library and the fake model server: the frames
of one send in order, the frame limit answered by the consumer (not dropped by Daphne), 4401
for an unauthenticated handshake, and a SIGTERM that ends a running turn as interrupted
(PROTOCOL "WebSocket: /ws/chat/"; SPEC D1, D2, F1, F2, F3, C11)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from websockets.asyncio.client import connect
from websockets.typing import Origin

from tests.fakemodel import FakeModelServer, Reply
from tests.procs import embedded_env, free_port, manage, migrate_embedded, popen_manage

pytestmark = [pytest.mark.slow]


class Server:
    def __init__(self, proc: subprocess.Popen[str], port: int, token: str, db: Path) -> None:
        self.proc = proc
        self.port = port
        self.token = token
        self.db = db
        self.output: list[str] = []

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws/chat/"


@pytest.fixture
def daphne(tmp_path: Path, fake_model: FakeModelServer) -> Iterator[Server]:
    env = embedded_env(tmp_path, LLM_BASE_URL=fake_model.url, LLM_MODEL="fake")
    migrate_embedded(env)
    issued = manage("issue_token", "wsuser", "--create-user", env=env)
    assert issued.returncode == 0, issued.stderr
    token = issued.stdout.strip().splitlines()[-1]
    port = free_port()
    proc = popen_manage(
        "serve", "--port", str(port), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    server = Server(proc, port, token, tmp_path / "chat.sqlite3")
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            server.output.append(line)
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or proc.poll() is not None:
                pytest.fail("serve did not start:\n" + "".join(server.output))
            try:
                if "Serving on" in lines.get(timeout=min(remaining, 1.0)):
                    break
            except queue.Empty:
                continue
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def next_frame(ws: Any, timeout: float = 15.0) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), timeout))
    return frame


async def test_one_send_over_real_daphne(daphne: Server, fake_model: FakeModelServer) -> None:
    # covers: D1, D2, F2 (bearer token, no Origin), F3
    fake_model.script(Reply(text="Streamed through a real Daphne server.", chunk=4, delay=0.01))
    headers = {"Authorization": f"Bearer {daphne.token}"}
    async with connect(daphne.url, additional_headers=headers) as ws:
        sessions = await next_frame(ws)
        history = await next_frame(ws)
        assert sessions["type"] == "sessions" and history["type"] == "session_history"
        assert sessions["current"] == history["dialog_id"]

        await ws.send(json.dumps({"type": "send", "content": "hello", "client_msg_id": "d1"}))
        frames: list[dict[str, Any]] = []
        while not frames or frames[-1]["type"] != "turn_updated":
            frames.append(await next_frame(ws))
        types = [f["type"] for f in frames]
        assert types[:2] == ["queued", "history_delta"]
        assert types[-2:] == ["history_delta", "turn_updated"]
        assert set(types[2:-2]) == {"turn_snapshot"}
        assert frames[0]["client_msg_id"] == "d1" and frames[-1]["status"] == "completed"
        assert frames[1]["base_revision"] == history["history_revision"]
        assert frames[-2]["base_revision"] == frames[1]["history_revision"]
        text = ""
        for f in frames[2:-2]:
            assert f["text_offset"] == len(text)
            text = text[: f["text_offset"]] + f["text"]
        assert text == frames[-2]["messages"][-1]["content"]
        assert text == "Streamed through a real Daphne server."

        # F3, F6: a frame over 256 KiB gets `too_large` from the consumer; the socket lives.
        await ws.send(json.dumps({"type": "send", "content": "z" * 300_000}))
        error = await next_frame(ws)
        assert error["type"] == "error" and error["code"] == "too_large"
        await ws.send(json.dumps({"type": "sessions", "client_msg_id": "alive"}))
        assert (await next_frame(ws))["client_msg_id"] == "alive"

        # Past Daphne's own limit (1 MiB, set on its socket factory): the server drops the
        # connection, so each socket carries the options the server set on its factory.
        await ws.send("z" * (2 * 1024 * 1024))
        with pytest.raises(websockets.ConnectionClosed):
            await next_frame(ws)


async def test_unauthenticated_gets_4401_over_real_daphne(daphne: Server) -> None:
    # covers: F2
    async with connect(daphne.url) as ws:
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
    # A browser-style handshake with a foreign Origin and no session is the same.
    async with connect(daphne.url, origin=Origin("http://evil.example")) as ws:
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401


async def test_sigterm_ends_a_running_turn_as_interrupted_and_the_server_exits(
    daphne: Server, fake_model: FakeModelServer
) -> None:
    # covers: F1, C11 (a graceful shutdown on the serving loop: the running turn's partial
    # answer is kept, marked interrupted, and the process ends by itself)
    answer = "a long answer, slowly " * 40
    fake_model.script(Reply(text=answer, chunk=4, delay=0.05))
    headers = {"Authorization": f"Bearer {daphne.token}"}
    async with connect(daphne.url, additional_headers=headers) as ws:
        await next_frame(ws)
        await next_frame(ws)
        await ws.send(json.dumps({"type": "send", "content": "hello"}))
        while (await next_frame(ws))["type"] != "turn_snapshot":
            pass
        daphne.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                await next_frame(ws)
    assert await asyncio.to_thread(daphne.proc.wait, 30) == 0, "".join(daphne.output)
    with contextlib.closing(sqlite3.connect(daphne.db)) as db:
        turns = db.execute("SELECT status, error_kind FROM sessions_app_turn").fetchall()
        answers = db.execute(
            "SELECT content, status FROM sessions_app_message WHERE role = 'assistant'"
        ).fetchall()
    assert turns == [("failed", "interrupted")]
    assert len(answers) == 1 and answers[0][1] == "interrupted"
    # What had streamed by then, kept (C11).
    assert answers[0][0] and answer.startswith(answers[0][0])
