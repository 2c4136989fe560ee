"""Export, import and share links through the REST API (SPEC H2; PROTOCOL "Search, export,
import"), on the real ASGI stack and engine with the fake model server; search over REST and
the WebSocket."""

# covers: H2

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from sessions_app import services
from sessions_app.models import Message, Session, Share
from tests.api_helpers import Api, bearer_api, chat_cfg, error_of
from tests.carry_helpers import dialog_with
from tests.fakemodel import FakeModelServer, user_texts

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]

CHATGPT = {
    "title": "Trip to Kyoto",
    "create_time": 1700000000.0,
    "current_node": "a2",
    "mapping": {
        "root": {"id": "root", "message": None, "parent": None, "children": ["sys"]},
        "sys": {
            "id": "sys",
            "parent": "root",
            "children": ["u1"],
            "message": {
                "author": {"role": "system"},
                "content": {"content_type": "text", "parts": [""]},
                "metadata": {"is_visually_hidden_from_conversation": True},
            },
        },
        "u1": {
            "id": "u1",
            "parent": "sys",
            "children": ["a1", "a2"],
            "message": {
                "author": {"role": "user"},
                "create_time": 1700000001.0,
                "content": {"content_type": "text", "parts": ["Plan a day in Kyoto"]},
            },
        },
        "a1": {
            "id": "a1",
            "parent": "u1",
            "children": [],
            "message": {
                "author": {"role": "assistant"},
                "create_time": 1700000002.0,
                "content": {"content_type": "text", "parts": ["First draft (the old branch)"]},
            },
        },
        "a2": {
            "id": "a2",
            "parent": "u1",
            "children": [],
            "message": {
                "author": {"role": "assistant"},
                "create_time": 1700000003.0,
                "content": {
                    "content_type": "text",
                    "parts": ["Fushimi Inari at dawn, then **tea**."],
                },
            },
        },
    },
}


async def _raw(api: Api, method: str, path: str, body: bytes) -> tuple[int, Any]:
    response = await api.client.generic(
        method, "/api/v1" + path, body, content_type="application/json", headers=api.headers
    )
    data = json.loads(response.content) if response.content else None
    return response.status_code, data


async def _export(api: Api, session_id: str, **params: Any) -> tuple[int, bytes, Any]:
    """An export's status, whole body (read as it streams) and response."""
    response = await api.client.get(
        f"/api/v1/sessions/{session_id}/export", params, headers=api.headers
    )
    if not response.streaming:
        return response.status_code, response.content, response
    body = b"".join([chunk async for chunk in response.streaming_content])
    return response.status_code, body, response


async def _session_count(user: Any) -> int:
    return await Session.objects.filter(owner=user).acount()


# --- Search ---------------------------------------------------------------------------------


async def test_search_over_rest_is_own_data_only(api: Api, user: Any, other_user: Any) -> None:
    mine = await sync_to_async(dialog_with)(user, "the quarterly budget review", "noted")
    await sync_to_async(dialog_with)(other_user, "the quarterly budget of bob", "noted")
    status, data = await api.get("/search", q="quarterly budget")
    assert status == 200, data
    assert data["count"] == 1
    (item,) = data["items"]
    assert item["session_id"] == mine.session_id and item["seq"] == 2
    assert item["role"] == "user" and item["dialog_id"] == mine.dialog_id
    assert "bob" not in json.dumps(data)
    status, data = await api.get("/search", q="")
    error_of(status, data, 422, "bad_request")
    status, data = await (await bearer_api(other_user)).get("/search", q="review")
    assert (status, data["count"]) == (200, 0)


async def test_search_frame_over_the_websocket(connect: Any, user: Any) -> None:
    ws = await connect(user)
    session = await sync_to_async(dialog_with)(user, "天气预报说明天下雨", "带伞")
    await ws.send({"type": "search", "q": "明天", "client_msg_id": "s1"})
    frame = (await ws.until(lambda f: f["type"] == "search_results"))[-1]
    assert frame["client_msg_id"] == "s1" and frame["q"] == "明天"
    assert [(i["session_id"], i["seq"]) for i in frame["items"]] == [(session.session_id, 2)]
    await ws.send({"type": "search", "q": "  ", "client_msg_id": "s2"})
    frame = (await ws.until(lambda f: f["type"] == "error"))[-1]
    assert (frame["code"], frame["client_msg_id"]) == ("bad_request", "s2")


