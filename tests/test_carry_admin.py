"""The operators' side of SPEC H2: the admin's dialog search through the search index, and
`manage.py import_dialogs` for a whole ChatGPT export."""

# covers: H2

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import pytest
from django.contrib.admin.utils import quote
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse

from sessions_app import services
from sessions_app.models import Message, Session
from tests.carry_helpers import dialog_with
from tests.test_carry_api import CHATGPT

pytestmark = [pytest.mark.django_db, pytest.mark.both_dbs]

CHANGELIST = reverse("admin:sessions_app_session_changelist")


def test_admin_search_finds_messages_through_the_index(client: Client, make_user: Any) -> None:
    client.force_login(make_user("operator", staff=True))
    alice, bob = make_user("alice"), make_user("bob")
    hit = dialog_with(alice, "我们讨论一下数据库迁移", "好")
    gone = dialog_with(bob, "数据库迁移 again", "ok")
    dialog_with(alice, "nothing here", "ok")
    services.session_soft_delete(session=gone)
    response = client.get(CHANGELIST, {"q": "迁移", "deleted": "all"})
    assert response.status_code == 200
    found = {s.pk for s in response.context["cl"].result_list}
    # The operator sees every owner's dialogs, deleted ones too (with the filter).
    assert hit.pk in found and gone.pk in found and len(found) == 2
    response = client.get(CHANGELIST, {"q": "alice"})
    assert {s.owner_id for s in response.context["cl"].result_list} == {alice.pk}


def _export_file(tmp_path: Path, conversations: list[Any]) -> str:
    path = tmp_path / "conversations.json"
    path.write_text(json.dumps(conversations), encoding="utf-8")
    return str(path)


def test_import_dialogs_command_imports_every_conversation(tmp_path: Path, make_user: Any) -> None:
    user = make_user("carol")
    second = copy.deepcopy(CHATGPT)
    second["title"] = "Second trip"
    out, err = io.StringIO(), io.StringIO()
    call_command(
        "import_dialogs", "carol", _export_file(tmp_path, [CHATGPT, second]), stdout=out, stderr=err
    )
    assert "Imported 2 dialog(s) for carol." in out.getvalue()
    assert "2/2" in err.getvalue()  # the progress bar reached the end
    titles = sorted(Session.objects.filter(owner=user).values_list("title", flat=True))
    assert titles == ["Second trip", "Trip to Kyoto"]
    assert Message.objects.filter(session__owner=user).count() == 6  # both branches each


def test_import_dialogs_command_writes_nothing_when_one_is_bad(
    tmp_path: Path, make_user: Any
) -> None:
    user = make_user("dave")
    bad = copy.deepcopy(CHATGPT)
    bad["mapping"]["u1"]["message"]["author"]["role"] = "alien"
    path = _export_file(tmp_path, [CHATGPT, bad])
    with pytest.raises(CommandError, match=r"\[1\] mapping\['u1'\]: unknown author role"):
        call_command("import_dialogs", "dave", path, stdout=io.StringIO(), stderr=io.StringIO())
    assert not Session.objects.filter(owner=user).exists()
    out = io.StringIO()
    call_command("import_dialogs", "dave", path, "--skip-invalid", stdout=out, stderr=io.StringIO())
    assert "Imported 1 dialog(s) for dave; skipped 1." in out.getvalue()
    with pytest.raises(CommandError, match="No user named"):
        call_command("import_dialogs", "nobody", path)


def test_operators_see_and_revoke_share_links(client: Client, make_user: Any) -> None:
    from sessions_app import shares
    from sessions_app.models import Share

    client.force_login(make_user("operator", staff=True))
    erin = make_user("erin")
    session = dialog_with(erin, "a shared question", "a shared answer", title="Shared")
    share = shares.share_create(owner=erin, session=session)
    changelist = reverse("admin:sessions_app_share_changelist")
    response = client.get(changelist, {"q": "erin"})
    assert response.status_code == 200
    assert [s.pk for s in response.context["cl"].result_list] == [share.pk]
    response = client.post(
        reverse("admin:sessions_app_share_delete", args=[quote(share.pk)]), {"post": "yes"}
    )
    assert response.status_code == 302
    assert not Share.objects.filter(pk=share.pk).exists()
    assert client.get(shares.share_url(share.pk)).status_code == 404
