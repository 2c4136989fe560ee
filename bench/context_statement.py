"""The turn context's one statement (`selectors.TurnContextStatement`: the newest compaction,
the history window's start, the memory notes, the dialog's revision) against the dialog's
length: it runs before every turn's first token, so its time must not grow with the text of
the whole history.

    .venv/bin/python bench/context_statement.py [--database-url postgres://postgres@127.0.0.1:5432/test]
        [--messages 10,80,400,2000] [--chars 1000] [--max-chars N]

One dialog per length, of `--chars`-character messages and no compaction, on a throwaway
PostgreSQL database on the given server, or without `--database-url` on SQLite in a temporary
folder, beside a hundred other dialogs holding four times the longest one's messages between
them (short ones), so the planner sees a table of many dialogs, as a server's is. The window
holds `--max-chars` characters: by default the read window of the default model's (16
characters per token), so a dialog longer than that is read up to it; with a larger value
than the dialog, the window spans all of it (what a dialog shorter than the read window
costs). Per length it prints the statement's p50 and p90 over 300 runs (after 50 left out)
beside `SELECT 1`'s, each a round trip on the same connection as the statement is sent
alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.servers import in_process_database  # noqa: E402

RUNS, SKIP = 350, 50


def timed(run: Callable[[], object]) -> tuple[float, float]:
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    kept = sorted(times[SKIP:])
    return statistics.median(kept), kept[int(len(kept) * 0.9)]


def main(args: argparse.Namespace) -> None:
    drop = in_process_database(args.database_url, "context-statement-")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatcore.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection
    from django.utils import timezone

    from chatcore.engine.turns.builder import WINDOW_CHARS_PER_TOKEN
    from sessions_app import rows, selectors, services
    from sessions_app.models import Message, Session

    def dialog(owner: Any, name: str, count: int, chars: int) -> Session:
        session = services.session_create(
            owner=owner, channel="web", chat_id=f"u{owner.pk}", dialog_id=name
        )
        now = timezone.now()
        Message.objects.bulk_create(
            Message(
                session=session,
                seq=2 + i,
                role="user" if i % 2 == 0 else "assistant",
                content="x" * chars,
                created_at=now,
            )
            for i in range(count)
        )
        Session.objects.filter(pk=session.pk).update(last_seq=count + 1)
        return session

    try:
        call_command("migrate", verbosity=0)
        owner = get_user_model().objects.create_user("context-bench")
        lengths = [int(n) for n in args.messages.split(",")]
        for other in range(100):
            dialog(owner, f"other{other}", max(lengths) * 4 // 100, 10)
        max_chars = args.max_chars or settings.LLM["CONTEXT_WINDOW"] * WINDOW_CHARS_PER_TOKEN
        print(
            f"{connection.vendor}; messages of {args.chars} characters, no compaction;"
            f" a window of {max_chars} characters"
        )
        print("| messages | context statement p50 / p90 (ms) | SELECT 1 p50 (ms) |")
        print("|---|---|---|")
        sessions = [(count, dialog(owner, f"d{count}", count, args.chars)) for count in lengths]
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("ANALYZE")
        for count, session in sessions:
            statement = selectors.TurnContextStatement(
                session_pk=session.pk, owner_id=owner.pk, max_chars=max_chars, ahead=10
            )

            def context(statement: selectors.TurnContextStatement = statement) -> None:
                with rows.cursor() as cursor:
                    cursor.execute(statement.sql, statement.params)
                    statement.result(cursor.fetchall())

            def select_one() -> None:
                with rows.cursor() as cursor:
                    cursor.execute("SELECT 1")
                    cursor.fetchall()

            p50, p90 = timed(context)
            floor, _ = timed(select_one)
            print(f"| {count} | {p50:.3f} / {p90:.3f} | {floor:.3f} |")
    finally:
        connection.close()
        drop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default="")
    parser.add_argument("--messages", default="10,80,400,2000")
    parser.add_argument("--chars", type=int, default=1000)
    parser.add_argument(
        "--max-chars", type=int, default=0, help="the window's characters (0: the read window's)"
    )
    main(parser.parse_args())