# --- Export ---------------------------------------------------------------------------------


async def test_export_json_and_markdown(api: Api, user: Any, other_user: Any) -> None:
    session = await sync_to_async(dialog_with)(user, "What is 2+2?", "It is **4**.", title="Sums")
    status, body, response = await _export(api, session.session_id)
    assert status == 200
    assert response["Content-Disposition"] == 'attachment; filename="Sums.json"'
    doc = json.loads(body)
    assert doc["format"] == "chatcore.dialog.v1" and doc["title"] == "Sums"
    assert [(m["seq"], m["parent_seq"], m["role"]) for m in doc["messages"]] == [
        (1, None, "system"),
        (2, 1, "user"),
        (3, 2, "assistant"),
    ]
    assert doc["messages"][2]["content"] == "It is **4**." and doc["head_seq"] == 3

    status, body, response = await _export(api, session.session_id, format="markdown")
    assert status == 200 and response["Content-Type"].startswith("text/markdown")
    assert response["Content-Disposition"] == 'attachment; filename="Sums.md"'
    text = body.decode()
    assert text.startswith("# Sums\n")
    assert "What is 2+2?" in text and "It is **4**." in text
    assert "New dialog created" not in text  # the welcome note is not part of it

    other = await bearer_api(other_user)
    status, body, _ = await _export(other, session.session_id)
    error_of(status, json.loads(body), 404, "not_found")


async def test_export_streams_page_by_page(api: Api, user: Any) -> None:
    session = await sync_to_async(dialog_with)(user, *[f"message {i}" for i in range(1200)])
    response = await api.client.get(
        f"/api/v1/sessions/{session.session_id}/export", headers=api.headers
    )
    assert response.status_code == 200 and response.streaming
    chunks = [chunk async for chunk in response.streaming_content]
    assert len(chunks) > 10  # a chunk per hundred messages, not one body
    assert max(len(c) for c in chunks) < 20_000
    doc = json.loads(b"".join(chunks))
    assert len(doc["messages"]) == 1201 and doc["head_seq"] == 1201


