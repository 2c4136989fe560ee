"""The audit trail through the channels (SPEC H5, PROTOCOL "Audit"): a rename or delete made
over REST, over the WebSocket (`/rename`, `/delete`) and from a chat app leaves exactly one
record naming who did it and the dialog; a refused one leaves none."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from audit.models import AuditEvent
from audit.trail import Action, Actor, TargetType, audit_record
from sessions_app import services
from sessions_app.models import ChannelAccount, Session
from tests.ws_helpers import bearer, open_ws

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


async def records(action: str) -> list[AuditEvent]:
    return await sync_to_async(lambda: list(AuditEvent.objects.filter(action=action)))()


async def test_rest_rename_and_delete_are_recorded_once_with_the_caller(
    api: Any, user: Any
) -> None:
    # covers: H5
    created = await api.create(dialog_id="plans", title="Old title")
    sid = created["session_id"]
    status, _ = await api.patch(f"/sessions/{sid}", {"title": "New title"})
    assert status == 200
    status, _ = await api.delete(f"/sessions/{sid}")
    assert status == 204

    session = await sync_to_async(Session.objects.get)(dialog_id="plans")
    (rename,) = await records(Action.DIALOG_RENAME)
    assert (rename.actor, rename.actor_user_id) == ("alice", user.pk)
    assert (rename.target_type, rename.target_id) == (TargetType.DIALOG, session.pk)
    assert rename.details["old"] == "Old title" and rename.details["new"] == "New title"
    assert rename.details["session_id"] == sid and rename.details["via"] == "rest"
    assert rename.ip == "127.0.0.1"
    (delete,) = await records(Action.DIALOG_DELETE)
    assert (delete.actor, delete.target_id, delete.details["via"]) == ("alice", session.pk, "rest")


async def test_refused_rest_changes_leave_no_record(api: Any, other_user: Any) -> None:
    # covers: H5
    created = await api.create(dialog_id="mine")
    sid = created["session_id"]
    status, _ = await api.patch(f"/sessions/{sid}", {"title": "   "})  # invalid title
    assert status == 422
    status, _ = await api.delete(f"/sessions/{sid}")
    assert status == 204
    status, _ = await api.delete(f"/sessions/{sid}")  # already deleted
    assert status == 404
    status, _ = await api.patch(f"/sessions/{sid}", {"title": "late"})
    assert status == 404
    # Another user's dialog: not found, nothing recorded.
    theirs = await sync_to_async(Session.objects.create)(
        owner=other_user, channel="web", chat_id=f"u{other_user.pk}", dialog_id="x", title="t"
    )
    status, _ = await api.delete(f"/sessions/{theirs.session_id}")
    assert status == 404
    assert await records(Action.DIALOG_RENAME) == []
    assert len(await records(Action.DIALOG_DELETE)) == 1


async def test_websocket_slash_commands_are_recorded_with_the_proxy_address(
    engine: Any, user: Any
) -> None:
    # covers: H5, B3
    headers = [*await bearer(user), (b"x-forwarded-for", b"198.51.100.7, 203.0.113.9")]
    with override_settings(TRUST_X_FORWARDED_FOR=True):
        ws, connected = await open_ws(headers)
        assert connected
        await ws.until(lambda f: f["type"] == "session_history")
        renamed = await ws.ask({"type": "send", "content": "/rename Trip", "client_msg_id": "r"})
        assert renamed["type"] == "command_result" and renamed["ok"]
        deleted = await ws.ask({"type": "send", "content": "/delete", "client_msg_id": "d"})
        assert deleted["type"] == "command_result" and deleted["ok"]
        await ws.close()

    (rename,) = await records(Action.DIALOG_RENAME)
    (delete,) = await records(Action.DIALOG_DELETE)
    assert rename.target_id == delete.target_id
    for record in (rename, delete):
        assert (record.actor, record.actor_user_id) == ("alice", user.pk)
        assert record.details["via"] == "websocket"
        # The last hop of X-Forwarded-For is the one the trusted proxy appended.
        assert record.ip == "203.0.113.9"
    assert rename.details["new"] == "Trip"


async def test_websocket_ignores_forwarded_for_without_the_trusted_proxy(
    engine: Any, user: Any
) -> None:
    # covers: H5
    headers = [*await bearer(user), (b"x-forwarded-for", b"198.51.100.7")]
    with override_settings(TRUST_X_FORWARDED_FOR=False):
        ws, connected = await open_ws(headers)
        assert connected
        await ws.until(lambda f: f["type"] == "session_history")
        answer = await ws.ask({"type": "send", "content": "/rename Trip", "client_msg_id": "r"})
        assert answer["ok"]
        await ws.close()
    (rename,) = await records(Action.DIALOG_RENAME)
    assert rename.ip is None  # the test connection has no peer address of its own


async def test_chat_app_slash_commands_are_recorded_as_the_chat_identity(bot: Any) -> None:
    # covers: H5, B3
    _update, outcome = await bot.say("/rename Groceries")
    assert outcome == "command"
    _update, outcome = await bot.say("/delete")
    assert outcome == "command"
    account = await sync_to_async(ChannelAccount.objects.select_related("service_user").get)()
    (rename,) = await records(Action.DIALOG_RENAME)
    (delete,) = await records(Action.DIALOG_DELETE)
    for record in (rename, delete):
        assert record.actor == account.service_user.username
        assert record.actor_user_id == account.service_user_id
        assert record.details["via"] == "telegram"
        assert record.ip is None
    assert rename.target_id == delete.target_id
    assert rename.details["new"] == "Groceries"


async def test_a_refused_slash_command_leaves_no_record(
    engine: Any, connect: Any, user: Any
) -> None:
    # covers: H5
    ws = await connect(user)
    answer = await ws.ask({"type": "send", "content": "/rename", "client_msg_id": "r"})
    assert answer["type"] == "error"
    assert await records(Action.DIALOG_RENAME) == []


def test_a_record_is_written_only_inside_the_change_s_transaction(user: Any) -> None:
    # covers: H5: outside a transaction it would commit without the change it records.
    with pytest.raises(RuntimeError):
        audit_record(
            actor=Actor.of_user(user),
            action=Action.DIALOG_RENAME,
            target_type=TargetType.DIALOG,
            target_id="x",
        )
    with transaction.atomic():
        audit_record(
            actor=Actor.of_user(user),
            action=Action.DIALOG_RENAME,
            target_type=TargetType.DIALOG,
            target_id="x",
        )
    assert AuditEvent.objects.filter(target_id="x").count() == 1


async def test_the_embedded_sweep_purges_as_system_and_drops_old_records(
    make_engine: Any, user: Any
) -> None:
    # covers: H5, A7 (embedded mode: the engine's sweep does both purges)
    def setup() -> Session:
        old = services.session_create(
            owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id="old"
        )
        services.session_soft_delete(session=old, actor=Actor.of_user(user))
        Session.objects.filter(pk=old.pk).update(deleted_at=timezone.now() - timedelta(days=40))
        with transaction.atomic():
            audit_record(
                actor=Actor.system(),
                action=Action.TOKEN_ISSUE,
                target_type=TargetType.TOKEN,
                target_id="recent",
            )
        return old

    old = await sync_to_async(setup)()
    # A record past retention: inserted with its old date, as records are never updated.
    await sync_to_async(AuditEvent.objects.create)(
        at=timezone.now() - timedelta(days=400),
        actor="system",
        action=Action.DIALOG_PURGE,
        target_type=TargetType.DIALOG,
        target_id="ancient",
    )
    chat = {**settings.CHAT, "LEASE_SECONDS": 3, "CLEANUP_INTERVAL_SECONDS": 0}
    with override_settings(CHAT=chat):
        await make_engine()
        for _ in range(200):
            if not await sync_to_async(AuditEvent.objects.filter(target_id="ancient").exists)():
                break
            await asyncio.sleep(0.05)
    (purge,) = await records(Action.DIALOG_PURGE)
    assert (purge.target_id, purge.actor, purge.details["via"]) == (old.pk, "system", "sweep")
    assert len(await records(Action.TOKEN_ISSUE)) == 1  # a recent record stays
