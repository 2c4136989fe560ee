"""Search latency against the number of stored messages (SPEC H2: p95 under 100 ms at a
million messages of 1,000 users on PostgreSQL, and at 100,000 on SQLite).

    .venv/bin/python bench/search_bench.py --database-url postgres://postgres@127.0.0.1:5432/test
        [--messages 1000000] [--users 1000] [--dialogs 20] [--queries 300]
    .venv/bin/python bench/search_bench.py --messages 100000 --users 100     # SQLite

A throwaway database (PostgreSQL on the given server, else SQLite in a temporary folder),
migrated, then filled: `--users` users with `--dialogs` dialogs each, and `--messages`
messages spread over them, user and assistant in turn. Texts are 10 to 60 words drawn with a
Zipf-like skew from a 5,000-word vocabulary (so some words are in a large share of all
messages and others in a handful); one message in five is Chinese, 15 to 60 characters from
the 2,000 most common ones. PostgreSQL loads the messages with COPY, its two search indexes
dropped first and built after (as `CREATE INDEX` on a table one restores); SQLite inserts
them in batches, its triggers filling the FTS5 index. Then `--queries` searches of random
users through `search.search_for_owner` (the REST route's and the WebSocket's selector,
titles and count included), by kind: a frequent word, a rare word, two words, a word being
typed (a prefix), two Chinese characters, four. Prints the load time and p50 / p95 / p99 in
ms per kind and overall; then the time of an import of a `--import-messages` dialog.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.servers import in_process_database  # noqa: E402

VOCABULARY = 5000
# The 2,000 most common Chinese characters stand in for a CJK vocabulary: a contiguous block
# of the CJK Unified Ideographs is close enough for trigram statistics.
CJK = [chr(c) for c in range(0x4E00, 0x4E00 + 2000)]


def words(rng: random.Random) -> list[str]:
    """The vocabulary: pronounceable made-up words, 3 to 10 letters."""
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    out: set[str] = set()
    while len(out) < VOCABULARY:
        n = rng.randint(2, 5)
        out.add("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(n)))
    return sorted(out, key=lambda w: rng.random())


def zipf_weights(n: int) -> list[float]:
    return [1.0 / (rank + 1) for rank in range(n)]


def texts(rng: random.Random, vocab: list[str], count: int) -> Iterator[str]:
    weights = zipf_weights(len(vocab))
    cjk_weights = zipf_weights(len(CJK))
    for _ in range(count):
        if rng.random() < 0.2:
            yield "".join(rng.choices(CJK, cjk_weights, k=rng.randint(15, 60)))
        else:
            yield " ".join(rng.choices(vocab, weights, k=rng.randint(10, 60)))


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def load_postgresql(sessions: list[tuple[str, int]], messages: Iterator[str], total: int) -> None:
    from django.db import connection

    with connection.cursor() as c:
        c.execute("DROP INDEX IF EXISTS idx_message_fts")
        c.execute("DROP INDEX IF EXISTS idx_message_trgm")
    raw = connection.connection
    per_session = max(1, total // len(sessions))
    columns = (
        "id, session_id, seq, role, content, media_refs, tool_call_id, tool_name,"
        " created_at, source, status"
    )
    statement = f"COPY sessions_app_message ({columns}) FROM STDIN"
    with raw.cursor() as cursor, cursor.copy(statement) as copy:
        for i, text in enumerate(messages):
            index = min(i // per_session, len(sessions) - 1)
            copy.write_row(
                (
                    uuid.uuid4(),
                    sessions[index][0],
                    i - index * per_session + 2,
                    "user" if i % 2 == 0 else "assistant",
                    text,
                    "[]",
                    "",
                    "",
                    "2026-01-01T00:00:00+00:00",
                    '{"kind": "user_input"}' if i % 2 == 0 else '{"kind": "assistant"}',
                    "",
                )
            )
    raw.commit()
    with connection.cursor() as c:
        c.execute(
            "CREATE INDEX idx_message_fts ON sessions_app_message USING gin"
            " (to_tsvector('simple'::regconfig, content)) WHERE role IN ('user', 'assistant')"
        )
        c.execute(
            "CREATE INDEX idx_message_trgm ON sessions_app_message USING gin"
            " (content gin_trgm_ops) WHERE role IN ('user', 'assistant')"
        )
        c.execute("ANALYZE")


def load_sqlite(sessions: list[tuple[str, int]], messages: Iterator[str], total: int) -> None:
    from django.db import connection, transaction

    per_session = max(1, total // len(sessions))
    batch: list[tuple[object, ...]] = []

    def flush() -> None:
        with transaction.atomic(), connection.cursor() as c:
            c.executemany(
                "INSERT INTO sessions_app_message (id, session_id, seq, role, content,"
                " media_refs, tool_call_id, tool_name, created_at, source, status)"
                " VALUES (%s, %s, %s, %s, %s, '[]', '', '', '2026-01-01 00:00:00', %s, '')",
                batch,
            )
        batch.clear()

    for i, text in enumerate(messages):
        index = min(i // per_session, len(sessions) - 1)
        seq = i - index * per_session + 2
        role = "user" if i % 2 == 0 else "assistant"
        kind = '{"kind": "user_input"}' if role == "user" else '{"kind": "assistant"}'
        batch.append((uuid.uuid4().hex, sessions[index][0], seq, role, text, kind))
        if len(batch) >= 5000:
            flush()
    if batch:
        flush()
    with connection.cursor() as c:
        c.execute("ANALYZE")


def time_import(count: int, rng: random.Random, vocab: list[str], owner_id: int) -> None:
    """A `chatcore.dialog.v1` document of `count` messages through the import route's two
    steps: read and checked whole, then written."""
    import json

    from django.contrib.auth import get_user_model

    from sessions_app import import_writes, importer

    document = {
        "format": "chatcore.dialog.v1",
        "title": "imported",
        "messages": [
            {
                "seq": i + 1,
                "parent_seq": i or None,
                "role": "user" if i % 2 == 0 else "assistant",
                "content": text,
                "created_at": "2026-01-01T00:00:00+00:00",
            }
            for i, text in enumerate(texts(rng, vocab, count))
        ],
    }
    raw = json.dumps(document).encode()
    owner = get_user_model().objects.get(pk=owner_id)
    started = time.perf_counter()
    dialog = importer.parse_bytes(raw)
    checked = time.perf_counter()
    import_writes.dialog_import(owner=owner, dialog=dialog, announce=False)
    done = time.perf_counter()
    print(
        f"import of {count} messages ({len(raw) / 1e6:.1f} MB): checked in"
        f" {checked - started:.2f} s, written in {done - checked:.2f} s"
    )


def main(args: argparse.Namespace) -> None:
    drop = in_process_database(args.database_url, "search-bench-")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatcore.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection

    from sessions_app import search
    from sessions_app.models import Session

    rng = random.Random(args.seed)
    try:
        call_command("migrate", verbosity=0)
        user_model = get_user_model()
        user_model.objects.bulk_create(
            user_model(username=f"u{i}", password="!")  # noqa: S106 (unusable: no login)
            for i in range(args.users)
        )
        owners = list(user_model.objects.values_list("pk", flat=True))
        vocab = words(rng)
        Session.objects.bulk_create(
            Session(
                owner_id=owner,
                channel="web",
                chat_id=f"u{owner}",
                dialog_id=f"d{d}",
                title=" ".join(rng.choices(vocab[:500], k=3)),
                last_seq=1,
            )
            for owner in owners
            for d in range(args.dialogs)
        )
        sessions = list(Session.objects.order_by("pk").values_list("pk", "owner_id"))
        rng.shuffle(sessions)
        started = time.perf_counter()
        load = load_postgresql if connection.vendor == "postgresql" else load_sqlite
        load(sessions, texts(rng, vocab, args.messages), args.messages)
        loaded = time.perf_counter() - started
        print(
            f"{connection.vendor}: {args.messages} messages, {args.users} users,"
            f" {len(sessions)} dialogs; loaded and indexed in {loaded:.1f} s"
        )

        cjk_weights = zipf_weights(len(CJK))
        kinds: dict[str, Callable[[], str]] = {
            "frequent word": lambda: rng.choice(vocab[:20]),
            "rare word": lambda: rng.choice(vocab[2000:]),
            "two words": lambda: " ".join(rng.choices(vocab[:300], k=2)),
            "prefix": lambda: rng.choice(vocab[:1000])[:4],
            "2 CJK chars": lambda: "".join(rng.choices(CJK[:300], cjk_weights[:300], k=2)),
            "4 CJK chars": lambda: "".join(rng.choices(CJK[:300], cjk_weights[:300], k=4)),
        }
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        hits: dict[str, list[int]] = {kind: [] for kind in kinds}
        for warm in range(10):
            search.search_for_owner(owner_id=rng.choice(owners), q=vocab[warm])
        for i in range(args.queries):
            kind = list(kinds)[i % len(kinds)]
            q = kinds[kind]()
            owner = rng.choice(owners)
            start = time.perf_counter()
            _page, count = search.search_for_owner(owner_id=owner, q=q, limit=20)
            times[kind].append((time.perf_counter() - start) * 1000)
            hits[kind].append(count)
        print("| query | runs | hits (median) | p50 ms | p95 ms | p99 ms |")
        print("|---|---|---|---|---|---|")
        everything: list[float] = []
        for kind, values in times.items():
            everything += values
            print(
                f"| {kind} | {len(values)} | {statistics.median(hits[kind]):.0f}"
                f" | {p(values, 0.5):.1f} | {p(values, 0.95):.1f} | {p(values, 0.99):.1f} |"
            )
        print(
            f"| all | {len(everything)} | | {p(everything, 0.5):.1f}"
            f" | {p(everything, 0.95):.1f} | {p(everything, 0.99):.1f} |"
        )
        if args.import_messages:
            time_import(args.import_messages, rng, vocab, owners[0])
    finally:
        connection.close()
        drop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default="", help="a PostgreSQL server's URL")
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--dialogs", type=int, default=20, help="dialogs per user")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--seed", type=int, default=51)
    parser.add_argument(
        "--import-messages", type=int, default=10_000, help="then time an import (0: none)"
    )
    main(parser.parse_args())
