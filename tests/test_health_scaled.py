"""Health with a frozen Redis (issue 56; SPEC F4, I3): a real `serve` process in scaled mode
(PostgreSQL and a private Redis), its Redis stopped with SIGSTOP (it keeps its connections
and answers nothing, unlike a restart). `/healthz` answers within ~2 s, saying which
dependency is degraded, REST reads stay fast meanwhile, and health is ok again once Redis
resumes."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessions_app import services
from tests.fakemodel import FakeModelServer
from tests.scaled import Api, Cluster, RedisServer, require_scaled_services, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(300),
]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    require_scaled_services()
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


def timed_get(client: httpx.Client, path: str) -> tuple[float, httpx.Response]:
    started = time.monotonic()
    response = client.get(path)
    return time.monotonic() - started, response


def test_health_answers_in_time_while_redis_is_frozen(
    transactional_db: None,
    tmp_path: Path,
    fake_model: FakeModelServer,
    redis_server: RedisServer,
    user: Any,
) -> None:
    # covers: I3, F4 (issue 56: with Redis frozen by SIGSTOP, /healthz took 10 s each time)
    cluster = Cluster(tmp_path, model_url=fake_model.url, redis_server=redis_server)
    try:
        server = cluster.serve("a")
        _token, raw = services.api_token_issue(user=user)
        api = Api(server.base, raw)
        api.create_dialog(channel="web", chat_id=f"u{user.pk}", dialog_id="health")
        http = httpx.Client(base_url=server.base, timeout=30)
        assert http.get("/healthz").json()["status"] == "ok"

        assert redis_server.proc is not None
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(3):
                took, response = timed_get(http, "/healthz")
                assert took < 3.0, took  # 1.5 s of timeout, and room for a loaded machine
                assert response.status_code == 503
                body = response.json()
                assert body["database"]["ok"] is True
                assert body["broker"]["ok"] is False
                assert body["channel_layer"]["ok"] is False
                # REST reads do not need Redis and stay fast.
                started = time.monotonic()
                listed = api.client.get("/sessions")
                assert listed.status_code == 200 and listed.json()["count"] == 1
                assert time.monotonic() - started < 2.0
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)

        wait_until(
            lambda: http.get("/healthz").status_code == 200, timeout=30, what="health recovers"
        )
    finally:
        cluster.stop()