async def test_export_then_import_round_trip(api: Api, user: Any) -> None:
    def make() -> Session:
        session = dialog_with(user, "Find the weather", title="Weather")
        services.messages_append(
            session_pk=session.pk,
            publish_delta=False,
            messages=[
                services.NewMessage(
                    role="assistant",
                    content="",
                    kind="assistant",
                    tool_calls=[
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                ),
                services.NewMessage(
                    role="tool",
                    content="rain",
                    kind="tool_result",
                    tool_call_id="call_1",
                    tool_name="weather",
                ),
                services.NewMessage(
                    role="assistant", content="It rains in Os", kind="assistant", status="truncated"
                ),
            ],
        )
        return session

    session = await sync_to_async(make)()
    _s, exported, _r = await _export(api, session.session_id)
    status, created = await _raw(api, "POST", "/sessions/import", exported)
    assert status == 201, created
    assert created["session_id"] != session.session_id and created["title"] == "Weather"
    assert created["history_revision"] == 5 and created["message_count"] == 1
    assert created["total_message_count"] == 5
    _s, body, _r = await _export(api, created["session_id"])
    again = json.loads(body)
    original = json.loads(exported)

    def comparable(doc: dict[str, Any]) -> list[tuple[Any, ...]]:
        return [
            (
                m["seq"],
                m["parent_seq"],
                m["role"],
                m["content"],
                m.get("status"),
                m.get("tool_calls"),
                m.get("tool_call_id"),
                m.get("tool_name"),
                m["created_at"],
            )
            for m in doc["messages"]
        ]

    assert comparable(again) == comparable(original)
    assert again["head_seq"] == original["head_seq"]

    # Markdown shows the tool call and its result in a line each, and the cut answer's status.
    _s, body, _r = await _export(api, session.session_id, format="markdown")
    text = body.decode()
    assert '> 🔧 `weather` {"city": "Oslo"}' in text
    assert "> ↩ Result of weather: rain" in text
    assert "It rains in Os\n\n*(truncated)*" in text


# --- Import ---------------------------------------------------------------------------------


async def test_chatgpt_conversation_imports_its_active_branch(
    api: Api, user: Any, fake_model: FakeModelServer
) -> None:
    status, created = await api.post("/sessions/import", CHATGPT)
    assert status == 201, created
    assert created["title"] == "Trip to Kyoto" and created["session_id"].startswith("web:")
    messages = [
        (m.seq, m.parent_seq, m.role, m.content)
        async for m in Message.objects.filter(session__dialog_id=created["dialog_id"]).order_by(
            "seq"
        )
    ]
    # Its branches become ours (H1): both answers follow the question; the current one is
    # the head.
    assert messages == [
        (1, None, "user", "Plan a day in Kyoto"),
        (2, 1, "assistant", "First draft (the old branch)"),
        (3, 1, "assistant", "Fushimi Inari at dawn, then **tea**."),
    ]
    status, page = await api.get(f"/sessions/{created['session_id']}/messages")
    assert [m["content"] for m in page["messages"]] == [
        "Plan a day in Kyoto",
        "Fushimi Inari at dawn, then **tea**.",
    ]
    assert page["messages"][1]["siblings"] == [2, 3]
    # It behaves like any other dialog: a send sees the active path; search finds it.
    ack = await api.send(created["session_id"], "And the evening?")
    turn = await api.turn_done(ack["turn_id"])
    assert turn["status"] == "completed", turn
    request = fake_model.turn_requests()[-1]
    assert user_texts(request) == ["Plan a day in Kyoto", "And the evening?"]
    assert any(m["content"] == "Fushimi Inari at dawn, then **tea**." for m in request.messages)
    assert not any(m["content"] == "First draft (the old branch)" for m in request.messages)
    status, found = await api.get("/search", q="Fushimi")
    assert [i["session_id"] for i in found["items"]] == [created["session_id"]]
    status, session = await api.get(f"/sessions/{created['session_id']}")
    assert session["history_revision"] == 5 and session["message_count"] == 2
    # The export gives the tree back, and the Markdown the active path.
    _s, body, _r = await _export(api, created["session_id"])
    doc = json.loads(body)
    assert [(m["seq"], m["parent_seq"]) for m in doc["messages"]] == [
        (1, None),
        (2, 1),
        (3, 1),
        (4, 3),
        (5, 4),
    ]
    assert doc["head_seq"] == 5
    _s, body, _r = await _export(api, created["session_id"], format="markdown")
    assert "First draft" not in body.decode() and "Fushimi" in body.decode()


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        (
            {
                "format": "chatcore.dialog.v1",
                "messages": [{"seq": 1, "role": "robot", "content": "x"}],
            },
            "role",
        ),
        (
            {"format": "chatcore.dialog.v1", "messages": [{"seq": 1, "role": "user"}]},
            "content is missing",
        ),
        (
            {
                "format": "chatcore.dialog.v1",
                "head_seq": 2,
                "messages": [
                    {"seq": 1, "parent_seq": 2, "role": "user", "content": "a"},
                    {"seq": 2, "parent_seq": 1, "role": "assistant", "content": "b"},
                ],
            },
            "cycle",
        ),
        ({"format": "chatcore.dialog.v9", "messages": []}, "format"),
        (
            {"mapping": {"a": {"parent": "nowhere", "message": None}}, "current_node": "a"},
            "nowhere",
        ),
        ({"hello": "world"}, "mapping"),
        # Values of the wrong JSON type where a name is expected (found by fuzzing).
        (
            {"format": "chatcore.dialog.v1", "messages": [{"seq": 1, "role": {}, "content": ""}]},
            "role",
        ),
        ({"mapping": {"a": {"parent": ["x"], "message": None}}, "current_node": "a"}, "parent"),
        ({"mapping": {"a": {"parent": None, "message": None}}, "current_node": {}}, "current_node"),
        ({"format": "chatcore.dialog.v1", "head_seq": [1], "messages": []}, "head_seq"),
    ],
)
async def test_bad_documents_get_400_and_create_nothing(
    api: Api, user: Any, document: dict[str, Any], problem: str
) -> None:
    before = await _session_count(user)
    status, data = await api.post("/sessions/import", document)
    error_of(status, data, 400, "bad_request")
    assert problem in data["message"]
    assert await _session_count(user) == before


