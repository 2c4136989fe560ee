"""Opening a long dialog with branches (SPEC H1) beside one that never forked.

    .venv/bin/python bench/branch_bench.py [--database-url postgres://postgres@127.0.0.1:5432/test]
        [--messages 10000] [--forks 50] [--chars 200]

Two dialogs of `--messages` messages of `--chars` characters: one straight branch, and one
whose messages fork `--forks` times along the way (each fork a sibling branch of a user
message and its answer, the active path the newest branch at every fork). For each it prints
the p50 and p90 wall time, in ms, of

- `session_history`: the frame a socket sends when the dialog is opened (the newest page of
  its active path, with siblings, the running turn and the queue), over 40 runs;
- `model input`: a turn's input built from the dialog (the builder's own read of its active
  path and the compaction on it, then the walk), this process's history cache warm, over 40
  runs.

On a throwaway PostgreSQL database on the given server, or without `--database-url` on
SQLite in a temporary folder.
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

RUNS, SKIP = 45, 5


def timed(run: Callable[[], object]) -> tuple[float, float]:
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    kept = sorted(times[SKIP:])
    return statistics.median(kept), kept[int(len(kept) * 0.9)]


def fill(session: Any, count: int, forks: int, chars: int) -> None:
    """`count` messages after the welcome; with `forks`, every so often a user message and its
    answer get a sibling pair, and the path goes on from the newer one."""
    from django.utils import timezone

    from sessions_app.models import Message, Role, Session

    now = timezone.now()
    rows: list[Message] = []
    every = max(2, count // (forks + 1)) if forks else 0
    seq, parent = 1, 1
    made = 0
    while len(rows) < count:
        for role in (Role.USER, Role.ASSISTANT):
            seq += 1
            rows.append(
                Message(
                    session=session,
                    seq=seq,
                    parent_seq=parent,
                    role=role,
                    content="x" * chars,
                    created_at=now,
                )
            )
            parent = seq
        if every and made < forks and len(rows) % every < 2 and len(rows) + 2 <= count:
            # A second version of the exchange just written: its user message's sibling.
            fork_parent = rows[-2].parent_seq
            for role in (Role.USER, Role.ASSISTANT):
                seq += 1
                rows.append(
                    Message(
                        session=session,
                        seq=seq,
                        parent_seq=fork_parent,
                        role=role,
                        content="y" * chars,
                        created_at=now,
                    )
                )
                fork_parent = seq
            parent = seq
            made += 1
    Message.objects.bulk_create(rows, batch_size=1000)
    children: dict[int | None, list[int]] = {}
    for m in rows:
        children.setdefault(m.parent_seq, []).append(m.seq)
    Session.objects.filter(pk=session.pk).update(
        last_seq=seq,
        head_seq=parent,
        forked=bool(forks),
        forks={str(p): kin for p, kin in children.items() if len(kin) > 1},
        total_message_count=len(rows) + 1,
    )


def main(args: argparse.Namespace) -> None:
    drop = in_process_database(args.database_url, "branch-bench-")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatcore.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection

    from chatcore.engine.clientstate import session_history_frame
    from chatcore.engine.sessions import SessionStates
    from chatcore.engine.turns.builder import RuntimeInfo, TurnInputBuilder
    from sessions_app import services
    from sessions_app.models import Session

    try:
        call_command("migrate", verbosity=0)
        owner = get_user_model().objects.create_user("brancher")
        print(f"{connection.vendor}, {args.messages} messages of {args.chars} characters")
        print("| dialog | session_history p50 / p90 | model input p50 / p90 |")
        print("|---|---|---|")
        for name, forks in (("straight", 0), (f"{args.forks} forks", args.forks)):
            session = services.session_create(
                owner=owner, channel="web", chat_id=f"u{owner.pk}", dialog_id=f"d{forks}"
            )
            fill(session, args.messages, forks, args.chars)
            session = Session.objects.get(pk=session.pk)
            builder = TurnInputBuilder(states=SessionStates(), skills_dir="/none")
            runtime = RuntimeInfo(channel="web", dialog_id=session.dialog_id, title="t")

            def history(row: Session = session) -> object:
                return session_history_frame(session=row, engine=None)

            def build(
                row: Session = session,
                builder: TurnInputBuilder = builder,
                runtime: RuntimeInfo = runtime,
            ) -> object:
                return builder._build(row.pk, runtime, session=row)

            opened = timed(history)
            built = timed(build)
            print(
                f"| {name} | {opened[0]:.1f} / {opened[1]:.1f} ms "
                f"| {built[0]:.1f} / {built[1]:.1f} ms |"
            )
    finally:
        connection.close()
        drop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default="")
    parser.add_argument("--messages", type=int, default=10000)
    parser.add_argument("--forks", type=int, default=50)
    parser.add_argument("--chars", type=int, default=200)
    main(parser.parse_args())
