"""A dialog's last build of its stored history, carried to its next one (C7, STYLE 18): the
window the budget kept (`Window`), what it walked (`Carried`), the bounded store of them
(`CarriedBuilds`), and `go_on`, which makes items only for the messages stored since and moves
the budget's start on, so a turn's first build costs what was added, not the dialog's length."""

from __future__ import annotations

import bisect
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sessions_app.models import Message

from .items import REPLAYED, Item, json_of, replayed


@dataclass(frozen=True, slots=True)
class Carried:
    """What a build of a dialog's stored history alone left for the dialog's next one
    (`TurnInputBuilder.assemble`): the history it walked (its first and last message, their
    seqs and its length) and the window the budget kept of it: its items (tool pairs
    checked, old results trimmed), their messages and each one's JSON, what the budget left
    out before it, and its tokens. The next build makes items for the messages appended
    since and moves the window's start on, instead of walking, counting and joining the
    whole window again (STYLE 18: the cost of a turn's first build no longer grows with the
    dialog). Never changed once made."""

    # What the walk depends on besides the messages: the dialog's generation (C9: a history
    # changed in place), the compaction's end, the budget, the head's tokens, the counter.
    key: tuple[Any, ...]
    first: Any
    last: Any
    first_seq: int
    last_seq: int
    walked: int
    window: Window


@dataclass(frozen=True, slots=True)
class Window:
    """The items of a model input the budget keeps, in order, with their messages and each
    one's JSON (the body is those messages), how many items it left out before them, their
    tokens, the bytes of their JSON; `before`, the seqs of the items left out (ascending),
    and `hazard`, the seq of the first of them that is not a stored message's own item as it
    is (a tool's call or result, an answer joined with its continuation: 0 for none).

    With them, a history whose start moved on into what was left out (the read window of a
    dialog longer than it, `selectors.turn_context`) is one the window goes on from: its
    walk would leave out the items of `before` from that start on, and make the same items
    of the messages it still holds. Unless a tool's call or a cut answer is before that start
    and its result or continuation after it, which that walk makes differently (an orphan
    result dropped, a continuation on its own): so a start past `hazard` walks again, and
    that walk's window knows nothing of what is before its history."""

    items: list[Item]
    datas: list[dict[str, Any]]
    jsons: list[bytes]
    dropped: int
    kept: int
    size: int
    before: array[int]
    hazard: int

    @classmethod
    def of(cls, items: list[Item], start: int, kept: int, *, plain: bool) -> Window:
        """`plain`: every one of `items` is a stored message's own, as it is (its walk met
        no tool's message, continuation or empty answer): none is looked at for `hazard`."""
        window = items[start:]
        datas = [it.data for it in window]
        jsons = [json_of(data) for data in datas]
        before, hazard = left_out(items[:start], array("q"), 0, plain=plain)
        return cls(window, datas, jsons, start, kept, sum(map(len, jsons)), before, hazard)

    @property
    def held_bytes(self) -> int:
        """What it holds, as `CarriedBuilds` counts it: its JSON and the seqs left out."""
        return self.size + len(self.before) * self.before.itemsize


def left_out(
    items: list[Item], before: array[int], hazard: int, *, plain: bool = False
) -> tuple[array[int], int]:
    """`Window`'s `before` and `hazard` with `items`, newly left out by the budget, after
    those left out already (`plain`: as for `Window.of`)."""
    seqs = array("q", [it.seq for it in items])
    if not hazard and not plain:
        for it in items:
            data, key = it.data, it.key
            # A joined answer's or a trimmed result's key is a tuple; a checked call's None.
            if key is None or type(key) is tuple or data["role"] == "tool" or "tool_calls" in data:
                hazard = it.seq
                break
    return (before + seqs if seqs else before), hazard


class CarriedBuilds:
    """The last `Carried` of each dialog built here, least recently used first out once
    their messages' JSON passes `max_bytes` (the history cache holds the same messages while
    it holds the dialog; this bounds what outlives it). Safe to use from every database
    thread."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._held: OrderedDict[str, Carried] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, session_pk: str) -> Carried | None:
        with self._lock:
            return self._held.get(session_pk)

    def put(self, session_pk: str, carried: Carried) -> None:
        with self._lock:
            old = self._held.pop(session_pk, None)
            if old is not None:
                self._bytes -= old.window.held_bytes
            self._held[session_pk] = carried
            self._bytes += carried.window.held_bytes
            while self._bytes > self.max_bytes and self._held:
                _pk, gone = self._held.popitem(last=False)
                self._bytes -= gone.window.held_bytes


def go_on(
    carried: Carried,
    key: tuple[Any, ...],
    history: list[Message],
    through: int,
    budget: int,
    count: Any,
) -> Window | None:
    """The window `TurnInputBuilder.assemble`'s walk of `history` keeps, from the dialog's
    last build's. None (walk it all) unless `history` is the one `carried` walked with only
    messages appended since, none of them a tool's call or result or a continuation (whose
    items change an earlier one), and the walk's inputs are the same (a message that is none
    of those changes no tool pair and no earlier item). The window's start only moves on: the
    items before it did not fit then, and fit less with more after them. `history` may also
    start later than the one walked, in what the budget left out (a dialog longer than the
    read window): then what is left out before its start is no longer counted (`Window`)."""
    if carried.key != key or not history:
        return None
    was = carried.window
    start_seq = history[0].seq
    before, dropped = was.before, was.dropped
    if start_seq == carried.first_seq:
        if history[0].pk != carried.first:
            return None
        last = carried.walked - 1
    elif (
        start_seq > carried.first_seq
        and (not was.hazard or was.hazard >= start_seq)
        and (not was.items or was.items[0].seq >= start_seq)
    ):
        # Seqs run on without a gap; a history that does not fails the check below.
        last = carried.last_seq - start_seq
        gone = bisect.bisect_left(before, start_seq)
        before, dropped = before[gone:], dropped - gone
    else:
        return None
    if not 0 <= last < len(history) or history[last].pk != carried.last:
        return None
    added: list[Item] = []
    for m in history[last + 1 :]:
        r = m.__dict__.get(REPLAYED) or replayed(m)
        if r.skipped or m.seq <= through or r.empty:
            continue  # as `TurnInputBuilder._walk` (an empty answer is never replayed, E5)
        if not r.plain:
            return None
        added.append(r.item)
    items, kept, size = was.items, was.kept, was.size
    datas, jsons = was.datas, was.jsons
    if added:
        more = [json_of(it.data) for it in added]
        items, datas, jsons = items + added, datas + [it.data for it in added], jsons + more
        kept += sum(count(it) for it in added)
        size += sum(map(len, more))
    head_total = key[3]
    start = 0
    # As `TurnInputBuilder._walk`'s walk back: the newest item is kept whatever it costs, and
    # the window never starts with a tool's result.
    while start < len(items) - 1 and head_total + kept > budget:
        kept -= count(items[start])
        start += 1
    while start and start < len(items) and items[start].data["role"] == "tool":
        kept -= count(items[start])
        start += 1
    if not start:
        return Window(items, datas, jsons, dropped, kept, size, before, was.hazard)
    size -= sum(map(len, jsons[:start]))
    before, hazard = left_out(items[:start], before, was.hazard)
    return Window(
        items[start:], datas[start:], jsons[start:], dropped + start, kept, size, before, hazard
    )
