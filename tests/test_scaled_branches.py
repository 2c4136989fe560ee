"""Branches across processes (SPEC H1, G1): an edit made on one `serve` process changes the
active path, and a socket of the same chat on the other process gets the new
`session_history` (through Redis); so does a branch switch made there."""

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


def _contents(frame: dict[str, Any]) -> list[str]:
    return [m["content"] for m in frame["messages"] if m["role"] != "system"]


def test_an_edit_on_one_process_reaches_the_other_process_socket(
    cluster: Cluster, fake_model: FakeModelServer, user: Any, token: str
) -> None:
    # covers: H1, G1, D2
    a, b = cluster.serve("a"), cluster.serve("b")
    api_a = Api(a.base, token)
    sid = web_dialog(api_a, user, "tree")
    on_b = Socket(b.base, token, "tree")
    on_b.wait_for(lambda f: f["type"] == "session_history")

    fake_model.script(Reply(text="first answer"), Reply(text="answer to the edit"))
    first = api_a.send(sid, "the question")
    assert on_b.terminal(first)["status"] == "completed"
    done = api_a.wait_turn(first)
    question = done["messages"][0]["seq"]

    r = api_a.client.post(
        f"/sessions/{sid}/messages/{question}/edit", json={"content": "the question, edited"}
    )
    assert r.status_code == 202, r.text
    edit = r.json()["turn_id"]
    seen = on_b.wait_for(
        lambda f: f["type"] == "session_history" and "the question, edited" in _contents(f)
    )
    assert "first answer" not in _contents(seen)
    assert on_b.terminal(edit)["status"] == "completed"

    # Back to the first version, from process a: b's socket shows that branch again.
    r = api_a.client.post(f"/sessions/{sid}/branch", json={"seq": question})
    assert r.status_code == 200, r.text
    seen = on_b.wait_for(
        lambda f: (
            f["type"] == "session_history" and f["history_revision"] == r.json()["history_revision"]
        )
    )
    assert _contents(seen) == ["the question", "first answer"]
    on_b.close()
