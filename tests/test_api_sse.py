"""SSE streaming of POST .../messages through a real server (`manage.py serve`, Daphne) and a
real HTTP client: the frames of one send in order, the snapshot tails adding up to the final
answer, and a client that hangs up mid-turn stopping nothing (SPEC E3, D1, D3, C3)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fakemodel import FakeModelServer, Reply
from tests.procs import ServeProcess, embedded_env, manage, migrate_embedded

pytestmark = pytest.mark.slow


@dataclass
class LiveApi:
    base: str
    token: str
    log: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.base}/api/v1", headers=self.headers, timeout=30.0, **kwargs
        )


@contextmanager
def serve_api(var_dir: Path, model_url: str, **env_extra: str) -> Iterator[LiveApi]:
    """A migrated embedded-mode server on a free port with a bearer token for a new user."""
    env = embedded_env(var_dir, LLM_BASE_URL=model_url, **env_extra)
    migrate_embedded(env)
    issued = manage("issue_token", "apiuser", "--create-user", env=env)
    assert issued.returncode == 0, issued.stdout + issued.stderr
    token = issued.stdout.strip().splitlines()[-1]
    with ServeProcess(var_dir, env) as server:
        yield LiveApi(base=server.base, token=token, log=server.log_path)


@pytest.fixture(scope="module")
def model() -> Iterator[FakeModelServer]:
    server = FakeModelServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, model: FakeModelServer) -> Iterator[LiveApi]:
    with serve_api(tmp_path_factory.mktemp("sse"), model.url) as server:
        yield server


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """Parse a Server-Sent Events stream into {event, id, data} dicts (comments skipped)."""
    fields: dict[str, str] = {}
    for line in lines:
        if line == "":
            if "data" in fields:
                yield {
                    "event": fields.get("event", "message"),
                    "id": int(fields["id"]),
                    "data": json.loads(fields["data"]),
                }
            fields = {}
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(":")
        fields[key] = value[1:] if value.startswith(" ") else value


def wait_turn(client: httpx.Client, turn_id: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        response = client.get(f"/turns/{turn_id}")
        assert response.status_code == 200, response.text
        data = response.json()
        if data["status"] in ("completed", "cancelled", "failed"):
            return data
        assert time.monotonic() < deadline, f"turn still {data['status']}"
        time.sleep(0.1)


def test_sse_streams_one_send_in_protocol_order(live: LiveApi, model: FakeModelServer) -> None:
    # covers: E3, D1, D2, D3
    answer = "Streaming through a real server, one small piece at a time."
    model.script(Reply(text=answer, chunk=4, delay=0.03))
    with live.client() as client:
        created = client.post("/sessions", json={"dialog_id": "sse"})
        assert created.status_code == 201, created.text
        sid = created.json()["session_id"]
        with client.stream(
            "POST",
            f"/sessions/{sid}/messages",
            json={"content": "tell me", "client_msg_id": "c-1"},
            headers={"Accept": "text/event-stream"},
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["cache-control"] == "no-cache"
            events = list(sse_events(response.iter_lines()))

        kinds = [e["event"] for e in events]
        assert kinds[0] == "queued"
        assert kinds[1] == "history_delta"
        assert kinds[-2:] == ["history_delta", "turn_updated"]
        snapshots = events[2:-2]
        assert snapshots and all(e["event"] == "turn_snapshot" for e in snapshots)
        assert len(snapshots) > 1, "the answer streams in more than one frame"
        assert [e["id"] for e in events] == list(range(1, len(events) + 1))
        for e in events:
            assert e["event"] == e["data"]["type"]
            assert e["data"]["session_id"] == sid

        queued = events[0]["data"]
        turn_id = queued["turn_id"]
        assert queued["client_msg_id"] == "c-1" and queued["mode"] == "send"
        assert queued["position"] == 0
        started = events[1]["data"]
        assert started["turn_id"] == turn_id
        assert [m["content"] for m in started["messages"]] == ["tell me"]
        text = ""
        for e in snapshots:
            frame = e["data"]
            assert frame["turn_id"] == turn_id
            assert frame["text_offset"] <= len(text)
            text = text[: frame["text_offset"]] + frame["text"]
        assert text == answer
        committed = events[-2]["data"]
        assert committed["base_revision"] == started["history_revision"]
        assert committed["messages"][-1]["role"] == "assistant"
        assert committed["messages"][-1]["content"] == answer
        terminal = events[-1]["data"]
        assert terminal["turn_id"] == turn_id and terminal["status"] == "completed"

        turn = wait_turn(client, turn_id)
        assert turn["status"] == "completed"
        assert turn["messages"][-1]["content"] == answer


def test_sse_client_hanging_up_mid_turn_does_not_stop_the_turn(
    live: LiveApi, model: FakeModelServer
) -> None:
    # covers: C3, E3
    answer = "A slow answer that keeps going after the listener has left the building."
    model.script(Reply(text=answer, chunk=2, delay=0.05))
    with live.client() as client:
        sid = client.post("/sessions", json={"dialog_id": "hangup"}).json()["session_id"]
        turn_id = None
        with client.stream(
            "POST",
            f"/sessions/{sid}/messages",
            json={"content": "go slowly"},
            headers={"Accept": "text/event-stream"},
        ) as response:
            assert response.status_code == 200
            for event in sse_events(response.iter_lines()):
                if event["event"] == "queued":
                    turn_id = event["data"]["turn_id"]
                if event["event"] == "turn_snapshot":
                    break  # hang up mid-answer
        assert turn_id is not None
        state = client.get(f"/sessions/{sid}").json()
        assert state["status"] == "running"

        turn = wait_turn(client, turn_id)
        assert turn["status"] == "completed"
        assert turn["messages"][-1]["content"] == answer

        # The server is still fine for the next streamed send.
        model.script(Reply(text="again"))
        with client.stream(
            "POST",
            f"/sessions/{sid}/messages",
            json={"content": "and again"},
            headers={"Accept": "text/event-stream"},
        ) as response:
            kinds = [e["event"] for e in sse_events(response.iter_lines())]
        assert kinds[0] == "queued" and kinds[-1] == "turn_updated"


def test_sse_refusals_are_json_errors(live: LiveApi) -> None:
    # covers: E3, F3
    with live.client() as client:
        sid = client.post("/sessions", json={"dialog_id": "refused"}).json()["session_id"]
        response = client.post(
            f"/sessions/{sid}/messages",
            json={"content": "   "},
            headers={"Accept": "text/event-stream"},
        )
        assert response.status_code == 422
        assert response.json()["code"] == "bad_request"
        other = client.post(
            "/sessions/api:u999999:default/messages",
            json={"content": "hi"},
            headers={"Accept": "text/event-stream"},
        )
        assert other.status_code == 404 and other.json()["code"] == "not_found"
    with httpx.Client(base_url=f"{live.base}/api/v1", timeout=10.0) as anonymous:
        response = anonymous.post(
            f"/sessions/{sid}/messages",
            json={"content": "hi"},
            headers={"Accept": "text/event-stream"},
        )
        assert response.status_code == 401
        assert response.json()["code"] == "unauthorized"


def test_oversized_chunked_body_is_413(live: LiveApi) -> None:
    # covers: F3: a body without a declared length is measured too.
    def body() -> Iterator[bytes]:
        yield b'{"content": "'
        for _ in range(100):
            yield b"x" * 10_000
        yield b'"}'

    with live.client() as client:
        sid = client.post("/sessions", json={"dialog_id": "chunked"}).json()["session_id"]
        response = client.post(
            f"/sessions/{sid}/messages",
            content=body(),
            headers={"Content-Type": "application/json"},
        )
        assert response.status_code == 413, response.text
        assert response.json()["code"] == "too_large"


def test_server_logged_no_errors(live: LiveApi) -> None:
    # Runs last: streams that ended early or were refused left no traceback behind.
    log = live.log.read_text()
    assert "Traceback" not in log and " ERROR " not in log, log
