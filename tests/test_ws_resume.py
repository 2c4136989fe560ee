"""A reconnecting socket resumes instead of reloading (PROTOCOL "On connect", issue 57),
through the real ASGI application on both channel layers (in-memory and Redis): nothing
changed -> `sessions` `unchanged` and an empty `history_delta`; a message added meanwhile ->
a delta holding it; a changed branch, a revision too old, a dialog made again under the same
id -> the whole `session_history`; and the list this process keeps for a user's sockets
follows every change announced to their chats."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import pytest
from asgiref.sync import sync_to_async
from django.test import override_settings

from chatcore.engine.lists import etag_of
from sessions_app import services
from sessions_app.models import Message, MessageKind, Session
from sessions_app.services import NewMessage
from tests.engine_helpers import make_dialog
from tests.fakemodel import Reply
from tests.ws_helpers import WS, bearer, open_ws, terminal

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]

USER = MessageKind.USER_INPUT


@pytest.fixture(autouse=True, params=["memory", "redis"])
def layer(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each test on the embedded mode's layer and on Redis's (set before the engine starts:
    autouse fixtures come first)."""
    if request.param == "memory":
        yield request.param
        return
    redis_url = request.getfixturevalue("redis_url")
    layers = {
        "default": {
            "BACKEND": "chatcore.common.redislayer.RedisPubSubLayer",
            "CONFIG": {"hosts": [redis_url], "prefix": f"resume{uuid.uuid4().hex[:8]}"},
        }
    }
    with override_settings(CHANNEL_LAYERS=layers):
        yield request.param


async def opened(user: Any, **holds: Any) -> tuple[WS, dict[str, Any], dict[str, Any]]:
    """A socket of `user` saying it holds `holds` (query parameters): it and its two first
    frames (`sessions`, then its history)."""
    path = "/ws/chat/" + ("?" + urlencode(holds) if holds else "")
    ws, connected = await open_ws(await bearer(user), path)
    assert connected
    sessions, history = await ws.next(), await ws.next()
    assert sessions["type"] == "sessions"
    return ws, sessions, history


def holds_of(sessions: dict[str, Any], history: dict[str, Any]) -> dict[str, Any]:
    """What a client shows after these frames, as the web chat says it on reconnect."""
    messages = history["messages"]
    out = {
        "dialog_id": history["dialog_id"],
        "since": history["history_revision"],
        "sessions_etag": sessions["etag"],
    }
    if messages:
        out["last_id"] = messages[-1]["id"]
    return out


async def shown_now(sessions: dict[str, Any], history: dict[str, Any]) -> dict[str, Any]:
    """`holds_of`, after the client applied every delta since: it shows the dialog's newest
    message at its seq."""
    newest = await sync_to_async(
        lambda: Message.objects.filter(session__dialog_id=history["dialog_id"]).latest("seq")
    )()
    return {**holds_of(sessions, history), "since": newest.seq, "last_id": str(newest.id)}


async def one_turn(ws: WS, fake_model: Any, text: str, answer: str) -> None:
    fake_model.script(Reply(text=answer))
    await ws.send({"type": "send", "content": text, "client_msg_id": text})
    queued = await ws.until(lambda f: f["type"] == "queued")
    await ws.until(terminal(queued[-1]["turn_id"]))


async def test_nothing_changed_gets_unchanged_and_an_empty_delta(user: Any, engine: Any) -> None:
    # covers: D2, D3 (PROTOCOL "On connect": resume instead of reload)
    await make_dialog(user, "alpha")
    ws, sessions, history = await opened(user)
    assert sessions["etag"] and history["type"] == "session_history"
    await ws.close()

    again, resumed_sessions, delta = await opened(user, **holds_of(sessions, history))
    assert resumed_sessions["unchanged"] is True
    assert resumed_sessions["etag"] == sessions["etag"]
    assert resumed_sessions["current"] == "alpha" and "items" not in resumed_sessions
    assert delta["type"] == "history_delta"
    assert delta["base_revision"] == delta["history_revision"] == history["history_revision"]
    assert delta["messages"] == [] and delta["active_turn"] is None and delta["queue"] == []
    # The socket works as any other, and nothing else came.
    assert await again.drain() == []
    await again.send({"type": "sessions", "client_msg_id": "s"})
    answer = await again.until(lambda f: f.get("client_msg_id") == "s")
    assert answer[-1]["etag"] == sessions["etag"] and answer[-1]["items"] == sessions["items"]
    await again.close()


