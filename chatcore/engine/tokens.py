"""Token counting for the model input (C7, F7, STYLE 18).

Counts come from a real BPE tokenizer when the model is one whose tables ship offline with
`bpe-openai` (OpenAI's o200k/cl100k families: its wheels bundle the tables, nothing is
downloaded at run time); any other model falls back to a conservative heuristic (~4 characters
a token, CJK characters one token each). Either way a message is counted once: the count is
kept in a bounded cache keyed by the message id, so building the next turn's input only counts
what is new, and the builder's trimming is linear in the number of messages.

Counting runs off the event loop (the builder calls it from a worker thread); a long text is
counted in slices so no single call grows without bound.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from functools import cache, lru_cache
from typing import Any

logger = logging.getLogger(__name__)

# Per-message overhead of the chat format (role, separators), in tokens.
MESSAGE_OVERHEAD = 4
# Text is handed to the tokenizer in slices of this many characters (its own guard refuses
# inputs past 1,000,000 characters; a split word costs at most a token per slice).
SLICE_CHARS = 32_000
# H3: what one image part is counted as: OpenAI's figure for a 1024x1024 image at high detail
# (vision models of other servers take a few hundred to about a thousand).
IMAGE_TOKENS = 765


# CJK symbols and punctuation to unified ideographs, and Hangul syllables.
_CJK = re.compile("[\u3000-\u9fff\uac00-\ud7af]")


def heuristic_count(text: str) -> int:
    """A conservative estimate: ~4 characters a token, CJK characters one token each (found
    by the regex engine, not a Python loop over every character)."""
    cjk = len(_CJK.findall(text))
    return cjk + (len(text) - cjk) // 4


class TokenCounter:
    """Counts the tokens of a text for one model. `calls` counts tokenizer invocations (one
    per counted text), so callers and tests can check that work stays linear."""

    def __init__(self, name: str, count: Callable[[str], int]) -> None:
        self.name = name
        self._count = count
        self.calls = 0

    def count_text(self, text: str) -> int:
        self.calls += 1
        if not text:
            return 0
        total = 0
        for start in range(0, len(text), SLICE_CHARS):
            piece = text[start : start + SLICE_CHARS]
            try:
                total += self._count(piece)
            except Exception:
                # A text the tokenizer refuses (e.g. lone surrogates) is still counted.
                total += heuristic_count(piece)
        return total

    def count_message(self, item: dict[str, Any]) -> int:
        """One OpenAI-format message: its content, its tool calls, and the format overhead.
        H3: a content of parts counts its text parts' text and each image as IMAGE_TOKENS."""
        content = item.get("content") or ""
        images = 0
        if isinstance(content, list):
            images = sum(1 for p in content if isinstance(p, dict) and p.get("type") != "text")
            text = "\n".join(
                str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
            )
        else:
            text = str(content)
        if item.get("tool_calls"):
            text += json.dumps(item["tool_calls"], ensure_ascii=False)
        return self.count_text(text) + MESSAGE_OVERHEAD + images * IMAGE_TOKENS


@lru_cache(maxsize=256)
def _encoding_name(model: str) -> str | None:
    """The BPE encoding of `model` (`o200k_base`, ...), None for a model `bpe-openai` does
    not know. Bounded: the names come from the model catalog (H4)."""
    try:
        import bpe_openai
    except ImportError:
        return None
    # Gateways often prefix the vendor (`openai/gpt-4o-mini`).
    for name in dict.fromkeys((model, model.rsplit("/", 1)[-1])):
        try:
            return str(bpe_openai.encoding_name_for_model(name))
        except Exception:  # noqa: S112 - an unknown model: try the next name, then the heuristic
            continue
    return None


@cache  # one per encoding (a handful), shared by every model using it
def _counter_for_encoding(name: str) -> TokenCounter | None:
    import bpe_openai

    try:
        encoder = bpe_openai.get_encoding(name)
    except Exception:  # tables that do not load: logged once, the heuristic counts instead
        logger.exception("the %s tables did not load; token counts use the heuristic", name)
        return None
    return TokenCounter(f"bpe:{encoder.name}", lambda text: len(encoder.encode_ordinary(text)))


_HEURISTIC = TokenCounter("heuristic", heuristic_count)


def counter_for_model(model: str) -> TokenCounter:
    """The BPE counter of a known model, else the heuristic (documented in README). Models of
    one encoding share its counter (its tables are loaded once, on first use: call this off
    the event loop), so the token cache's counts, keyed by the counter's name, serve them all."""
    name = _encoding_name(model)
    counter = _counter_for_encoding(name) if name is not None else None
    return counter or _HEURISTIC


class TokenCache:
    """Counts of stored messages by message id (a message's content never changes) and of
    texts by the text itself (the model input's head), bounded in entries with
    least-recently-used eviction. Thread-safe: builders of several dialogs run in worker
    threads at once."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max(1, max_entries)
        self._counts: OrderedDict[Hashable, int] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._counts)

    def get(self, key: Hashable) -> int | None:
        with self._lock:
            value = self._counts.get(key)
            if value is not None:
                self._counts.move_to_end(key)
            return value

    def put(self, key: Hashable, value: int) -> None:
        with self._lock:
            self._counts[key] = value
            self._counts.move_to_end(key)
            while len(self._counts) > self.max_entries:
                self._counts.popitem(last=False)

    def count(self, counter: TokenCounter, key: Hashable | None, item: dict[str, Any]) -> int:
        """The item's count, from the cache when `key` (a message id) was counted before."""
        if key is None:
            return counter.count_message(item)
        full = (counter.name, key)
        cached = self.get(full)
        if cached is None:
            cached = counter.count_message(item)
            self.put(full, cached)
        return cached
