"""The audit records of H2's actions (SPEC H5; PROTOCOL "Audit": import, share link made and
revoked), whoever makes them: the owner over REST, an operator in the admin, `system` from
`manage.py import_dialogs`."""

# covers: H2, H5

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from django.contrib.admin.utils import quote
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from audit.models import AuditEvent
from sessions_app import shares
from tests.api_helpers import Api
from tests.carry_helpers import dialog_with
from tests.test_carry_api import CHATGPT

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


def _records(action: str) -> list[tuple[str, str, str]]:
    return list(
        AuditEvent.objects.filter(action=action)
        .order_by("pk")
        .values_list("actor", "target_type", "target_id")
    )


async def test_import_and_share_links_over_rest_are_recorded(api: Api, user: Any) -> None:
    status, created = await api.post("/sessions/import", CHATGPT)
    assert status == 201, created
    imported = [r async for r in AuditEvent.objects.filter(action="dialog.import").values()]
    assert [(r["actor"], r["target_type"]) for r in imported] == [("alice", "dialog")]
    assert imported[0]["details"]["session_id"] == created["session_id"]
    assert imported[0]["details"]["via"] == "rest"

    status, share = await api.post(f"/sessions/{created['session_id']}/share")
    assert status == 201, share
    status, _ = await api.delete(f"/shares/{share['share_id']}")
    assert status == 204
    made = [r async for r in AuditEvent.objects.filter(action="share.create").values()]
    revoked = [r async for r in AuditEvent.objects.filter(action="share.revoke").values()]
    assert [(r["actor"], r["target_id"]) for r in made] == [("alice", share["share_id"])]
    assert [(r["actor"], r["target_id"]) for r in revoked] == [("alice", share["share_id"])]
    # A refused import leaves no record.
    status, _data = await api.post("/sessions/import", {"hello": "world"})
    assert status == 400
    assert await AuditEvent.objects.filter(action="dialog.import").acount() == 1


def test_operator_revoke_and_command_import_are_recorded(
    client: Client, make_user: Any, tmp_path: Path
) -> None:
    client.force_login(make_user("operator", staff=True))
    frank = make_user("frank")
    session = dialog_with(frank, "q", "a")
    share = shares.share_create(owner=frank, session=session)
    # The admin's URLs carry a key quoted (`quote`: a share's id may hold "_24", which the
    # admin reads as "$").
    url = reverse("admin:sessions_app_share_delete", args=[quote(share.pk)])
    assert client.post(url, {"post": "yes"}).status_code == 302
    assert _records("share.revoke") == [("operator", "share", share.pk)]

    path = tmp_path / "conversations.json"
    path.write_text(json.dumps([CHATGPT]), encoding="utf-8")
    call_command("import_dialogs", "frank", str(path), stdout=io.StringIO(), stderr=io.StringIO())
    assert [actor for actor, _t, _i in _records("dialog.import")] == ["system"]
