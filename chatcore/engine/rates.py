"""Per-user rate budgets (SPEC F3, F6, F7): sends (`RATE_LIMIT_PER_MINUTE`; sends, retries,
continues and `/compact`) and other writes (`WRITE_RATE_PER_MINUTE`; dialog create, rename,
delete and slash commands), each counted per minute; over it a request is refused with the
seconds until the next minute (`RateLimited`, REST `Retry-After`).

Every number comes from `settings.CHAT` (env `CHAT_*`); callers that started under other
settings (an engine keeps the settings it started with) pass their own `cfg`.

The counters live on the default cache's server. In scaled mode that is Redis, shared by
every process: a burst's charges go in one round trip (SET NX and INCR of each counter, on
redis-py's pipeline, `dbthreads.Batch`), with the timeouts of `settings.REDIS_OPTIONS` (I3).
A charge is made before the request's transaction begins: no transaction waits on Redis
while it holds a lock. While Redis does not answer (a restart, a stall), this process's own
counts stand in, so an outage neither locks anybody out nor lifts the budget (G5).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

import redis
from django.conf import settings
from django.core.cache import caches
from django.core.cache.backends.locmem import LocMemCache
from django.core.cache.backends.redis import RedisCache

from chatcore.common.dbthreads import Batch
from chatcore.common.errors import RateLimited

logger = logging.getLogger(__name__)

SEND = "send"
WRITE = "write"
_BUDGETS = {SEND: "RATE_LIMIT_PER_MINUTE", WRITE: "WRITE_RATE_PER_MINUTE"}
# A counter's life: its minute and the next (a clock a little behind still finds it).
COUNTER_SECONDS = 120


def _cfg(cfg: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return settings.CHAT if cfg is None else cfg


def charge(user_id: int, budget: str = SEND, cfg: Mapping[str, Any] | None = None) -> None:
    """Count one request against the user's budget for this minute; over it raises
    `RateLimited`. A cache call: run it off the event loop (`acharge`), which lets a request
    far under its budget go on while its count is made."""
    now = time.time()
    key = _budget_key(user_id, budget, now)
    _counted(key, _count_many([key], now)[0], budget, _limit(budget, cfg), now)


async def acharge(user_id: int, budget: str = SEND, cfg: Mapping[str, Any] | None = None) -> None:
    """`charge` from the event loop."""
    if isinstance(caches["default"], LocMemCache):
        # Process memory (embedded mode): microseconds, no I/O; a trip to a worker thread
        # and back would cost more than the count and delay every send's admission.
        charge(user_id, budget, cfg)
        return
    # A cache server (scaled mode): off the loop, with the charges made meanwhile.
    now = time.time()
    key = _budget_key(user_id, budget, now)
    limit = _limit(budget, cfg)
    _minute.refuse_known_over(key, limit, budget, now)
    if _minute.charge_ahead(key, limit):
        # Far under the budget: the request goes on while its count is made (G6: a send's
        # first token does not wait for the cache server's round trip).
        try:
            counting = _COUNTS.start(key)
        except BaseException:
            _minute.answered(key, None)
            raise
        counting.add_done_callback(functools.partial(_minute.answered, key))
        return
    _counted(key, await _COUNTS.run(key), budget, limit, now)


def _limit(budget: str, cfg: Mapping[str, Any] | None) -> int:
    return int(_cfg(cfg)[_BUDGETS[budget]])


def _budget_key(user_id: int, budget: str, now: float) -> str:
    return f"rl:{budget}:{user_id}:{int(now // 60)}"


def _refuse_over(count: int, budget: str, limit: int, now: float) -> None:
    if count > limit:
        message = None if budget == SEND else _write_message()
        raise RateLimited(message, retry_after=max(1.0, 60 - (now % 60)))


def _counted(key: str, count: int, budget: str, limit: int, now: float) -> None:
    _minute.seen(key, count, now)
    _refuse_over(count, budget, limit, now)


def _write_message() -> str:
    from django.utils.translation import gettext as _

    return _("Too many changes to your dialogs; slow down.")


class _ThisMinute:
    """What this process knows of the current minute's counters (keys name their minute;
    the maps are emptied when it changes):
    - the highest count seen of each counter: a counter only grows within its minute, so a
      request against one seen over its budget is refused here, with no round trip; and
      one seen far under it (with this process's charges still on their way, at most half
      the budget) is let go while its count is made (`charge_ahead`): only another process's
      requests in the same moment could take it over, and its next charge waits again;
    - its own counts, which stand in for Redis's while Redis does not answer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._minute = 0
        self._seen: dict[str, int] = {}
        self._ahead: dict[str, int] = {}
        self._own: dict[str, int] = {}

    def _turn(self, now: float) -> None:
        minute = int(now // 60)
        if minute != self._minute:
            self._seen.clear()
            self._ahead.clear()
            self._own.clear()
            self._minute = minute

    def refuse_known_over(self, key: str, limit: int, budget: str, now: float) -> None:
        with self._lock:
            self._turn(now)
            seen = self._seen.get(key, 0)
        _refuse_over(seen, budget, limit, now)

    def charge_ahead(self, key: str, limit: int) -> bool:
        """Whether a request against `key` may go on before its count is back (then counted
        as on its way)."""
        with self._lock:
            seen = self._seen.get(key)
            ahead = self._ahead.get(key, 0)
            if seen is None or 2 * (seen + ahead + 1) > limit:
                return False
            self._ahead[key] = ahead + 1
            return True

    def answered(self, key: str, counted: concurrent.futures.Future[int] | None) -> None:
        """A count made ahead is back (on the counting thread), or was never sent (None)."""
        with self._lock:
            if key in self._ahead:
                self._ahead[key] -= 1
        if counted is None:
            return
        if counted.exception() is not None:
            logger.warning("rate counters: a count made ahead failed: %s", counted.exception())
            return
        self.seen(key, counted.result(), time.time())

    def seen(self, key: str, count: int, now: float) -> None:
        with self._lock:
            self._turn(now)
            self._seen[key] = max(count, self._seen.get(key, 0))

    def count_here(self, keys: list[str], now: float) -> list[int]:
        with self._lock:
            self._turn(now)
            counts = []
            for key in keys:
                self._own[key] = self._own.get(key, 0) + 1
                counts.append(self._own[key])
            return counts


_minute = _ThisMinute()


def _count_many(keys: list[str], now: float | None = None) -> list[int]:
    """Add one to each counter of `keys` (a key twice counts twice) and return their counts:
    on Redis in one round trip; on another cache through the cache API."""
    backend = caches["default"]
    if isinstance(backend, RedisCache):
        return _redis.count(backend, keys, time.time() if now is None else now)
    counts = []
    for key in keys:
        backend.add(key, 0, timeout=COUNTER_SECONDS)
        try:
            counts.append(int(backend.incr(key)))
        except ValueError:  # expired between the two calls
            backend.set(key, 1, timeout=COUNTER_SECONDS)
            counts.append(1)
    return counts


class _RedisCounters:
    """The counters on the Redis of the default cache (its `LOCATION`, first server, and its
    key prefix), through a redis-py client of their own: the cache API takes three round
    trips per counter (add, then incr's existence check and increment), and every send pays
    the charge before its admission."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[str, redis.Redis] = {}
        self._down = False

    def _client(self) -> redis.Redis:
        location = settings.CACHES["default"]["LOCATION"]
        # Django's own reading of a LOCATION that lists servers: the first one is written.
        url = re.split("[;,]", location)[0] if isinstance(location, str) else list(location)[0]
        with self._lock:
            client = self._clients.get(url)
            if client is None:
                client = self._clients[url] = redis.Redis.from_url(url, **settings.REDIS_OPTIONS)
            return client

    def count(self, backend: RedisCache, keys: list[str], now: float) -> list[int]:
        """SET NX and INCR of each key in one round trip; this process's counts while Redis
        does not answer (logged once per outage)."""
        pipe = self._client().pipeline(transaction=False)
        for key in keys:
            full = backend.make_and_validate_key(key)
            pipe.set(full, 0, ex=COUNTER_SECONDS, nx=True)
            pipe.incr(full)
        try:
            replies = pipe.execute()
        except redis.RedisError as exc:
            if not self._down:
                self._down = True
                logger.warning("rate counters: Redis did not answer (%s); counting here", exc)
            return _minute.count_here(keys, now)
        if self._down:
            self._down = False
            logger.info("rate counters: Redis answers again")
        return [int(count) for count in replies[1::2]]


_redis = _RedisCounters()

# A burst of charges counts in a few round trips to the cache server, not one each.
_COUNTS: Batch[str, int] = Batch("send-rate", _count_many)