async def test_bad_json_and_a_late_bad_message_create_nothing(api: Api, user: Any) -> None:
    before = await _session_count(user)
    status, data = await _raw(api, "POST", "/sessions/import", b'{"format": ')
    error_of(status, data, 400, "bad_request")
    good = [{"seq": i, "role": "user", "content": f"m{i}"} for i in range(1, 500)]
    doc = {
        "format": "chatcore.dialog.v1",
        "messages": [*good, {"seq": 500, "role": "user", "content": 5}],
    }
    status, data = await api.post("/sessions/import", doc)
    error_of(status, data, 400, "bad_request")
    assert "messages[499]" in data["message"]
    assert await _session_count(user) == before
    assert await Message.objects.filter(session__owner=user).acount() == 0


async def test_import_over_the_size_limit_is_413(api: Api, user: Any) -> None:
    body = json.dumps(
        {
            "format": "chatcore.dialog.v1",
            "messages": [{"seq": 1, "role": "user", "content": "x" * 5000}],
        }
    ).encode()
    with chat_cfg(IMPORT_MAX_BYTES=4000):
        status, data = await _raw(api, "POST", "/sessions/import", body)
    error_of(status, data, 413, "too_large")
    assert await _session_count(user) == 0
    # Bigger than an ordinary request may be (the content limit), within the import's own.
    big = json.dumps(
        {
            "format": "chatcore.dialog.v1",
            "messages": [{"seq": 1, "role": "user", "content": "y" * 60_000}] * 1,
        }
    ).encode()
    with chat_cfg(CONTENT_LIMIT=1000):
        status, data = await _raw(api, "POST", "/sessions/import", big)
    assert status == 201, data


# --- Share links ----------------------------------------------------------------------------


async def test_share_is_a_frozen_snapshot_and_revoke_ends_it(
    api: Api, user: Any, other_user: Any
) -> None:
    session = await sync_to_async(dialog_with)(
        user,
        "Summarise <script>alert(1)</script> please",
        "Here is **the** summary.",
        title="Notes",
    )
    status, share = await api.post(f"/sessions/{session.session_id}/share")
    assert status == 201, share
    assert share["url"] == f"/s/{share['share_id']}" and len(share["share_id"]) >= 32
    await sync_to_async(services.messages_append)(
        session_pk=session.pk,
        publish_delta=False,
        messages=[services.NewMessage(role="user", content="a later secret", kind="user_input")],
    )
    await sync_to_async(services.session_rename)(session=session, title="Renamed later")

    anonymous = AsyncClient()
    page = await anonymous.get(share["url"])
    assert page.status_code == 200
    html = page.content.decode()
    assert "Notes" in html and "Here is **the** summary." in html
    assert "a later secret" not in html and "Renamed later" not in html
    assert user.username not in html  # nothing of the owner
    assert "<script>alert(1)</script>" not in html  # escaped, shown as text
    assert "default-src" in page["Content-Security-Policy"]

    status, listed = await api.get("/shares")
    assert status == 200
    assert [(s["share_id"], s["session_id"]) for s in listed] == [
        (share["share_id"], session.session_id)
    ]
    other = await bearer_api(other_user)
    assert (await other.get("/shares")) == (200, [])
    status, data = await other.delete(f"/shares/{share['share_id']}")
    error_of(status, data, 404, "not_found")
    status, data = await other.post(f"/sessions/{session.session_id}/share")
    error_of(status, data, 404, "not_found")

    status, _ = await api.delete(f"/shares/{share['share_id']}")
    assert status == 204
    assert (await anonymous.get(share["url"])).status_code == 404
    assert not await Share.objects.filter(pk=share["share_id"]).aexists()


