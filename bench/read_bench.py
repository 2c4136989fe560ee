"""A dialog's messages read back, against its length: the thread CPU of the two reads that
grow with it, both on the database threads.

    .venv/bin/python bench/read_bench.py [--database-url postgres://postgres@127.0.0.1:5432/test]
        [--messages 200,2000] [--chars 200]

- `messages_for_context`: every message past the last compaction, in SQL (`rows.from_row`),
  what the history cache is filled from before a dialog's first turn in a process;
- `messages_page`: the newest page of history through the ORM, as the REST API and the web
  chat read it (`HISTORY_PAGE_MAX` messages at most).

One dialog per length, of `--chars`-character messages, on a throwaway PostgreSQL database
on the given server, or without `--database-url` on SQLite in a temporary folder. Per length
it prints the p50 of each read's thread CPU (`time.thread_time`) over 40 runs (after 5 left
out), in ms, and per message in µs.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.servers import in_process_database  # noqa: E402

RUNS, SKIP = 45, 5


def cpu(run: Callable[[], object]) -> float:
    times = []
    for _ in range(RUNS):
        start = time.thread_time()
        run()
        times.append((time.thread_time() - start) * 1000)
    return statistics.median(times[SKIP:])


def main(args: argparse.Namespace) -> None:
    drop = in_process_database(args.database_url, "read-bench-")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatcore.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection
    from django.utils import timezone

    from sessions_app import selectors, services
    from sessions_app.models import Message, Role

    try:
        call_command("migrate", verbosity=0)
        owner = get_user_model().objects.create_user("reader")
        print(f"{connection.vendor}, messages of {args.chars} characters; thread CPU p50")
        print("| messages | messages_for_context | per message | messages_page | per message |")
        print("|---|---|---|---|---|")
        for count in (int(n) for n in args.messages.split(",")):
            session = services.session_create(
                owner=owner, channel="web", chat_id=f"u{owner.pk}", dialog_id=f"d{count}"
            )
            first = session.last_seq + 1
            now = timezone.now()
            Message.objects.bulk_create(
                Message(
                    session=session,
                    seq=first + i,
                    role=Role.USER if i % 2 == 0 else Role.ASSISTANT,
                    content="x" * args.chars,
                    created_at=now,
                )
                for i in range(count)
            )
            whole = cpu(functools.partial(selectors.messages_for_context, session_pk=session.pk))
            page_read = functools.partial(
                selectors.messages_page, session_pk=session.pk, max_bytes=1 << 40
            )
            page, read = cpu(page_read), page_read()[0]
            print(
                f"| {count} | {whole:.2f} ms | {whole / count * 1000:.1f} µs"
                f" | {page:.2f} ms ({len(read)}) | {page / len(read) * 1000:.1f} µs |"
            )
    finally:
        connection.close()
        drop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default="", help="a PostgreSQL server's URL")
    parser.add_argument("--messages", default="200,2000")
    parser.add_argument("--chars", type=int, default=200)
    main(parser.parse_args())
