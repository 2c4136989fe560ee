"""Timestamps inside a `serve` process for `bench/send_timeline.py` (never imported otherwise).

Python imports this module at start-up when its folder is on `PYTHONPATH`; it does nothing
unless `SEND_TIMELINE` names the file to write. Once Django is set up it wraps a few of the
engine's functions (the steps of a send, from the WebSocket frame to the first snapshot) to
record, on whatever thread runs them, the time and the thread's CPU time at entry and exit;
`SIGUSR2` writes the per-step medians over the turns seen. A step the code no longer has is
left out with a line in the output, so the tool does not break when the engine changes.
"""

from __future__ import annotations

import os

if os.environ.get("SEND_TIMELINE"):
    import collections
    import functools
    import inspect
    import signal
    import statistics
    import threading
    import time
    from typing import Any

    _LOG: list[tuple[str, float, str, float]] = []
    _MISSING: list[str] = []
    # Turns before this many are the warm-up: left out of the medians.
    _SKIP = int(os.environ.get("SEND_TIMELINE_SKIP", "5"))

    def _mark(name: str) -> None:
        _LOG.append(
            (name, time.perf_counter(), threading.current_thread().name, time.thread_time())
        )

    def _wrap(owner: Any, attr: str, label: str | None = None) -> None:
        fn = getattr(owner, attr, None)
        name = label or attr
        if fn is None:
            _MISSING.append(f"{getattr(owner, '__name__', owner)}.{attr}")
            return
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
                _mark(name + ">")
                try:
                    return await fn(*args, **kwargs)
                finally:
                    _mark(name + "<")

            setattr(owner, attr, wrapped_async)
        else:

            @functools.wraps(fn)
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                _mark(name + ">")
                try:
                    return fn(*args, **kwargs)
                finally:
                    _mark(name + "<")

            setattr(owner, attr, wrapped)

    def _install() -> None:
        import httpx
        from django.db.backends.postgresql import base as pg

        from chatcore.common import dbthreads
        from chatcore.engine import (
            admission,
            admission_batch,
            admission_lock,
            engine,
            provider_net,
            rates,
            snapshots,
            turn_run,
            worker,
        )
        from chatcore.engine.turns import runner
        from sessions_app import consumers, ws_events

        steps: list[tuple[Any, str, str]] = [
            (consumers.ChatConsumer, "receive", "frame received"),
            (engine.Engine, "submit", "submit"),
            (admission, "admit_and_start", "admission"),
            (admission_lock, "lock_for_admission", "locked row and counts"),
            (admission, "start_locked", "turn started in the admission"),
            (admission_batch, "start_locked", "turn started in the admission"),
            (rates, "acharge", "send-rate charge"),
            (pg.DatabaseWrapper, "commit", "COMMIT"),
            (worker.Workers, "open_first_request", "first request opened"),
            (provider_net._Connection, "write", "model socket write"),
            (provider_net._Connection, "read", "model socket read"),
            (engine.Engine, "_prepare_early", "input built beside"),
            (worker.Workers, "start_claimed", "worker started"),
            (worker.Workers, "hand_off", "handed to the worker"),
            (turn_run.TurnRuns, "run", "turn run"),
            (runner.TurnRunner, "_one_request", "model step"),
            (httpx.AsyncClient, "send", "model request"),
            (snapshots, "send_snapshot", "snapshot published"),
        ]
        for owner, attr, label in steps:
            _wrap(owner, attr, label)
        relay = getattr(ws_events.ChatEventsConsumer, "_send", None)
        if relay is None:
            _MISSING.append("ChatEventsConsumer._send")
        else:

            async def send(self: Any, frame: dict[str, Any]) -> Any:
                _mark(f"socket: {frame.get('type')}>")
                try:
                    return await relay(self, frame)
                finally:
                    _mark(f"socket: {frame.get('type')}<")

            ws_events.ChatEventsConsumer._send = send
        # Every call on the database threads, by the function it runs.
        call = getattr(dbthreads, "_call", None)
        if call is None:
            _MISSING.append("dbthreads._call")
        else:

            def _call(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
                name = getattr(getattr(fn, "func", fn), "__name__", "?")
                _mark(f"on a database thread: {name}>")
                try:
                    return call(fn, *args, **kwargs)
                finally:
                    _mark(f"on a database thread: {name}<")

            dbthreads._call = _call

    # `SEND_TIMELINE_LOOP`: "START|END", two steps' marks (`--loop-between`): every callback the
    # event loop runs is timed, and the report adds what ran between the two, per send.
    _LOOP_BETWEEN = os.environ.get("SEND_TIMELINE_LOOP", "")
    _LOOP: list[tuple[float, float, str]] = []

    def _label(callback: Any) -> str:
        """What a loop callback runs: a task's coroutine chain, or the callback by name (a
        transport's read with its protocol's class)."""
        owner = getattr(callback, "__self__", None)
        if owner is not None and hasattr(owner, "get_coro"):
            names = []
            coro = owner.get_coro()
            while coro is not None and len(names) < 3:
                code = getattr(coro, "cr_code", None) or getattr(coro, "ag_code", None)
                if code is None:
                    break
                names.append(code.co_qualname)
                coro = getattr(coro, "cr_await", None)
            return "task " + ("/".join(names) or type(owner.get_coro()).__name__)
        name = getattr(callback, "__qualname__", type(callback).__name__)
        if owner is not None and hasattr(owner, "_protocol"):
            return f"{name} [{type(owner._protocol).__name__}]"
        return str(name)

    if _LOOP_BETWEEN:
        import asyncio.events

        _run = asyncio.events.Handle._run

        def _timed_run(self: Any) -> None:
            label = _label(self._callback)  # before it runs: what its task awaits now
            began = time.perf_counter()
            try:
                _run(self)
            finally:
                _LOOP.append((began, time.perf_counter(), label))

        asyncio.events.Handle._run = _timed_run  # type: ignore[method-assign]

    def _loop_report(sends: int) -> list[str]:
        """The loop's callbacks between the two steps of `SEND_TIMELINE_LOOP`, in each send
        measured: their time inside that span per send, by what they run, largest first."""
        first, last = _LOOP_BETWEEN.split("|", 1)
        log = list(_LOG)
        frames = [at for name, at, _t, _c in log if name == "frame received>"][_SKIP:]
        spans = []
        for frame in frames:
            begin = next((at for name, at, _t, _c in log if name == first and at >= frame), None)
            if begin is None:
                continue
            end = next((at for name, at, _t, _c in log if name == last and at > begin), None)
            if end is not None:
                spans.append((begin, end))
        inside: dict[str, float] = collections.defaultdict(float)
        for began, ended, label in list(_LOOP):
            for begin, end in spans:
                if ended > begin and began < end:
                    inside[label] += (min(ended, end) - max(began, begin)) * 1000
        lines = ["", f"the event loop between {first} and {last}, ms per send (busy, by callback)"]
        if not spans:
            return [*lines, "(no send reached both)"]
        width = statistics.median(end - begin for begin, end in spans) * 1000
        lines.append(f"{'span, p50':<46} {width:8.2f}")
        for label, total in sorted(inside.items(), key=lambda kv: -kv[1])[:20]:
            lines.append(f"{label[:46]:<46} {total / len(spans):8.3f}")
        return lines

    # `SEND_TIMELINE_SLOWEST`: how many of the sends whose first snapshot reached the socket
    # last to print step by step (`--slowest`).
    _SLOWEST = int(os.environ.get("SEND_TIMELINE_SLOWEST") or 0)

    def _slowest(sends: list[list[tuple[str, float, float]]]) -> list[str]:
        """The `_SLOWEST` sends whose first `turn_snapshot` frame went out last, every step."""

        def first_snapshot(events: list[tuple[str, float, float]]) -> float:
            return next((at for name, at, _cpu in events if name == "socket: turn_snapshot>"), 0.0)

        lines = []
        for events in sorted(sends, key=first_snapshot, reverse=True)[:_SLOWEST]:
            lines += ["", f"a slow send: first snapshot at {first_snapshot(events):.2f} ms"]
            lines += [f"{name:<46} {at:8.2f}" for name, at, _cpu in events]
        return lines

    def _write(*_args: Any) -> None:
        turns: list[list[tuple[str, float, float]]] = []
        start = 0.0
        for name, at, _thread, cpu in list(_LOG):
            if name == "frame received>":
                start = at
                turns.append([])
            if turns:
                turns[-1].append((name, (at - start) * 1000, cpu))
        sends = [t for t in turns if any(e[0] == "submit>" for e in t)][_SKIP:]
        reached: dict[str, list[float]] = collections.defaultdict(list)
        inside: dict[str, list[float]] = collections.defaultdict(list)
        for events in sends:
            seen: set[str] = set()
            opened: dict[str, float] = {}
            for name, since, cpu in events:
                if name not in seen:
                    seen.add(name)
                    reached[name].append(since)
                step, edge = name[:-1], name[-1]
                if edge == ">":
                    opened.setdefault(step, cpu)
                elif step in opened:
                    inside[step].append((cpu - opened.pop(step)) * 1000)
        lines = [f"sends measured: {len(sends)} (after {_SKIP} left out)"]
        lines += [f"not found in this code: {name}" for name in _MISSING]
        lines.append("")
        lines.append("step (> entered, < left)                     p50 ms since the frame")
        for name, values in sorted(reached.items(), key=lambda kv: statistics.median(kv[1])):
            if len(values) * 2 < len(sends):
                continue  # a step most sends do not take
            lines.append(f"{name:<46} {statistics.median(values):8.2f}")
        lines.append("")
        lines.append("step                                       thread CPU p50 ms inside")
        for name, values in inside.items():
            if len(values) * 2 < len(sends):
                continue
            lines.append(f"{name:<46} {statistics.median(values):8.2f}")
        if _LOOP_BETWEEN:
            lines += _loop_report(len(sends))
        lines += _slowest(sends)
        with open(os.environ["SEND_TIMELINE"], "w") as out:
            out.write("\n".join(lines) + "\n")

    import django

    _setup = django.setup

    def setup(*args: Any, **kwargs: Any) -> Any:
        result = _setup(*args, **kwargs)
        if not getattr(setup, "installed", False):
            setup.installed = True  # type: ignore[attr-defined]
            _install()
        return result

    django.setup = setup
    signal.signal(signal.SIGUSR2, _write)
