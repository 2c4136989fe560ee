"""Deleting a dialog (`chatcore/engine/dialogs.py`; SPEC A7, C9): the REST route, `/delete` and
the operators' admin share one `delete_dialog`, so a delete from any of them ends the running
turn as stale at once, drops the queued sends and tells the dialog's clients."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.test import Client
from django.urls import reverse

from sessions_app.models import Session, Turn
from tests.api_helpers import engine_with, wait_turn_row
from tests.fakemodel import FakeModelServer, Reply

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]

CHANGELIST = reverse("admin:sessions_app_session_changelist")
# The running turn reads its row's cancel flag only at a checkpoint: with checkpoints this
# rare, only the cancel signal a delete sends can end it while the test waits.
NO_CHECKPOINTS = {"CHECKPOINT_SECONDS": 3600.0}


async def test_admin_soft_delete_ends_the_running_turn_as_stale_and_clients_see_it(
    connect: Any, make_engine: Any, make_user: Any, user: Any, fake_model: FakeModelServer
) -> None:
    # covers: C9, A7, E2
    async with engine_with(make_engine, **NO_CHECKPOINTS):
        ws = await connect(user)
        fake_model.script(Reply(text="never ending", endless=True))
        running = await ws.ask({"type": "send", "content": "go on", "client_msg_id": "r"})
        queued = await ws.ask({"type": "send", "content": "then this", "client_msg_id": "q"})
        await fake_model.requests_made(1)  # the turn is past its model request
        session = await sync_to_async(
            lambda: Turn.objects.select_related("session").get(pk=running["turn_id"]).session
        )()

        operator = await sync_to_async(make_user)("operator", staff=True)
        client = Client()
        await sync_to_async(client.force_login)(operator)
        response = await sync_to_async(client.post)(
            CHANGELIST,
            {"action": "soft_delete_selected", ACTION_CHECKBOX_NAME: [session.pk]},
            follow=True,
        )
        assert response.status_code == 200
        # The dialog's client sees both turns end, cancelled as stale (the queued one first
        # or not: frames are collected until both have ended).
        ended: dict[str, dict[str, Any]] = {}
        wanted = {running["turn_id"], queued["turn_id"]}
        frames = await ws.until(
            lambda f: (
                f["type"] == "turn_updated"
                and f["turn_id"] in wanted
                and ended.setdefault(f["turn_id"], f) is not None
                and set(ended) == wanted
            )
        )
        assert frames
        for ack in (running, queued):
            assert ended[ack["turn_id"]]["status"] == "cancelled"
            assert ended[ack["turn_id"]]["reason"] == "stale"
            turn = await wait_turn_row(ack["turn_id"])
            assert (turn.status, turn.reason) == ("cancelled", "stale")

        # ...and the dialog leaves its list (A7): a `sessions` frame without it, among the
        # frames read so far (it may come before the second turn's end) or still to come.
        def without_the_dialog(f: dict[str, Any]) -> bool:
            return f["type"] == "sessions" and session.session_id not in {
                i["session_id"] for i in f["items"]
            }

        if not any(without_the_dialog(f) for f in frames):
            await ws.until(without_the_dialog)
        refreshed = await sync_to_async(Session.objects.get)(pk=session.pk)
        assert refreshed.deleted_at is not None
        assert await sync_to_async(Turn.objects.filter(status="running").count)() == 0


async def test_slash_delete_ends_the_running_turn_as_stale(
    connect: Any, make_engine: Any, user: Any, fake_model: FakeModelServer
) -> None:
    # covers: C9, A7, B3
    async with engine_with(make_engine, **NO_CHECKPOINTS):
        ws = await connect(user)
        fake_model.script(Reply(text="never ending", endless=True))
        running = await ws.ask({"type": "send", "content": "go on", "client_msg_id": "r"})
        await fake_model.requests_made(1)
        answer = await ws.ask({"type": "send", "content": "/delete", "client_msg_id": "d"})
        assert answer["type"] == "command_result" and answer["command"] == "delete"
        turn = await wait_turn_row(running["turn_id"])
        assert (turn.status, turn.reason) == ("cancelled", "stale")


async def test_rest_delete_ends_the_running_turn_as_stale(
    api: Any, make_engine: Any, fake_model: FakeModelServer
) -> None:
    # covers: C9, A7, E3
    async with engine_with(make_engine, **NO_CHECKPOINTS):
        s = await api.create(dialog_id="busy")
        fake_model.script(Reply(text="never ending", endless=True))
        ack = await api.send(s["session_id"], "go on")
        await fake_model.requests_made(1)
        status, _ = await api.delete(f"/sessions/{s['session_id']}")
        assert status == 204
        turn = await wait_turn_row(ack["turn_id"])
        assert (turn.status, turn.reason) == ("cancelled", "stale")
