"""`scaled_check`: make sure scaled mode can start (README "Scaled mode", SPEC G).

`make run-scaled` runs it first: DATABASE_URL must name a PostgreSQL database and REDIS_URL a
Redis server, and both must answer. Each problem is one clear line on stderr and exit code 1,
before any process is started.
"""

from __future__ import annotations

import re
from typing import Any

import redis
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connection

CONNECT_TIMEOUT_S = 3


def _redact(url: str) -> str:
    return re.sub(r"//[^/@]*@", "//***@", url)


class Command(BaseCommand):
    help = "Check that DATABASE_URL (PostgreSQL) and REDIS_URL (Redis) are set and answer."

    def handle(self, *args: Any, **options: Any) -> None:
        problems: list[str] = []
        if not settings.DATABASE_URL:
            problems.append(
                "DATABASE_URL is not set: scaled mode needs PostgreSQL, "
                "e.g. DATABASE_URL=postgres://user:password@127.0.0.1:5432/chat"
            )
        elif connection.vendor != "postgresql":
            problems.append(
                f"DATABASE_URL is {connection.vendor}, not PostgreSQL: several processes "
                "cannot share one SQLite file"
            )
        else:
            options = connection.settings_dict.setdefault("OPTIONS", {})
            options["connect_timeout"] = CONNECT_TIMEOUT_S
            # One plain connection: a pool would keep retrying for its own timeout (10 s)
            # after the server refused, instead of answering within CONNECT_TIMEOUT_S.
            options.pop("pool", None)
            try:
                connection.ensure_connection()
            except DatabaseError as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc)
                problems.append(
                    f"PostgreSQL at {_redact(settings.DATABASE_URL)} does not answer: {first}"
                )
        if not settings.REDIS_URL:
            problems.append(
                "REDIS_URL is not set: scaled mode needs Redis for the channel layer and the "
                "Celery broker, e.g. REDIS_URL=redis://127.0.0.1:6379/0"
            )
        else:
            try:
                redis.Redis.from_url(
                    settings.REDIS_URL,
                    socket_connect_timeout=CONNECT_TIMEOUT_S,
                    socket_timeout=CONNECT_TIMEOUT_S,
                ).ping()
            except (redis.RedisError, ValueError) as exc:
                problems.append(f"Redis at {_redact(settings.REDIS_URL)} does not answer: {exc}")
        if problems:
            raise CommandError("scaled mode cannot start:\n  " + "\n  ".join(problems))
        self.stdout.write(
            f"PostgreSQL {_redact(settings.DATABASE_URL)} and Redis "
            f"{_redact(settings.REDIS_URL)} answer."
        )
