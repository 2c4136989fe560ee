"""A server process's heap and Python's cyclic garbage collector (issue 10).

A collection stops the whole process while it runs: the event loop, and with it every
stream, every lease renewal and every socket of the process. A full (oldest-generation)
collection walks every object the collector tracks; in a serving process most of those are
what the process loaded once and keeps for good (modules, settings, URL patterns, models,
the tokenizer's tables), so each full pass walked hundreds of thousands of objects and
stopped the loop for 100-150 ms under load, in the middle of a burst of first tokens.

`settle()`, called by `serve` once the engine has started, collects once and freezes what
is alive then (`gc.freeze`): those objects are never walked again; what connections and turns
allocate from then on is collected as before, but less often: the youngest generation is
collected after `young` allocations (`CHAT_GC_YOUNG_THRESHOLD`, 20,000) rather than Python's
700. A socket keeps a few hundred objects for its whole life, so a reconnect storm of
thousands made Python's default collect the young generation every few sockets and the whole
heap six times per 3,000 sockets, a tenth to a sixth of the storm's CPU (issue 57:
`bench/reconnect_bench.py`); at 20,000 the storm pays about a fifth of that, and no pause is
longer than a young collection of 20,000 objects (a few ms) or a middle one (under 0.1 s).
It also starts timing every collection, so `/healthz` shows what the collector cost the
process since (`report()`): an operator sees a stalling server in numbers rather than
guessing.
"""

from __future__ import annotations

import gc
import time
from typing import Any

_began: float | None = None
_frozen = 0
_collections = 0
_total = 0.0
_longest = 0.0


def settle(young: int = 20_000) -> None:
    """Collect, then take everything alive out of the collector's view, collect the youngest
    generation after `young` allocations, and time the collections from here on. Idempotent:
    a second call freezes what was added since."""
    global _frozen
    gc.collect()
    gc.freeze()
    _threshold, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, old)
    # Counted once, here: `gc.get_freeze_count()` walks every frozen object, which on a
    # settled server takes milliseconds with the GIL held (not for a health check to repeat).
    _frozen = gc.get_freeze_count()
    if _watch not in gc.callbacks:
        gc.callbacks.append(_watch)


def _watch(phase: str, info: dict[str, Any]) -> None:
    global _began, _collections, _total, _longest
    if phase == "start":
        _began = time.perf_counter()
        return
    if _began is None:
        return
    took = time.perf_counter() - _began
    _began = None
    _collections += 1
    _total += took
    _longest = max(_longest, took)


def report() -> dict[str, Any]:
    """What the collector did since `settle()`: objects kept out of its view, collections,
    their total and their longest pause (ms). Empty where `settle()` was not called (a
    process other than `serve`)."""
    if _watch not in gc.callbacks:
        return {}
    return {
        "frozen_objects": _frozen,
        "young_threshold": gc.get_threshold()[0],
        "collections": _collections,
        "pause_ms_total": round(_total * 1000, 1),
        "longest_pause_ms": round(_longest * 1000, 1),
    }