async def test_a_message_added_meanwhile_comes_as_the_delta(
    user: Any, engine: Any, fake_model: Any
) -> None:
    # covers: D2 (the delta from the revision the client holds)
    await make_dialog(user, "alpha")
    ws, sessions, history = await opened(user)
    await one_turn(ws, fake_model, "first", "first answer")
    await ws.close()
    # The client saw the first turn through its deltas; it holds their revision.
    holds = await shown_now(sessions, history)

    other, _s, _h = await opened(user)  # another tab talks while this one is away
    await one_turn(other, fake_model, "second", "second answer")
    await other.close()

    again, resumed_sessions, delta = await opened(user, **holds)
    assert "unchanged" not in resumed_sessions  # the dialog's count and time changed
    assert resumed_sessions["etag"] != sessions["etag"]
    assert delta["type"] == "history_delta" and delta["base_revision"] == holds["since"]
    assert [(m["role"], m["content"]) for m in delta["messages"]] == [
        ("user", "second"),
        ("assistant", "second answer"),
    ]
    assert delta["history_revision"] == delta["messages"][-1]["seq"]
    await again.close()


async def test_a_running_turn_comes_whole_in_the_delta(
    user: Any, engine: Any, fake_model: Any
) -> None:
    # covers: D1, D3 (a socket that joins mid-turn gets its full text, then the tails)
    await make_dialog(user, "alpha")
    ws, sessions, history = await opened(user)
    gate = threading.Event()
    fake_model.script(Reply(text="streamed so far", gate=gate))  # held before its end
    await ws.send({"type": "send", "content": "go", "client_msg_id": "go"})
    frames = await ws.until(lambda f: f["type"] == "turn_snapshot")
    started = next(f for f in frames if f["type"] == "history_delta")
    holds = holds_of(sessions, history)
    holds["since"] = started["history_revision"]
    holds["last_id"] = started["messages"][-1]["id"]
    await ws.close()
    try:
        again, _sessions, delta = await opened(user, **holds)
        assert delta["type"] == "history_delta" and delta["messages"] == []
        turn = delta["active_turn"]
        assert turn["text_offset"] == 0 and "streamed so far".startswith(turn["text"])
        assert turn["text"]
    finally:
        gate.set()
    frames = await again.until(terminal(turn["turn_id"]))
    assert frames[-1]["status"] == "completed"
    await again.close()


async def test_a_changed_branch_sends_the_whole_history(
    user: Any, engine: Any, fake_model: Any
) -> None:
    # covers: H1, D2 (the active path changed while the client was away)
    await make_dialog(user, "alpha")
    ws, sessions, history = await opened(user)
    await one_turn(ws, fake_model, "question", "answer one")
    held = await shown_now(sessions, history)
    question = await sync_to_async(
        lambda: Message.objects.get(session__dialog_id="alpha", role="user")
    )()
    fake_model.script(Reply(text="answer to the edit"))
    await ws.send(
        {"type": "edit", "seq": question.seq, "content": "question?", "client_msg_id": "e"}
    )
    queued = await ws.until(lambda f: f.get("client_msg_id") == "e")
    await ws.until(terminal(queued[-1]["turn_id"]))
    await ws.close()

    again, _sessions, page = await opened(user, **held)
    assert page["type"] == "session_history"
    assert [m["content"] for m in page["messages"] if m["role"] != "system"] == [
        "question?",
        "answer to the edit",
    ]
    await again.close()


