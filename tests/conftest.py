"""Shared fixtures. Infrastructure: SQLite unless DATABASE_URL is set (the Makefile's second
pass runs the `both_dbs` modules on PostgreSQL); the in-memory channel layer unless a test is
about Redis. Tests that need PostgreSQL or Redis skip with a reason on a machine without them,
and fail in CI (CI=true), where they must run."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model

IN_CI = os.environ.get("CI", "").lower() == "true"
# B4's first title asks the model after every dialog's first answer: the tests that are not
# about titles keep their scripted replies for turns (servers they start inherit this too);
# the title tests turn it on.
os.environ.setdefault("CHAT_FIRST_TITLE", "0")
_counter = itertools.count(1)


def pytest_configure(config: pytest.Config) -> None:
    for marker in (
        "both_dbs: the module also runs on PostgreSQL in the second pass of make test",
        "postgres: needs PostgreSQL (TEST_DATABASE_URL)",
        "redis: needs Redis (TEST_REDIS_URL)",
        "browser: drives a real headless Chromium",
        "slow: starts subprocesses or servers",
        "litellm: compatibility suite against the LiteLLM proxy (skip with -m 'not litellm')",
    ):
        config.addinivalue_line("markers", marker)


def require_service(env_name: str, what: str) -> str:
    """The URL of a real service for this test, or skip (fail in CI) with a clear reason."""
    url = os.environ.get(env_name, "").strip()
    if not url:
        reason = f"{what} not configured: set {env_name} to run this test"
        if IN_CI:
            pytest.fail(reason + " (CI must run it)")
        pytest.skip(reason)
    return url


def require_postgresql() -> None:
    """Skip (fail in CI) unless the tests run on PostgreSQL."""
    from django.db import connection

    if connection.vendor != "postgresql":
        reason = "the PostgreSQL backend (run with DATABASE_URL set, as pass 2 of make test does)"
        if IN_CI:
            pytest.fail(reason + " (CI must run it)")
        pytest.skip(reason)


@pytest.fixture(scope="session", autouse=True)
def _no_first_titles() -> None:
    """The in-process side of CHAT_FIRST_TITLE=0 above (settings may load before it)."""
    from django.conf import settings

    settings.CHAT["FIRST_TITLE"] = os.environ["CHAT_FIRST_TITLE"] not in ("0", "false", "no")


@pytest.fixture(scope="session", autouse=True)
def _close_sync_thread_connections(django_db_setup: None) -> Iterator[None]:
    """Async tests run ORM calls on asgiref's single sync thread and on the database threads;
    close their connections before the test database is dropped (PostgreSQL refuses to drop a
    database in use)."""
    yield
    from asgiref.sync import SyncToAsync
    from django.db import connections

    from chatcore.common import dbthreads

    SyncToAsync.single_thread_executor.submit(connections.close_all).result(timeout=10)
    dbthreads.close_all()


@pytest.fixture(scope="session", autouse=True)
def _fast_password_hashing() -> Iterator[None]:
    """A one-round hasher for the passwords the tests set and check in this process: the
    default PBKDF2 spends about 0.3 s of CPU per user made or signed in, and no test here is
    about the hasher. Servers the tests start as subprocesses keep the default hashers."""
    from django.test import override_settings

    with override_settings(PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"]):
        yield


@pytest.fixture(autouse=True)
def _english_after_each_test() -> Iterator[None]:
    """LocaleMiddleware activates a request's language on the thread that served it and
    never resets it; put every thread the tests use back to the default language."""
    yield
    from asgiref.sync import SyncToAsync
    from django.utils import translation

    translation.deactivate()
    SyncToAsync.single_thread_executor.submit(translation.deactivate).result(timeout=10)


@pytest.fixture
def redis_url() -> str:
    return require_service("TEST_REDIS_URL", "Redis")


@pytest.fixture
def make_user(db: None) -> Callable[..., Any]:
    def factory(
        username: str | None = None, *, staff: bool = False, password: str = "pw-12345!"
    ) -> Any:
        name = username or f"user{next(_counter)}"
        model = get_user_model()
        if staff:
            return model.objects.create_superuser(name, f"{name}@example.com", password)
        return model.objects.create_user(name, f"{name}@example.com", password)

    return factory


@pytest.fixture
def user(make_user: Callable[..., Any]) -> Any:
    return make_user("alice")


@pytest.fixture
def other_user(make_user: Callable[..., Any]) -> Any:
    return make_user("bob")


@pytest.fixture
def within_a_minute(monkeypatch: pytest.MonkeyPatch) -> float:
    """The per-minute budgets' clock (`chatcore.engine.rates`) held 20 s into a minute, so a
    test of a budget never has its requests counted in two minutes; the time it holds."""
    import types

    from chatcore.engine import rates

    held = 1_800_000_000.0 - 40
    monkeypatch.setattr(rates, "time", types.SimpleNamespace(time=lambda: held))
    return held


# --- Engine fixtures ----------------------------------------------------------------------

import asyncio  # noqa: E402
from collections.abc import AsyncIterator  # noqa: E402

import pytest_asyncio  # noqa: E402
from channels.layers import get_channel_layer  # noqa: E402

from chatcore.common import publish  # noqa: E402
from tests.fakemodel import FakeModelServer  # noqa: E402


@pytest.fixture
def fake_model() -> Iterator[FakeModelServer]:
    server = FakeModelServer().start()
    try:
        yield server
    finally:
        server.stop()


class FrameRecorder:
    """Listens on channel-layer groups like a client connection would."""

    def __init__(self) -> None:
        self.layer = get_channel_layer()
        self.channel = ""
        self.frames: list[dict[str, Any]] = []
        # One receive stays open across timeouts: cancelling a receive on the Redis pub/sub
        # layer unsubscribes the channel and loses frames.
        self._pending: asyncio.Task[Any] | None = None
        # The rest of a message that carried several frames (`publish.unfold`).
        self._unfolded: list[dict[str, Any]] = []

    async def start(self, *groups: str) -> FrameRecorder:
        self.channel = await self.layer.new_channel("test.")
        for group in groups:
            await self.layer.group_add(group, self.channel)
        return self

    async def next(self, timeout: float = 10.0) -> dict[str, Any]:
        if not self._unfolded:
            if self._pending is None:
                self._pending = asyncio.ensure_future(self.layer.receive(self.channel))
            done, _ = await asyncio.wait({self._pending}, timeout=timeout)
            if not done:
                raise TimeoutError
            self._unfolded = publish.unfold(self._pending.result())
            self._pending = None
        frame = self._unfolded.pop(0)["frame"]
        self.frames.append(frame)
        return frame

    async def until(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 15.0
    ) -> list[dict[str, Any]]:
        """Collect frames until one matches; returns all collected, the match last."""
        out = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            frame = await self.next(max(0.01, deadline - loop.time()))
            out.append(frame)
            if pred(frame):
                return out

    async def terminal(self, turn_id: str, timeout: float = 15.0) -> dict[str, Any]:
        frames = await self.until(
            lambda f: f["type"] == "turn_updated" and f["turn_id"] == turn_id, timeout
        )
        return frames[-1]


@pytest_asyncio.fixture
async def recorder() -> AsyncIterator[Callable[..., Any]]:
    made: list[FrameRecorder] = []

    async def make(*groups: str) -> FrameRecorder:
        rec = await FrameRecorder().start(*groups)
        made.append(rec)
        return rec

    yield make
    for rec in made:
        if rec._pending is not None:
            rec._pending.cancel()
            await asyncio.gather(rec._pending, return_exceptions=True)


@pytest_asyncio.fixture
async def make_engine(fake_model: FakeModelServer) -> AsyncIterator[Callable[..., Any]]:
    from chatcore.engine.engine import Engine
    from chatcore.engine.provider import OpenAIProvider

    engines: list[Any] = []

    async def factory(**kwargs: Any) -> Any:
        provider = kwargs.pop("provider", None) or OpenAIProvider(
            base_url=fake_model.url,
            api_key="sk-test-secret-key-123456",
            model="fake",
            retry_base_delay=0.01,
        )
        engine = Engine(provider=provider, **kwargs)
        await engine.start()
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        await engine.shutdown(grace=2)


@pytest_asyncio.fixture
async def engine(make_engine: Callable[..., Any]) -> AsyncIterator[Any]:
    """A started engine on the fake model server, installed as this process's engine, so
    channels (consumers, API views) that call `runtime.get_engine()` use it."""
    from chatcore.engine import runtime

    started = await make_engine()
    runtime.set_engine(started)
    try:
        yield started
    finally:
        runtime.set_engine(None)


# --- WebSocket clients ---------------------------------------------------------------------


@pytest_asyncio.fixture
async def connect(engine: Any) -> AsyncIterator[Callable[..., Any]]:
    """Open authenticated connections (bearer token) that read their connect frames."""
    from tests.ws_helpers import WS, bearer, open_ws

    opened: list[WS] = []

    async def factory(user: Any, path: str = "/ws/chat/") -> WS:
        ws, connected = await open_ws(await bearer(user), path)
        assert connected
        opened.append(ws)
        sessions = await ws.next()
        assert sessions["type"] == "sessions"
        hist = await ws.next()
        assert hist["type"] == "session_history"
        ws.sessions, ws.history = sessions, hist
        return ws

    yield factory
    for ws in opened:
        await ws.close()


# --- REST API clients ----------------------------------------------------------------------


@pytest.fixture
async def api(engine: Any, user: Any) -> Any:
    """A bearer-token client of the REST API for `user`, with fresh rate-limit counters."""
    from asgiref.sync import sync_to_async
    from django.core.cache import cache

    from tests.api_helpers import bearer_api

    await sync_to_async(cache.clear)()  # rate-limit counters of earlier tests
    return await bearer_api(user)


# --- Telegram: a fake Bot API server and bots on the real webhook route ---------------------

from tests.telegram_helpers import bot, bot_with, fake_telegram  # noqa: E402, F401

# Storage tests (test_storage*.py): fast, recorded retries of database writes (A4).


@pytest.fixture
def fast_retries(settings: Any) -> list[float]:
    """Retry delays of 1, 2, 3 ms; returns the list of sleeps the retry loop made."""
    chat = dict(settings.CHAT)
    chat["STORAGE_RETRY_DELAYS_MS"] = [1, 2, 3]
    settings.CHAT = chat
    return []


@pytest.fixture
def sleeps(fast_retries: list[float], monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record (and still perform) the sleeps between storage attempts."""
    import time

    real_sleep = time.sleep

    def recording_sleep(seconds: float) -> None:
        fast_retries.append(seconds)
        real_sleep(seconds)

    from sessions_app import storage

    monkeypatch.setattr(storage.time, "sleep", recording_sleep)
    return fast_retries
