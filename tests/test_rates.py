"""The per-user rate budgets on Redis (`chatcore.engine.rates`; SPEC F7, G5, I3): one count
shared by every process, a burst's charges in a few round trips, a charge made before the
admission's transaction (a refusal changes nothing, and no transaction waits on Redis), and
this process's own counts while Redis does not answer."""

from __future__ import annotations

import asyncio
import threading
import time
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from asgiref.sync import sync_to_async
from django.db import connection, transaction
from django.test import override_settings

from chatcore.common.errors import RateLimited
from chatcore.engine import rates
from sessions_app.models import Message, Session, Turn
from tests.api_helpers import engine_with
from tests.engine_helpers import history, make_dialog, send
from tests.fakemodel import Reply

pytestmark = [pytest.mark.redis]

# A fixed clock 20 s into a minute: a test never straddles two minutes' counters.
NOW = 1_800_000_000.0 - 40


def on_redis(url: str) -> dict[str, Any]:
    """The default cache on `url`, with a key prefix of the test's own."""
    return {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": url,
            "KEY_PREFIX": uuid.uuid4().hex,
        }
    }


@pytest.fixture
def fixed_clock(within_a_minute: float) -> None:
    assert within_a_minute == NOW


def test_the_send_budget_on_redis_is_one_count_shared_by_every_process(
    redis_url: str, fixed_clock: None
) -> None:
    # covers: F7 (scaled mode: the per-minute budget is counted in Redis, across processes)
    from django.core.cache.backends.redis import RedisCache

    caches = on_redis(redis_url)
    prefix = caches["default"]["KEY_PREFIX"]
    cfg = {"RATE_LIMIT_PER_MINUTE": 3, "WRITE_RATE_PER_MINUTE": 100}
    with override_settings(CACHES=caches):
        for _ in range(3):
            rates.charge(9191, rates.SEND, cfg)
        with pytest.raises(RateLimited) as refused:
            rates.charge(9191, rates.SEND, cfg)
        assert refused.value.retry_after == 40
        # Writes have their own budget.
        rates.charge(9191, rates.WRITE, cfg)
    # Another process (its own cache client) sees the same count, through the cache API,
    # and the counter goes away after its two minutes.
    other = RedisCache(redis_url, {"KEY_PREFIX": prefix})
    key = f"rl:send:9191:{int(NOW // 60)}"
    assert other.get(key) == 4
    with redis.Redis.from_url(redis_url) as client:
        assert 60 < client.ttl(other.make_and_validate_key(key)) <= rates.COUNTER_SECONDS
    other.delete_many([key, key.replace(":send:", ":write:")])


