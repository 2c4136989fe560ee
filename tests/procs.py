"""Helpers for tests that run the project's own commands as subprocesses."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def embedded_env(var_dir: Path, **extra: str) -> dict[str, str]:
    """Embedded mode in its own folder (its own SQLite file), whatever the outer environment
    says about DATABASE_URL and REDIS_URL."""
    return {
        **os.environ,
        "CHAT_VAR_DIR": str(var_dir),
        "DATABASE_URL": "",
        "REDIS_URL": "",
        "DJANGO_DEBUG": "0",
        "LLM_BASE_URL": "",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def manage(
    *args: str, env: dict[str, str], stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


_templates_lock = threading.RLock()
_templates: dict[str | None, Path] = {}


def _copy_database(source_path: Path, folder: Path) -> None:
    target = folder / "chat.sqlite3"
    assert not target.exists(), f"{target} exists already"
    # SQLite's backup API: a consistent copy whatever the journal mode left beside the file.
    source, copy = sqlite3.connect(source_path), sqlite3.connect(target)
    try:
        source.backup(copy)
    finally:
        source.close()
        copy.close()


def _template(demo_password: str | None) -> Path:
    """The database `migrate` (and `ensure_demo_user` with this password) made once this run."""
    with _templates_lock:
        if demo_password not in _templates:
            folder = Path(tempfile.mkdtemp(prefix="chat-template-"))
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            env = embedded_env(folder)
            if demo_password is None:
                done = manage("migrate", "--noinput", env=env)
            else:
                _copy_database(_template(None), folder)
                done = manage(
                    "ensure_demo_user", "--staff", env={**env, "DEMO_PASSWORD": demo_password}
                )
            assert done.returncode == 0, f"template failed:\n{done.stdout}\n{done.stderr}"
            _templates[demo_password] = folder / "chat.sqlite3"
        return _templates[demo_password]


def migrate_embedded(env: dict[str, str], *, demo_user: bool = False) -> None:
    """A migrated database in the embedded-mode folder of `env` (`embedded_env`), as
    `manage.py migrate` leaves it (then `ensure_demo_user` with the env's DEMO_PASSWORD, if
    `demo_user`): the first call of a test run runs the commands on a database of its own,
    later calls copy that one (a fresh file each time, the same content)."""
    assert not env.get("DATABASE_URL"), "migrate_embedded is for embedded mode (its own SQLite)"
    template = _template(env["DEMO_PASSWORD"] if demo_user else None)
    _copy_database(template, Path(env["CHAT_VAR_DIR"]))


def popen_manage(*args: str, env: dict[str, str], **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, text=True, **kwargs
    )


class ServeProcess:
    """`manage.py serve` as a subprocess on a free port, healthy once `start()` returns; a
    test can stop and start it again on the same port and database."""

    STARTUP_DEADLINE_S = 60.0

    def __init__(self, var_dir: Path, env: dict[str, str]) -> None:
        self.env = env
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = var_dir / "serve.log"
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> ServeProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        with self.log_path.open("a") as log:
            self.proc = popen_manage(
                "serve",
                "--port",
                str(self.port),
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + self.STARTUP_DEADLINE_S
        while True:
            assert self.proc.poll() is None, f"serve exited:\n{self.log()}"
            try:
                if httpx.get(f"{self.base}/healthz", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"serve never answered:\n{self.log()}"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""
