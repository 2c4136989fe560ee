"""A socket resumes on another process (PROTOCOL "On connect", issue 57; SPEC G1): two real
`serve` processes on PostgreSQL and Redis. A socket that held a dialog on one process
reconnects to the other saying what it holds: nothing changed -> `sessions` `unchanged`
(the etag is the same digest in every process) and an empty `history_delta`; a turn made on
the first process meanwhile -> a delta holding it; a branch switch there -> the whole
`session_history`."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

from __future__ import annotations

from typing import Any

import pytest

from tests.fakemodel import FakeModelServer, Reply
from tests.scaled import Api, Cluster, Socket
from tests.test_scaled import cluster, redis_server, token, web_dialog  # noqa: F401

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(300),
]


def is_history(frame: dict[str, Any]) -> bool:
    return frame["type"] in ("history_delta", "session_history")


def reopened(
    base: str, token: str, holds: dict[str, Any]
) -> tuple[Socket, dict[str, Any], dict[str, Any]]:
    """A socket saying it holds `holds`, with its `sessions` and its history frame."""
    sock = Socket(base, token, query=holds)
    return sock, sock.wait_for(lambda f: f["type"] == "sessions"), sock.wait_for(is_history)


def holds_after(sock: Socket, dialog_id: str) -> dict[str, Any]:
    """What a web chat shows once `sock`'s frames are applied: the dialog, the revision and
    newest message of its last history frame, and the etag of a `sessions` asked now."""
    sock.send(type="sessions", client_msg_id="etag")
    listed = sock.wait_for(lambda f: f.get("client_msg_id") == "etag")
    last = [f for f in sock.frames if is_history(f) and f.get("messages")][-1]
    return {
        "dialog_id": dialog_id,
        "since": last["history_revision"],
        "last_id": last["messages"][-1]["id"],
        "sessions_etag": listed["etag"],
    }


def test_a_socket_resumes_on_another_process(
    cluster: Cluster, fake_model: FakeModelServer, user: Any, token: str
) -> None:
    # covers: G1, D2, D3, H1
    a, b = cluster.serve("a"), cluster.serve("b")
    api_a = Api(a.base, token)
    sid = web_dialog(api_a, user, "alpha")
    on_a = Socket(a.base, token, "alpha")
    on_a.wait_for(lambda f: f["type"] == "session_history")
    fake_model.script(Reply(text="first answer"))
    first = api_a.send(sid, "first")
    assert on_a.terminal(first)["status"] == "completed"
    holds = holds_after(on_a, "alpha")
    on_a.close()

    # Nothing changed: the list is unchanged and the delta empty, from the other process.
    on_b, listed, delta = reopened(b.base, token, holds)
    assert listed["unchanged"] is True and listed["etag"] == holds["sessions_etag"]
    assert delta["type"] == "history_delta" and delta["messages"] == []
    assert delta["base_revision"] == delta["history_revision"] == holds["since"]
    on_b.close()

    # A turn made on process a meanwhile: the delta holds it.
    fake_model.script(Reply(text="second answer"))
    second = api_a.send(sid, "second")
    api_a.wait_turn(second)
    on_b, listed, delta = reopened(b.base, token, holds)
    assert "unchanged" not in listed
    assert delta["type"] == "history_delta" and delta["base_revision"] == holds["since"]
    assert [m["content"] for m in delta["messages"]] == ["second", "second answer"]
    holds = holds_after(on_b, "alpha")
    on_b.close()

    # An edit on process a made another branch active: the whole history, on b.
    question = api_a.wait_turn(first)["messages"][0]["seq"]
    fake_model.script(Reply(text="answer to the edit"))
    r = api_a.client.post(
        f"/sessions/{sid}/messages/{question}/edit", json={"content": "first, edited"}
    )
    assert r.status_code == 202, r.text
    api_a.wait_turn(r.json()["turn_id"])
    on_b, _listed, page = reopened(b.base, token, holds)
    assert page["type"] == "session_history"
    assert [m["content"] for m in page["messages"] if m["role"] != "system"] == [
        "first, edited",
        "answer to the edit",
    ]
    on_b.close()