async def test_a_burst_of_sends_is_charged_exactly_in_a_few_round_trips_to_redis(
    redis_url: str, fixed_clock: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: F7, G6 (the send rate of a burst: every charge counted once, the budget exact,
    # the counts in a pipeline to Redis per trip rather than one round trip per send: the
    # first goes at once, the rest together while it is under way)
    batches: list[int] = []
    real = rates._COUNTS.run_many

    def counted(keys: list[str]) -> list[int]:
        batches.append(len(keys))
        return real(keys)

    monkeypatch.setattr(rates._COUNTS, "run_many", counted)
    cfg = {"RATE_LIMIT_PER_MINUTE": 40, "WRITE_RATE_PER_MINUTE": 100}
    with override_settings(CACHES=on_redis(redis_url)):
        results = await asyncio.gather(
            *(rates.acharge(7373, rates.SEND, cfg) for _ in range(50)),
            rates.acharge(7374, rates.SEND, cfg),  # another user: a budget of their own
            return_exceptions=True,
        )
        refused = [r for r in results if isinstance(r, RateLimited)]
        assert len(refused) == 10 and all(r.retry_after == 40 for r in refused)
        assert results[-1] is None
        assert sum(batches) == 51 and len(batches) <= 3
        with pytest.raises(RateLimited):
            await rates.acharge(7373, rates.SEND, cfg)
        await rates.acharge(7374, rates.SEND, cfg)


async def test_a_request_far_under_its_budget_goes_on_while_its_count_is_made(
    redis_url: str, fixed_clock: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: F7, G6 (once a counter is known far under its budget, a request does not wait
    # for its count; near the budget each waits again, and the budget stays exact)
    from django.core.cache.backends.redis import RedisCache

    cfg = {"RATE_LIMIT_PER_MINUTE": 10, "WRITE_RATE_PER_MINUTE": 100}
    user_id = 70_000 + uuid.uuid4().int % 10_000
    caches = on_redis(redis_url)
    with override_settings(CACHES=caches):
        await rates.acharge(user_id, rates.SEND, cfg)  # the minute's first waits: count 1
        gate = threading.Event()
        real_count = rates._redis.count

        def held(backend: Any, keys: list[str], now: float) -> list[int]:
            gate.wait(10)
            return real_count(backend, keys, now)

        monkeypatch.setattr(rates._redis, "count", held)
        for _ in range(4):  # counts 2 to 5: at most half the budget on its way
            await asyncio.wait_for(rates.acharge(user_id, rates.SEND, cfg), 0.5)
        sixth = asyncio.ensure_future(rates.acharge(user_id, rates.SEND, cfg))
        await asyncio.sleep(0.3)
        assert not sixth.done()  # it would pass half the budget: it waits for its count
        gate.set()
        await asyncio.wait_for(sixth, 5)
        for _ in range(4):  # counts 7 to 10, each waited for
            await rates.acharge(user_id, rates.SEND, cfg)
        with pytest.raises(RateLimited):
            await rates.acharge(user_id, rates.SEND, cfg)
    # Every request was counted once, the refused one too.
    counters = RedisCache(redis_url, {"KEY_PREFIX": caches["default"]["KEY_PREFIX"]})
    key = f"rl:send:{user_id}:{int(NOW // 60)}"
    assert counters.get(key) == 11
    counters.delete(key)


@pytest.mark.django_db(transaction=True)
@pytest.mark.both_dbs
async def test_a_send_over_its_rate_is_refused_before_its_admission_and_changes_nothing(
    make_engine: Any,
    fake_model: Any,
    user: Any,
    redis_url: str,
    fixed_clock: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # covers: F7, C2 (a refused send stores nothing; a counter seen over its budget refuses
    # the next send with no round trip; the next minute's budget lets the dialog go on)
    trips: list[int] = []
    real_count = rates._redis.count

    def count(backend: Any, keys: list[str], now: float) -> list[int]:
        trips.append(len(keys))
        return real_count(backend, keys, now)

    monkeypatch.setattr(rates._redis, "count", count)
    with override_settings(CACHES=on_redis(redis_url)):
        async with engine_with(make_engine, RATE_LIMIT_PER_MINUTE=2) as engine:
            session = await make_dialog(user)
            fake_model.script(Reply(text="one"), Reply(text="two"))
            for text in ("first", "second"):
                assert (await send(engine, session, text)).turn_id is not None
                await engine.wait_idle(session.pk)

            def stored() -> tuple[int, int, int]:
                row = Session.objects.get(pk=session.pk)
                turns = Turn.objects.filter(session_id=session.pk).count()
                return turns, Message.objects.filter(session_id=session.pk).count(), row.last_seq

            before = await sync_to_async(stored)()
            with pytest.raises(RateLimited) as refused:
                await send(engine, session, "third")
            assert refused.value.retry_after == 40
            assert await sync_to_async(stored)() == before
            assert trips == [1, 1, 1]
            with pytest.raises(RateLimited):
                await send(engine, session, "fourth")
            assert trips == [1, 1, 1]  # known over its budget: no round trip
            assert await sync_to_async(stored)() == before

            monkeypatch.setattr(rates, "time", types.SimpleNamespace(time=lambda: NOW + 60))
            fake_model.script(Reply(text="three"))
            assert (await send(engine, session, "fifth")).turn_id is not None
            await engine.wait_idle(session.pk)
            assert [m.content for m in await history(session)][1:] == [
                "first",
                "one",
                "second",
                "two",
                "fifth",
                "three",
            ]


@pytest.mark.django_db(transaction=True)
@pytest.mark.both_dbs
async def test_no_transaction_waits_for_the_send_rate_charge(
    make_engine: Any,
    fake_model: Any,
    user: Any,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # covers: I3, F7 (while Redis is slow to count a send, its dialog's row and SQLite's
    # write lock are free: another writer goes on at once; the send is admitted after)
    held, counting = threading.Event(), threading.Event()
    real_count = rates._redis.count

    def count(backend: Any, keys: list[str], now: float) -> list[int]:
        counting.set()
        held.wait(10)
        return real_count(backend, keys, now)

    monkeypatch.setattr(rates._redis, "count", count)
    with override_settings(CACHES=on_redis(redis_url)):
        async with engine_with(make_engine) as engine:
            session = await make_dialog(user)
            fake_model.script(Reply(text="answer"))
            sent = asyncio.create_task(send(engine, session, "hello"))
            assert await asyncio.to_thread(counting.wait, 10)

            def write_meanwhile() -> float:
                started = time.monotonic()
                try:
                    with transaction.atomic():
                        # The dialog's row, locked as an admission locks it (no wait).
                        locked = Session.objects.select_for_update(nowait=True).get(pk=session.pk)
                        Session.objects.filter(pk=locked.pk).update(title="renamed meanwhile")
                finally:
                    connection.close()
                return time.monotonic() - started

            assert await asyncio.to_thread(write_meanwhile) < 1.0
            held.set()
            assert (await sent).turn_id is not None
            await engine.wait_idle(session.pk)
            assert [m.content for m in await history(session)][-2:] == ["hello", "answer"]


def test_a_charge_is_counted_once_after_redis_closed_the_pools_connection(
    redis_url: str,
) -> None:
    # covers: F7, G5 (a connection the server closed while it sat in the pool, a restart or
    # an idle timeout, is replaced as it is taken, and each count is made once)
    cfg = {"RATE_LIMIT_PER_MINUTE": 2, "WRITE_RATE_PER_MINUTE": 100}
    with override_settings(CACHES=on_redis(redis_url)):
        user_id = 90_000 + uuid.uuid4().int % 10_000
        rates.charge(user_id, rates.SEND, cfg)
        client_id = rates._redis._client().client_id()  # the pool's one connection
        with redis.Redis.from_url(redis_url) as other:
            other.client_kill_filter(_id=client_id)
        rates.charge(user_id, rates.SEND, cfg)  # the second of the minute: within the budget
        assert rates._redis._client().client_id() != client_id
        with pytest.raises(RateLimited):
            rates.charge(user_id, rates.SEND, cfg)


@pytest.fixture
def frozen_redis(tmp_path: Path) -> Iterator[str]:
    """A private `redis-server`, stopped with SIGSTOP: it accepts connections and answers
    nothing (never the shared server)."""
    import shutil

    from tests.conftest import IN_CI
    from tests.scaled import RedisServer

    if shutil.which("redis-server") is None:
        if IN_CI:
            pytest.fail("needs the redis-server binary (CI must run it)")
        pytest.skip("needs the redis-server binary")
    server = RedisServer(tmp_path / "redis").start()
    server.freeze()
    try:
        yield server.url
    finally:
        server.stop()


def test_while_redis_does_not_answer_this_process_counts(
    frozen_redis: str, fixed_clock: None, caplog: pytest.LogCaptureFixture
) -> None:
    # covers: G5, I3 (a stalled Redis answers within its timeout, and never locks anybody
    # out nor lifts the budget: this process's counts stand in; said once in the log)
    cfg = {"RATE_LIMIT_PER_MINUTE": 2, "WRITE_RATE_PER_MINUTE": 100}
    options = {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}
    user_id = 80_000 + uuid.uuid4().int % 10_000
    with override_settings(CACHES=on_redis(frozen_redis), REDIS_OPTIONS=options):
        started = time.monotonic()
        rates.charge(user_id, rates.SEND, cfg)
        assert time.monotonic() - started < 2.0
        rates.charge(user_id, rates.SEND, cfg)
        with pytest.raises(RateLimited):
            rates.charge(user_id, rates.SEND, cfg)
        rates.charge(user_id + 1, rates.SEND, cfg)  # another user: a count of their own
    warned = [r for r in caplog.records if "rate counters" in r.getMessage()]
    assert len(warned) == 1 and "counting here" in warned[0].getMessage()


def test_the_counts_waiting_for_a_trip_are_bounded() -> None:
    # covers: I3 (while a trip to the cache server is held, at most `max_waiting` items wait
    # for the next; one more is refused at once, and those that waited are counted after)
    from chatcore.common.dbthreads import Batch
    from chatcore.common.errors import Overloaded

    gate = threading.Event()
    trips: list[list[str]] = []

    def run_many(items: list[str]) -> list[int]:
        trips.append(items)
        gate.wait(10)
        return [len(item) for item in items]

    batch: Batch[str, int] = Batch("bounded", run_many, max_waiting=2)
    first = batch.start("a")
    deadline = time.monotonic() + 5
    while not trips:  # the first trip is under way, holding
        assert time.monotonic() < deadline
        time.sleep(0.01)
    waiting = [batch.start("bb"), batch.start("ccc")]
    with pytest.raises(Overloaded):
        batch.start("dddd")
    gate.set()
    assert [f.result(5) for f in (first, *waiting)] == [1, 2, 3]
    assert trips == [["a"], ["bb", "ccc"]]


def test_what_the_process_knows_of_counters_is_only_this_minutes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # covers: I3, F7 (the counts this process has seen are kept for their minute only: a
    # server that runs for months does not keep one entry per user and minute)
    cfg = {"RATE_LIMIT_PER_MINUTE": 5, "WRITE_RATE_PER_MINUTE": 5}
    users = [60_000 + uuid.uuid4().int % 10_000 + n for n in range(3)]
    with override_settings(
        CACHES={
            "default": {
                "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                "LOCATION": uuid.uuid4().hex,
            }
        }
    ):
        for minute in range(3):
            now = NOW + 60 * minute
            monkeypatch.setattr(rates, "time", types.SimpleNamespace(time=lambda now=now: now))
            for user_id in users:
                rates.charge(user_id, rates.SEND, cfg)
            assert all(key.endswith(f":{int(now // 60)}") for key in rates._minute._seen)
