"""Scaled mode for real in tests (SPEC G): several `manage.py serve` processes and Celery
workers on the test's PostgreSQL database and a private `redis-server` on a free port, with
the fake model server of the test process as their model. Clients talk to them through the
real interfaces: REST with a bearer token, WebSockets with `websockets`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import pytest
import redis
from websockets.sync.client import ClientConnection, connect

from tests.conftest import IN_CI
from tests.procs import ROOT, ServeProcess, free_port


def require_scaled_services() -> None:
    """These tests need PostgreSQL (pass 2 of `make test`) and a `redis-server` binary."""
    from django.db import connection

    missing = []
    if connection.vendor != "postgresql":
        missing.append("PostgreSQL (run with DATABASE_URL set, as pass 2 of make test does)")
    if shutil.which("redis-server") is None:
        missing.append("the redis-server binary")
    if missing:
        reason = "scaled-mode test needs " + " and ".join(missing)
        if IN_CI:
            pytest.fail(reason + " (CI must run it)")
        pytest.skip(reason)


SERVER_APP_NAME = "chat-test-server"


def database_url_of_tests() -> str:
    """The URL of the database pytest-django made for this run, for the subprocesses."""
    from django.db import connection

    s = connection.settings_dict
    auth = quote(s["USER"] or "")
    if s.get("PASSWORD"):
        auth += ":" + quote(s["PASSWORD"])
    host = s.get("HOST") or "127.0.0.1"
    port = f":{s['PORT']}" if s.get("PORT") else ""
    # Named, so a test can drop the servers' connections and never its own.
    return f"postgres://{auth}@{host}{port}/{s['NAME']}?application_name={SERVER_APP_NAME}"


class RedisServer:
    """A private `redis-server` on a free port that a test may stop and start again."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Persistence on: a restart keeps the broker's queued jobs, as a production Redis does.
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--dir",
                str(self.workdir),
                "--logfile",
                str(self.workdir / "redis.log"),
            ]
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                if client.ping():
                    return self
            except redis.ConnectionError:
                pass
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def freeze(self) -> None:
        """SIGSTOP: the server keeps its connections and accepts new ones, and answers
        nothing (unlike a restart), until `thaw`."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.thaw()  # a frozen server must thaw to hear its SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


class Socket:
    """A WebSocket client on one process; a thread collects every frame it receives."""

    def __init__(
        self,
        base: str,
        token: str,
        dialog_id: str | None = None,
        *,
        query: dict[str, Any] | None = None,
    ) -> None:
        url = base.replace("http://", "ws://") + "/ws/chat/"
        if dialog_id:
            url += f"?dialog_id={dialog_id}"
        elif query:
            url += "?" + urlencode(query)  # what a reconnecting client holds (issue 57)
        self._stack = contextlib.ExitStack()
        self.conn: ClientConnection = self._stack.enter_context(
            connect(url, additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=20)
        )
        # Which process answered, when a proxy says so (deploy/nginx.conf adds X-Upstream).
        response = self.conn.response
        self.upstream = response.headers.get("X-Upstream", "") if response is not None else ""
        self.frames: list[dict[str, Any]] = []
        self.closed = threading.Event()
        self.close_code: int | None = None
        self._cond = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:
            while True:
                frame = json.loads(self.conn.recv())
                with self._cond:
                    self.frames.append(frame)
                    self._cond.notify_all()
        except Exception:  # noqa: S110 - a closed connection ends the pump
            pass
        finally:
            self.close_code = self.conn.close_code
            self.closed.set()
            with self._cond:
                self._cond.notify_all()

    def send(self, **frame: Any) -> None:
        self.conn.send(json.dumps(frame))

    def wait_for(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 30.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for frame in self.frames:
                    if pred(frame):
                        return frame
                left = deadline - time.monotonic()
                if left <= 0 or self.closed.is_set():
                    kinds = [f.get("type") for f in self.frames]
                    raise AssertionError(f"no matching frame; got {kinds}")
                self._cond.wait(timeout=min(left, 0.5))

    def terminals(self, turn_id: str) -> list[dict[str, Any]]:
        with self._cond:
            return [
                f for f in self.frames if f["type"] == "turn_updated" and f["turn_id"] == turn_id
            ]

    def terminal(self, turn_id: str, timeout: float = 30.0) -> dict[str, Any]:
        return self.wait_for(
            lambda f: f["type"] == "turn_updated" and f["turn_id"] == turn_id, timeout
        )

    def close(self) -> None:
        self._stack.close()


class Cluster:
    """Scaled mode: N `serve` processes (and Celery workers) on one database and one Redis."""

    def __init__(self, workdir: Path, *, model_url: str, redis_server: RedisServer, **env: str):
        self.workdir = workdir
        self.redis = redis_server
        self.env = {
            **os.environ,
            "DATABASE_URL": database_url_of_tests(),
            "REDIS_URL": redis_server.url,
            "LLM_BASE_URL": model_url,
            "LLM_MODEL": "fake",
            "DJANGO_DEBUG": "0",
            "PYTHONUNBUFFERED": "1",
            "CHAT_RATE_LIMIT_PER_MINUTE": "100000",
            **env,
        }
        self.servers: list[ServeProcess] = []
        self.workers: list[subprocess.Popen[str]] = []

    def serve(self, name: str, **env: str) -> ServeProcess:
        var_dir = self.workdir / name
        var_dir.mkdir(parents=True, exist_ok=True)
        server = ServeProcess(var_dir, {**self.env, "CHAT_VAR_DIR": str(var_dir), **env})
        server.start()
        self.servers.append(server)
        return server

    def worker(self, name: str, *args: str) -> subprocess.Popen[str]:
        """`celery -A chatcore worker` as a subprocess; returns once it consumes."""
        log_path = self.workdir / f"{name}.log"
        with log_path.open("a") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "chatcore",
                    "worker",
                    "--loglevel",
                    "INFO",
                    "--hostname",
                    f"{name}@%h",
                    "--without-gossip",
                    "--without-mingle",
                    *args,
                ],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
        self.workers.append(proc)
        deadline = time.monotonic() + 60
        while "ready." not in log_path.read_text():
            assert proc.poll() is None, f"worker exited:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"worker never ready:\n{log_path.read_text()}"
            time.sleep(0.1)
        return proc

    def stop(self) -> None:
        for server in self.servers:
            # A frozen process must thaw to hear its SIGTERM.
            if server.proc is not None and server.proc.poll() is None:
                os.kill(server.proc.pid, signal.SIGCONT)
            server.stop()
        for proc in self.workers:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)


class Api:
    """REST calls with a bearer token against one process."""

    def __init__(self, base: str, token: str) -> None:
        self.client = httpx.Client(
            base_url=f"{base}/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=30
        )

    def create_dialog(self, *, channel: str, chat_id: str, dialog_id: str) -> str:
        r = self.client.post(
            "/sessions", json={"channel": channel, "chat_id": chat_id, "dialog_id": dialog_id}
        )
        assert r.status_code == 201, r.text
        return str(r.json()["session_id"])

    def send(self, session_id: str, content: str, **extra: Any) -> str:
        r = self.client.post(f"/sessions/{session_id}/messages", json={"content": content, **extra})
        assert r.status_code == 202, r.text
        return str(r.json()["turn_id"])

    def stop(self, session_id: str) -> None:
        r = self.client.post(f"/sessions/{session_id}/stop")
        assert r.status_code in (200, 202), r.text

    def turn(self, turn_id: str) -> dict[str, Any]:
        r = self.client.get(f"/turns/{turn_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def wait_turn(self, turn_id: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            data = self.turn(turn_id)
            if data["status"] in ("completed", "cancelled", "failed"):
                return data
            assert time.monotonic() < deadline, f"turn still {data['status']}"
            time.sleep(0.1)


def wait_until(pred: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} not met in {timeout} s"
        time.sleep(0.05)