async def test_share_of_a_deleted_dialog_is_gone(api: Api, user: Any) -> None:
    session = await sync_to_async(dialog_with)(user, "hello", "hi")
    _status, share = await api.post(f"/sessions/{session.session_id}/share")
    await sync_to_async(services.session_soft_delete)(session=session)
    assert (await AsyncClient().get(share["url"])).status_code == 404
    await sync_to_async(services.session_purge)(session=session)
    assert not await Share.objects.filter(pk=share["share_id"]).aexists()
    assert (await AsyncClient().get("/s/not-a-share")).status_code == 404


async def test_an_imported_dialog_can_be_compacted(
    api: Api, user: Any, fake_model: FakeModelServer, settings: Any
) -> None:
    from sessions_app.models import Compaction

    # The summary job asks the model server of the settings: the fake one.
    settings.LLM = {**settings.LLM, "BASE_URL": fake_model.url, "RETRY_BASE_DELAY": 0.01}

    messages = [
        {"seq": i, "role": "user" if i % 2 else "assistant", "content": f"fact number {i}"}
        for i in range(1, 41)
    ]
    status, created = await api.post(
        "/sessions/import", {"format": "chatcore.dialog.v1", "title": "Facts", "messages": messages}
    )
    assert status == 201, created
    status, data = await api.post(f"/sessions/{created['session_id']}/compact")
    assert status == 202, data
    for _ in range(300):
        compaction = await Compaction.objects.filter(
            session__dialog_id=created["dialog_id"]
        ).afirst()
        if compaction is not None:
            break
        await asyncio.sleep(0.05)
    assert compaction is not None and 1 <= compaction.through_seq <= 40
    # The stored messages are untouched.
    assert [
        c
        async for c in Message.objects.filter(session__dialog_id=created["dialog_id"])
        .order_by("seq")
        .values_list("content", flat=True)
    ] == [m["content"] for m in messages]


async def test_a_bad_message_on_another_branch_is_refused_too(api: Api, user: Any) -> None:
    doc = copy.deepcopy(CHATGPT)
    doc["mapping"]["a1"]["message"]["author"]["role"] = "narrator"  # a1 is off the active path
    status, data = await api.post("/sessions/import", doc)
    error_of(status, data, 400, "bad_request")
    assert "a1" in data["message"] and "narrator" in data["message"]
    assert await _session_count(user) == 0


async def test_attachments_come_along_only_for_the_importer_s_own_files(
    api: Api, user: Any, other_user: Any, settings: Any, tmp_path: Any
) -> None:
    from tests.file_helpers import png_bytes, upload

    settings.STORAGES = {
        **settings.STORAGES,
        "default": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(tmp_path / "files")},
        },
    }
    status, file = await upload(api, "cat.png", png_bytes())
    assert status == 201, file
    session = await api.create()
    ack = await api.send(session["session_id"], "look", attachments=[file["file_id"]])
    await api.turn_done(ack["turn_id"])
    _s, exported, _r = await _export(api, session["session_id"])
    doc = json.loads(exported)
    (sent,) = [m for m in doc["messages"] if m.get("attachments")]
    assert sent["attachments"][0]["file_id"] == file["file_id"]

    # The owner's own import keeps the picture; another user's keeps the text only.
    status, mine = await _raw(api, "POST", "/sessions/import", exported)
    assert status == 201, mine
    other = await bearer_api(other_user)
    status, theirs = await _raw(other, "POST", "/sessions/import", exported)
    assert status == 201, theirs

    async def refs(dialog_id: str) -> list[Any]:
        rows = Message.objects.filter(session__dialog_id=dialog_id, role="user")
        return [m.media_refs async for m in rows.order_by("seq")]

    assert (await refs(mine["dialog_id"]))[0][0]["file_id"] == file["file_id"]
    assert await refs(theirs["dialog_id"]) == [[]]
    status, _data = await other.get(f"/files/{file['file_id']}")
    assert status == 404
