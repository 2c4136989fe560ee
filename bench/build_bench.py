"""A turn's first build against the dialog's length: the model input and its request body,
walked in full or gone on from the dialog's last build (`turns.carried.Carried`).

    .venv/bin/python bench/build_bench.py [--lengths 100,1000,4000] [--turns 200]

For each length, a dialog of that many stored messages (user questions and 1,000-character
answers, as `compare_bench.py`'s) in the history cache, then `--turns` turns, each appending
an answer and the next question and building the next turn's input
(`TurnInputBuilder.assemble`, then the request body, `encode_body`), once with each build
going on from the last and once walking the window every time (the builder's carried builds
turned off). CPU is the thread's (`time.thread_time`), so the figures hold up on a busy
machine. The budget is the default model window's, so a long dialog's window moves on as it
grows. Each build is given what the turn's context read gives it (`selectors.turn_context`):
the newest messages whose characters fit the read window (16 per token of the model's
window), so past about a thousand of these messages that history's start moves on with
every turn too. No database: the messages are built in memory, as the history cache holds
them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatcore.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.utils import timezone  # noqa: E402

from chatcore.engine.provider_types import EncodedMessages, encode_body  # noqa: E402
from chatcore.engine.sessions import SessionStates  # noqa: E402
from chatcore.engine.turns.builder import (  # noqa: E402
    WINDOW_CHARS_PER_TOKEN,
    RuntimeInfo,
    TurnInputBuilder,
)
from sessions_app.models import Message, MessageKind, Session  # noqa: E402


def message(session: Session, seq: int) -> Message:
    user = seq % 2 == 1
    return Message(
        id=uuid.uuid4(),
        session=session,
        seq=seq,
        role="user" if user else "assistant",
        content=f"question {seq} about the thing" if user else f"answer {seq} " + "a" * 1000,
        created_at=timezone.now(),
        source={"kind": MessageKind.USER_INPUT if user else MessageKind.ASSISTANT},
        status="",
    )


def run(length: int, turns: int, carry: bool) -> list[float]:
    builder = TurnInputBuilder(states=SessionStates(), skills_dir="/none")
    if not carry:
        builder.carried.get = lambda _pk: None  # type: ignore[method-assign]
    session = Session(id=str(uuid.uuid4()), title="t", channel="web", chat_id="c")
    history = [message(session, seq) for seq in range(1, length + 1)]
    runtime = RuntimeInfo(channel="web", dialog_id="d", title="t")
    budget = int(settings.LLM["CONTEXT_WINDOW"] * settings.CHAT["COMPACTION_BUDGET_RATIO"])
    reads = settings.LLM["CONTEXT_WINDOW"] * WINDOW_CHARS_PER_TOKEN
    start, chars = 0, sum(len(m.content) for m in history)
    spent = []
    for _turn in range(turns):
        for _new in range(2):
            history = history + [message(session, len(history) + 1)]
            chars += len(history[-1].content)
        while chars > reads:
            chars -= len(history[start].content)
            start += 1
        session.last_seq = len(history)
        read = history[start:]  # as the history cache gives it after the read window's start
        started = time.thread_time()
        prepared = builder.assemble(
            session=session,
            history=read,
            compaction=None,
            notes=[],
            plan="",
            runtime=runtime,
            pending=[],
            exclude_turn_partials=None,
            budget=budget,
        )
        messages: Any = prepared.messages
        if not isinstance(messages, EncodedMessages):
            messages = EncodedMessages(messages)
        encode_body({"model": "m", "stream": True, "messages": messages})
        spent.append(time.thread_time() - started)
    return spent[turns // 4 :]  # the first builds of each run are its warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="100,1000,4000")
    parser.add_argument("--turns", type=int, default=200)
    args = parser.parse_args()
    print(f"window {settings.LLM['CONTEXT_WINDOW']} tokens; {args.turns} turns per run")
    print("| stored messages | walked every time: CPU p50 (ms) | gone on: CPU p50 (ms) |")
    print("|---|---|---|")
    for length in (int(n) for n in args.lengths.split(",")):
        walked = statistics.median(run(length, args.turns, carry=False)) * 1000
        went_on = statistics.median(run(length, args.turns, carry=True)) * 1000
        print(f"| {length} | {walked:.3f} | {went_on:.3f} |")


if __name__ == "__main__":
    main()
