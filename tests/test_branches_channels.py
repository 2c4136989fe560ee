"""Edit, regenerate and branch through the WebSocket and the REST API (SPEC H1, PROTOCOL
"Branches"): the frames and routes, `session_history` after a change of the active path on
every socket of the chat, and bad input refused with nothing changed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from sessions_app.models import Message, Session, Turn
from tests.api_helpers import Api, bearer_api, error_of, read_stream, stream_post
from tests.fakemodel import Reply
from tests.ws_helpers import terminal

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


def history_frame(cmid: str | None = None) -> Any:
    return lambda f: (
        f["type"] == "session_history" and (cmid is None or f.get("client_msg_id") == cmid)
    )


async def _answered(ws: Any, content: str, cmid: str) -> dict[str, Any]:
    queued = await ws.ask({"type": "send", "content": content, "client_msg_id": cmid})
    await ws.until(terminal(queued["turn_id"]))
    return queued


async def test_edit_regenerate_and_branch_over_the_websocket(
    connect: Any, fake_model: Any, user: Any
) -> None:
    # covers: H1, D2
    ws = await connect(user)
    other = await connect(user)  # a second tab of the same chat
    fake_model.script(Reply(text="first answer"), Reply(text="edited answer"), Reply(text="again"))
    await _answered(ws, "question", "c1")
    await other.until(lambda f: f["type"] == "turn_updated")
    question = next(
        m
        for m in (await ws.ask({"type": "history", "client_msg_id": "h"}))["messages"]
        if m["role"] == "user"
    )
    assert question["parent_seq"] == 1 and "siblings" not in question

    queued = await ws.ask(
        {
            "type": "edit",
            "seq": question["seq"],
            "content": "question, edited",
            "client_msg_id": "e1",
        }
    )
    assert queued["type"] == "queued" and queued["mode"] == "edit"
    frames = await ws.until(terminal(queued["turn_id"]))
    shown = [f for f in frames if f["type"] == "session_history"][-1]
    assert [m["content"] for m in shown["messages"]][1:2] == ["question, edited"]
    assert shown["messages"][1]["siblings"] == [question["seq"], shown["messages"][1]["seq"]]
    # The other socket of the chat replaces its view too.
    seen = await other.until(history_frame())
    assert seen[-1]["history_revision"] >= shown["history_revision"]
    await other.until(terminal(queued["turn_id"]))

    queued = await ws.ask({"type": "regenerate", "client_msg_id": "r1"})
    assert queued["mode"] == "regenerate"
    frames = await ws.until(terminal(queued["turn_id"]))
    page = (await ws.ask({"type": "history", "client_msg_id": "h2"}))["messages"]
    assert [m["content"] for m in page][1:] == ["question, edited", "again"]
    assert len(page[-1]["siblings"]) == 2

    # Back to the first version of the question: answered by its session_history.
    answer = await ws.ask({"type": "branch", "seq": question["seq"], "client_msg_id": "b1"})
    assert answer["type"] == "session_history"
    assert [m["content"] for m in answer["messages"]][1:] == ["question", "first answer"]
    assert answer["history_revision"] > page[-1]["seq"]
    seen = await other.until(
        lambda f: history_frame()(f) and f["history_revision"] == answer["history_revision"]
    )
    assert [m["content"] for m in seen[-1]["messages"]][1:] == ["question", "first answer"]


async def test_bad_branch_frames_are_refused_over_the_websocket(
    connect: Any, fake_model: Any, user: Any
) -> None:
    # covers: H1, F3
    ws = await connect(user)
    await _answered(ws, "question", "c1")
    before = await sync_to_async(Session.objects.get)(dialog_id=ws.history["dialog_id"])
    for frame in (
        {"type": "edit", "seq": 3, "content": "not mine to edit"},  # the answer
        {"type": "edit", "seq": 2, "content": ""},
        {"type": "edit", "seq": "2", "content": "x"},
        {"type": "regenerate", "seq": 2},  # a user message
        {"type": "regenerate", "seq": 77},
        {"type": "branch", "seq": 77},
        {"type": "branch"},
    ):
        error = await ws.ask({**frame, "client_msg_id": "bad"})
        assert error["type"] == "error" and error["code"] == "bad_request", (frame, error)
    after = await sync_to_async(Session.objects.get)(pk=before.pk)
    assert (after.last_seq, after.head_seq, after.forked) == (
        before.last_seq,
        before.head_seq,
        False,
    )
    assert await sync_to_async(Turn.objects.filter(session_id=before.pk).count)() == 1


async def test_edit_regenerate_and_branch_over_rest(
    api: Api, fake_model: Any, user: Any, other_user: Any
) -> None:
    # covers: H1, E3, F2
    s = await api.create(dialog_id="tree")
    sid = s["session_id"]
    turn = await api.turn_done((await api.send(sid, "hello"))["turn_id"])
    user_seq, answer_seq = (m["seq"] for m in turn["messages"])

    status, ack = await api.post(
        f"/sessions/{sid}/messages/{user_seq}/edit",
        {"content": "hello again", "client_msg_id": "e"},
    )
    assert status == 202 and ack["mode"] == "edit" and ack["client_msg_id"] == "e", ack
    edited = await api.turn_done(ack["turn_id"])
    assert [m["content"] for m in edited["messages"]] == ["hello again", "echo: hello again"]
    assert edited["messages"][0]["parent_seq"] == 1
    assert edited["messages"][0]["siblings"] == [user_seq, edited["messages"][0]["seq"]]
    _, page = await api.get(f"/sessions/{sid}/messages")
    assert [m["content"] for m in page["messages"]][1:] == ["hello again", "echo: hello again"]
    assert page["messages"][1]["siblings"] == [user_seq, edited["messages"][0]["seq"]]

    status, ack = await api.post(
        f"/sessions/{sid}/messages/{edited['messages'][1]['seq']}/regenerate"
    )
    assert status == 202 and ack["mode"] == "regenerate", ack
    regenerated = await api.turn_done(ack["turn_id"])
    assert regenerated["messages"][0]["parent_seq"] == edited["messages"][0]["seq"]

    status, moved = await api.post(f"/sessions/{sid}/branch", {"seq": user_seq})
    assert status == 200 and moved["head_seq"] == answer_seq, moved
    _, state = await api.get(f"/sessions/{sid}")
    assert state["head_seq"] == answer_seq
    assert state["history_revision"] == moved["history_revision"]
    _, page = await api.get(f"/sessions/{sid}/messages")
    assert [m["content"] for m in page["messages"]][1:] == ["hello", "echo: hello"]

    # Bad input: 400 for the wrong role or an unknown seq, 404 for another user's dialog.
    count = await sync_to_async(Message.objects.count)()
    status, data = await api.post(f"/sessions/{sid}/messages/{answer_seq}/edit", {"content": "x"})
    error_of(status, data, 422, "bad_request")
    status, data = await api.post(f"/sessions/{sid}/messages/{user_seq}/regenerate")
    error_of(status, data, 422, "bad_request")
    status, data = await api.post(f"/sessions/{sid}/messages/999/edit", {"content": "x"})
    error_of(status, data, 422, "bad_request")
    status, data = await api.post(f"/sessions/{sid}/branch", {"seq": 999})
    error_of(status, data, 422, "bad_request")
    stranger = await bearer_api(other_user)
    status, data = await stranger.post(
        f"/sessions/{sid}/messages/{user_seq}/edit", {"content": "x"}
    )
    error_of(status, data, 404, "not_found")
    status, data = await stranger.post(f"/sessions/{sid}/branch", {"seq": user_seq})
    error_of(status, data, 404, "not_found")
    assert await sync_to_async(Message.objects.count)() == count
    _, again = await api.get(f"/sessions/{sid}")
    assert again["head_seq"] == answer_seq
    assert again["history_revision"] == state["history_revision"]


async def test_an_edit_streams_like_a_send(api: Api, fake_model: Any) -> None:
    # covers: H1, E3, D1
    s = await api.create(dialog_id="streamed")
    sid = s["session_id"]
    turn = await api.turn_done((await api.send(sid, "first words"))["turn_id"])
    seq = turn["messages"][0]["seq"]
    response = await stream_post(
        api, f"/sessions/{sid}/messages/{seq}/edit", {"content": "other words"}
    )
    events = await read_stream(response)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "queued" and events[0]["mode"] == "edit"
    assert kinds[-1] == "turn_updated" and events[-1]["status"] == "completed"
    text = "".join(e["text"] for e in events if e["event"] == "turn_snapshot")
    assert "echo: other words" in text


async def test_export_and_import_carry_every_branch_and_the_active_path(
    api: Api, fake_model: Any
) -> None:
    # covers: H1, H2
    from tests.test_carry_api import _export

    s = await api.create(dialog_id="exported")
    sid = s["session_id"]
    turn = await api.turn_done((await api.send(sid, "first version"))["turn_id"])
    question = turn["messages"][0]["seq"]
    status, ack = await api.post(
        f"/sessions/{sid}/messages/{question}/edit", {"content": "second version"}
    )
    assert status == 202
    edited = await api.turn_done(ack["turn_id"])

    status, body, _ = await _export(api, sid)
    doc = json.loads(body)
    parents = {m["seq"]: m["parent_seq"] for m in doc["messages"]}
    contents = {m["content"] for m in doc["messages"]}
    assert {"first version", "echo: first version", "second version"} <= contents
    assert parents[question] == parents[edited["messages"][0]["seq"]] == 1
    assert doc["head_seq"] == edited["messages"][-1]["seq"]

    status, body, _ = await _export(api, sid, format="markdown")
    text = body.decode()
    assert "second version" in text and "first version" not in text

    status, created = await api.post("/sessions/import", doc)
    assert status == 201, created
    _, page = await api.get(f"/sessions/{created['session_id']}/messages")
    shown = page["messages"][1:]
    assert [m["content"] for m in shown] == ["second version", "echo: second version"]
    # Every branch comes along: the first version is the shown one's sibling.
    assert shown[0]["parent_seq"] == 1 and shown[1]["parent_seq"] == shown[0]["seq"]
    assert len(shown[0]["siblings"]) == 2
    _, state = await api.get(f"/sessions/{created['session_id']}")
    assert state["head_seq"] == shown[-1]["seq"]


async def test_a_share_freezes_the_active_path(api: Api, fake_model: Any) -> None:
    # covers: H1, H2
    s = await api.create(dialog_id="shared")
    sid = s["session_id"]
    turn = await api.turn_done((await api.send(sid, "old words"))["turn_id"])
    status, ack = await api.post(
        f"/sessions/{sid}/messages/{turn['messages'][0]['seq']}/edit", {"content": "new words"}
    )
    await api.turn_done(ack["turn_id"])
    status, share = await api.post(f"/sessions/{sid}/share")
    assert status == 201, share
    response = await api.client.get(share["url"])
    page = response.content.decode()
    assert "new words" in page and "old words" not in page
