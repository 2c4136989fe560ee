"""A burst's admissions on PostgreSQL, alone against together: per send, the admitting
thread's CPU and wall time for sends to idle dialogs admitted and started one transaction
each (`admission.admit_and_start`) and a batch per transaction
(`admission_batch.admit_and_start_many`).

    .venv/bin/python bench/admission_bench.py \\
        --database-url postgres://postgres@127.0.0.1:5432/test [--sends 96] [--batch 32]

CPU is thread CPU time (`time.thread_time`): in a burst the serving process is CPU-bound,
and this is what each send costs the database threads under the one interpreter lock. Each
repetition measures both ways on fresh dialogs of their own (one user each), alone first and
together first in turn; the figures are medians over the repetitions, with their ranges. It
creates a throwaway database on the given server and drops it afterwards.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.servers import throwaway_database  # noqa: E402


def dialogs(count: int, tag: str) -> list[Any]:
    from django.contrib.auth import get_user_model

    from sessions_app import services

    out = []
    for i in range(count):
        owner = get_user_model().objects.create_user(f"{tag}{i}")
        out.append(services.session_create(owner=owner, channel="web", chat_id=f"u{owner.pk}"))
    return out


def inbound(session: Any) -> Any:
    from chatcore.engine.ingress import Inbound

    return Inbound(
        owner=session.owner,
        channel="web",
        chat_id=session.chat_id,
        content="What does a batch of admissions cost?",
        sender_id=str(session.owner_id),
    )


def alone(sessions: list[Any]) -> tuple[float, float]:
    from django.conf import settings

    from chatcore.engine import admission
    from chatcore.engine.sessions import SessionStates

    wall, cpu = time.perf_counter(), time.thread_time()
    for session in sessions:
        _ack, started = admission.admit_and_start(
            inbound(session), session, cfg=settings.CHAT, states=SessionStates(), start_as="b"
        )
        assert started is not None
    return time.perf_counter() - wall, time.thread_time() - cpu


def together(sessions: list[Any], size: int) -> tuple[float, float]:
    from django.conf import settings

    from chatcore.engine import admission_batch
    from chatcore.engine.sessions import SessionStates

    wall, cpu = time.perf_counter(), time.thread_time()
    for first in range(0, len(sessions), size):
        batch = [
            admission_batch.Admission(inbound(s), s, "b") for s in sessions[first : first + size]
        ]
        outcomes = admission_batch.admit_and_start_many(
            batch, cfg=settings.CHAT, states=SessionStates()
        )
        assert all(isinstance(o, tuple) for o in outcomes), outcomes
    return time.perf_counter() - wall, time.thread_time() - cpu


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(args: argparse.Namespace) -> None:
    url, drop = throwaway_database(args.database_url)
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatcore.settings")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    try:
        call_command("migrate", verbosity=0)
        figures: dict[str, list[float]] = {k: [] for k in ("aw", "ac", "tw", "tc")}
        for rep in range(args.repeat):
            one, other = dialogs(args.sends, f"a{rep}_"), dialogs(args.sends, f"t{rep}_")
            connection.close()  # a fresh connection for each: its statements prepared anew
            if rep % 2:
                tw, tc = together(other, args.batch)
                aw, ac = alone(one)
            else:
                aw, ac = alone(one)
                tw, tc = together(other, args.batch)
            for key, value in (("aw", aw), ("ac", ac), ("tw", tw), ("tc", tc)):
                figures[key].append(value / args.sends * 1000)
        print(
            f"{args.sends} sends to idle dialogs, batches of {args.batch}; ms per send, median"
            f" of {args.repeat} [range]"
        )
        print("| admitted | CPU of the admitting thread | wall |")
        print("|---|---|---|")
        print(f"| alone, a transaction each | {cell(figures['ac'])} | {cell(figures['aw'])} |")
        print(
            f"| together, a transaction per batch | {cell(figures['tc'])} | {cell(figures['tw'])} |"
        )
    finally:
        connection.close()
        drop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True, help="a PostgreSQL server's URL")
    parser.add_argument("--sends", type=int, default=96)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    main(parser.parse_args())