async def test_an_old_revision_or_another_dialog_sends_the_whole_history(
    user: Any, engine: Any
) -> None:
    # covers: D2 (a gap too old to send as a delta; a client showing something else)
    session = await make_dialog(user, "alpha")

    def grow() -> None:
        notes = [NewMessage(role="user", content=f"note {i}", kind=USER) for i in range(120)]
        services.messages_append(session_pk=session.pk, messages=notes)

    await sync_to_async(grow)()
    ws, sessions, history = await opened(user)
    await ws.close()
    holds = holds_of(sessions, history)
    assert history["history_revision"] == 121
    # Far behind: more than a page of messages came since.
    again, _s, page = await opened(user, **{**holds, "since": 5, "last_id": ""})
    assert page["type"] == "session_history" and page["history_revision"] == 121
    await again.close()
    # A newest message this dialog does not hold.
    again, _s, page = await opened(user, **{**holds, "last_id": str(uuid.uuid4())})
    assert page["type"] == "session_history"
    await again.close()
    # A revision it never had.
    again, _s, page = await opened(user, **{**holds, "since": 500})
    assert page["type"] == "session_history"
    await again.close()
    # Nonsense is no resume, never an error.
    again, _s, page = await opened(user, dialog_id="alpha", since="x", last_id="y")
    assert page["type"] == "session_history"
    await again.close()


async def test_a_dialog_made_again_under_its_id_sends_the_whole_history(
    user: Any, engine: Any
) -> None:
    # covers: A1, D2 (a re-created dialog reuses its session id; its seqs start again)
    first = await make_dialog(user, "alpha")
    ws, sessions, history = await opened(user)
    await ws.close()
    holds = holds_of(sessions, history)
    await sync_to_async(services.session_soft_delete)(session=first)
    await make_dialog(user, "alpha")

    again, _s, page = await opened(user, **holds)
    assert page["type"] == "session_history" and page["dialog_id"] == "alpha"
    assert page["messages"][0]["id"] != holds["last_id"]
    await again.close()


async def test_the_list_kept_for_a_users_sockets_follows_every_change(
    user: Any, engine: Any
) -> None:
    # covers: D3, F7 (one list read for a user's sockets; a change shows on the next one)
    alpha = await make_dialog(user, "alpha")
    await make_dialog(user, "beta")
    lists = engine.openings.lists
    first, sessions, _h = await opened(user)
    second, same, _h2 = await opened(user)
    assert same["etag"] == sessions["etag"] and lists.reads == 1

    await sync_to_async(services.session_rename)(session=alpha, title="Renamed")
    third, renamed, _h3 = await opened(user, sessions_etag=sessions["etag"])
    assert "unchanged" not in renamed and renamed["etag"] != sessions["etag"]
    assert {i["title"] for i in renamed["items"]} >= {"Renamed"}
    # The sockets already open were told as they always were.
    updated = await first.until(lambda f: f["type"] == "session_updated")
    assert updated[-1]["title"] == "Renamed"
    # A dialog made elsewhere (the REST API's chat of this user) is in the next list too.
    await make_dialog(user, "gamma", channel="api")
    fourth, grown, _h4 = await opened(user)
    assert f"api:u{user.pk}:gamma" in {i["session_id"] for i in grown["items"]}
    for ws in (first, second, third, fourth):
        await ws.close()


async def test_the_etag_is_a_stable_digest_of_what_the_list_shows(user: Any, engine: Any) -> None:
    # covers: D3 (the same list, the same etag, in any process; any shown field changes it)
    await make_dialog(user, "alpha")
    ws, sessions, _history = await opened(user)
    await ws.close()
    items = sessions["items"]
    assert etag_of(items) == sessions["etag"] == etag_of([dict(i) for i in items])
    for field, value in (("title", "x"), ("message_count", 7), ("last_active_at", "x")):
        assert etag_of([{**items[0], field: value}]) != sessions["etag"]
    session = await sync_to_async(Session.objects.get)(dialog_id="alpha")
    assert session.session_id == items[0]["session_id"]
