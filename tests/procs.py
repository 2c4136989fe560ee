"""Helpers for tests that run the project's own commands as subprocesses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def popen_manage(*args: str, env: dict[str, str], **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, text=True, **kwargs
    )
