"""The audit trail (SPEC H5, PROTOCOL "Audit"): the operators' actions in the admin, the
`issue_token` command and the purge sweep each leave exactly one record with the right actor
and target (a refused one none); the records are read-only in the admin, even for a
superuser, and cannot be changed in code; `manage.py audit` exports them; retention purges
only what is older."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.management import CommandError, call_command
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from audit.models import Action, AppendOnly, AuditEvent, TargetType
from audit.trail import Actor, audit_purge_expired, client_ip
from sessions_app import services
from sessions_app.chatapps import store
from sessions_app.models import ApiToken, ChannelAccount, MemoryNote, Session
from tests.test_admin import NO_INLINE_FORMS, form_inputs

pytestmark = [pytest.mark.django_db, pytest.mark.both_dbs]

SESSIONS = reverse("admin:sessions_app_session_changelist")
TOKENS = reverse("admin:sessions_app_apitoken_changelist")
AUDIT = reverse("admin:audit_auditevent_changelist")


@pytest.fixture
def operator(make_user: Callable[..., Any]) -> Any:
    return make_user("ops", staff=True)


@pytest.fixture
def client(operator: Any) -> Client:
    c = Client(REMOTE_ADDR="192.0.2.10")
    c.force_login(operator)
    return c


def dialog(owner: Any, dialog_id: str, title: str | None = None) -> Session:
    return services.session_create(
        owner=owner, channel="web", chat_id=f"u{owner.pk}", dialog_id=dialog_id, title=title
    )


def only(action: str) -> AuditEvent:
    (record,) = AuditEvent.objects.filter(action=action)
    return record


def assert_by_operator(record: AuditEvent, operator: Any, target: tuple[str, str]) -> None:
    assert (record.actor, record.actor_user_id) == ("ops", operator.pk)
    assert (record.target_type, record.target_id) == target
    assert record.details["via"] == "admin"
    assert record.ip == "192.0.2.10"


def action(client: Client, url: str, name: str, *pks: Any, **extra: str) -> Any:
    return client.post(url, {"action": name, ACTION_CHECKBOX_NAME: list(pks), **extra})


# --- Dialogs in the admin -----------------------------------------------------------------


def test_admin_rename_delete_restore_and_purge_are_each_recorded_once(
    client: Client, operator: Any, user: Any
) -> None:
    # covers: H5, E2
    s = dialog(user, "d1", "Before")
    change = reverse("admin:sessions_app_session_change", args=[s.pk])
    form = form_inputs(client.get(change))
    response = client.post(change, {**form, **NO_INLINE_FORMS, "title": "After"})
    assert response.status_code == 302
    rename = only(Action.DIALOG_RENAME)
    assert_by_operator(rename, operator, ("dialog", s.pk))
    assert (rename.details["old"], rename.details["new"]) == ("Before", "After")
    assert rename.details["session_id"] == s.session_id and rename.details["owner_id"] == user.pk

    action(client, SESSIONS, "soft_delete_selected", s.pk)
    assert_by_operator(only(Action.DIALOG_DELETE), operator, ("dialog", s.pk))
    action(client, SESSIONS, "restore_selected", s.pk)
    assert_by_operator(only(Action.DIALOG_RESTORE), operator, ("dialog", s.pk))
    action(client, SESSIONS, "purge_selected", s.pk, post="yes")
    assert not Session.objects.filter(pk=s.pk).exists()
    purge = only(Action.DIALOG_PURGE)
    assert_by_operator(purge, operator, ("dialog", s.pk))
    # The record still names the dialog it was.
    assert purge.details["session_id"] == s.session_id


def test_the_delete_button_records_a_purge(client: Client, operator: Any, user: Any) -> None:
    # covers: H5
    s = dialog(user, "d2")
    url = reverse("admin:sessions_app_session_delete", args=[s.pk])
    assert client.post(url, {"post": "yes"}).status_code == 302
    assert_by_operator(only(Action.DIALOG_PURGE), operator, ("dialog", s.pk))


def test_refused_admin_actions_leave_no_record(client: Client, user: Any) -> None:
    # covers: H5
    gone = dialog(user, "same")
    services.session_soft_delete(session=gone)
    dialog(user, "same")  # a live dialog took the id: the restore is refused
    AuditEvent.objects.all().purge_older_than(timezone.now() + timedelta(days=1))
    response = action(client, SESSIONS, "restore_selected", gone.pk)
    assert response.status_code == 302
    # An empty title is refused by the form.
    live = Session.objects.get(dialog_id="same", deleted_at__isnull=True)
    change = reverse("admin:sessions_app_session_change", args=[live.pk])
    form = form_inputs(client.get(change))
    assert client.post(change, {**form, **NO_INLINE_FORMS, "title": ""}).status_code == 200
    # Soft-deleting an already deleted dialog does nothing.
    action(client, SESSIONS, "soft_delete_selected", gone.pk)
    assert set(AuditEvent.objects.values_list("action", flat=True)) <= {"admin.view_dialog"}


def test_an_operator_opening_another_user_s_dialog_is_recorded(
    client: Client, operator: Any, user: Any
) -> None:
    # covers: H5
    theirs = dialog(user, "private")
    own = dialog(operator, "mine")
    assert (
        client.get(reverse("admin:sessions_app_session_change", args=[own.pk])).status_code == 200
    )
    assert not AuditEvent.objects.exists()
    url = reverse("admin:sessions_app_session_change", args=[theirs.pk])
    page = client.get(url, {"messages_page": "1"})
    assert page.status_code == 200
    view = only(Action.ADMIN_VIEW_DIALOG)
    assert_by_operator(view, operator, ("dialog", theirs.pk))
    assert view.details["owner_id"] == user.pk and view.details["messages_page"] == "1"
    # The page links to this dialog's trail, which lists that record.
    history = f"{AUDIT}?target_type=dialog&amp;target_id={theirs.pk}"
    assert history in page.content.decode()
    listed = client.get(f"{AUDIT}?target_type=dialog&target_id={theirs.pk}")
    assert list(listed.context["cl"].result_list) == [view]


def test_admin_regenerate_title_and_compact_are_recorded(
    client: Client, operator: Any, user: Any
) -> None:
    # covers: H5, B4, B5
    s = dialog(user, "d3", "Named")
    action(client, SESSIONS, "regenerate_title_selected", s.pk)
    reset = only(Action.DIALOG_RENAME)
    assert_by_operator(reset, operator, ("dialog", s.pk))
    assert (reset.details["old"], reset.details["new"]) == ("Named", "Dialog d3")
    action(client, SESSIONS, "compact_selected", s.pk)
    assert_by_operator(only(Action.DIALOG_COMPACT), operator, ("dialog", s.pk))


def test_an_operator_opening_another_user_s_message_or_turn_is_recorded(
    client: Client, operator: Any, user: Any
) -> None:
    # covers: H5
    s = dialog(user, "m")
    appended = services.messages_append(
        session_pk=s.pk,
        messages=[services.NewMessage(role="user", content="secret", kind="user_input")],
    )
    (message,) = appended.messages
    url = reverse("admin:sessions_app_message_change", args=[message.pk])
    assert client.get(url).status_code == 200
    view = only(Action.ADMIN_VIEW_DIALOG)
    assert_by_operator(view, operator, ("dialog", s.pk))
    assert view.details["message_seq"] == message.seq
    # The list is not recorded; a page that is not shown (404) is not either.
    assert client.get(reverse("admin:sessions_app_message_changelist")).status_code == 200
    missing = reverse("admin:sessions_app_message_change", args=["0" * 32])
    assert client.get(missing).status_code in (302, 404)
    assert AuditEvent.objects.count() == 1


def test_an_operator_s_changes_of_memory_notes_are_recorded(
    client: Client, operator: Any, user: Any
) -> None:
    # covers: H5, C8
    add = reverse("admin:sessions_app_memorynote_add")
    assert client.post(add, {"owner": user.pk, "content": "likes tea"}).status_code == 302
    note = MemoryNote.objects.get()
    change = reverse("admin:sessions_app_memorynote_change", args=[note.pk])
    assert client.post(change, {"owner": user.pk, "content": "likes coffee"}).status_code == 302
    delete = reverse("admin:sessions_app_memorynote_delete", args=[note.pk])
    assert client.post(delete, {"post": "yes"}).status_code == 302
    records = list(AuditEvent.objects.order_by("id"))
    assert [r.details["op"] for r in records] == ["add", "change", "delete"]
    for record in records:
        assert record.action == Action.MEMORY_NOTE_CHANGE
        assert_by_operator(record, operator, ("memory_note", str(note.pk)))
        assert record.details["owner"] == "alice"
    # The bulk delete too, one record per note.
    notes = [MemoryNote.objects.create(owner=user, content=f"n{i}") for i in range(2)]
    changelist = reverse("admin:sessions_app_memorynote_changelist")
    action(client, changelist, "delete_selected", *[n.pk for n in notes], post="yes")
    assert not MemoryNote.objects.exists()
    assert AuditEvent.objects.filter(details__op="delete").count() == 3


def test_an_operator_s_change_of_a_dialog_s_settings_is_recorded(
    client: Client, operator: Any, user: Any, settings: Any
) -> None:
    # covers: H5, H4
    from tests.fakemodel import FakeModelServer

    server = FakeModelServer().start()
    server.models = ["fake", "big-model"]
    settings.LLM = {**settings.LLM, "BASE_URL": server.url, "MODEL": "fake", "MODELS": []}
    try:
        s = dialog(user, "set")
        change = reverse("admin:sessions_app_session_change", args=[s.pk])
        form = {**form_inputs(client.get(change)), **NO_INLINE_FORMS}
        response = client.post(change, {**form, "model": "big-model", "system_prompt": "Be brief."})
        assert response.status_code == 302
        record = only(Action.DIALOG_SETTINGS)
        assert_by_operator(record, operator, ("dialog", s.pk))
        # The new model, and the prompt's length only: the trail keeps no instructions.
        assert (record.details["model"], record.details["system_prompt"]) == ("big-model", 9)
        # A refused model changes nothing and records nothing.
        response = client.post(change, {**form, "model": "gpt-17", "system_prompt": "Be brief."})
        assert response.status_code == 200
        assert AuditEvent.objects.filter(action=Action.DIALOG_SETTINGS).count() == 1
    finally:
        server.stop()


# --- Tokens, chat accounts, users ---------------------------------------------------------


def test_admin_token_issue_and_revoke_are_recorded_with_the_token_s_user(
    client: Client, operator: Any, user: Any
) -> None:
    # covers: H5, F2
    add = reverse("admin:sessions_app_apitoken_add")
    assert client.post(add, {"user": user.pk, "name": "laptop"}).status_code == 302
    token = ApiToken.objects.get()
    issue = only(Action.TOKEN_ISSUE)
    assert_by_operator(issue, operator, ("token", str(token.pk)))
    assert issue.details["user"] == "alice" and issue.details["name"] == "laptop"
    # No secret in the record.
    assert token.key_hash not in json.dumps(issue.details)

    action(client, TOKENS, "revoke_selected", token.pk)
    revoke = only(Action.TOKEN_REVOKE)
    assert_by_operator(revoke, operator, ("token", str(token.pk)))
    assert revoke.details["user"] == "alice"
    # Revoking it again changes nothing and records nothing.
    services.api_token_revoke(token=token, actor=Actor.of_user(operator))
    assert AuditEvent.objects.filter(action=Action.TOKEN_REVOKE).count() == 1
    page = client.get(reverse("admin:sessions_app_apitoken_change", args=[token.pk]))
    assert f"target_type=token&amp;target_id={token.pk}" in page.content.decode()


def test_issue_token_command_is_recorded_as_system(user: Any) -> None:
    # covers: H5, PROTOCOL Commands
    call_command("issue_token", "alice", "--name", "ci", stdout=io.StringIO())
    issue = only(Action.TOKEN_ISSUE)
    assert (issue.actor, issue.actor_user_id, issue.ip) == ("system", None, None)
    assert issue.details == {
        "user": "alice",
        "name": "ci",
        "prefix": ApiToken.objects.get().prefix,
        "via": "manage.py issue_token",
    }
    with pytest.raises(CommandError):
        call_command("issue_token", "nobody", stdout=io.StringIO())
    assert AuditEvent.objects.count() == 1


def test_admin_chat_account_link_and_unlink_are_recorded(
    client: Client, operator: Any, make_user: Any
) -> None:
    # covers: H5, A1
    person = make_user("carol")
    account = store.account_get_or_create(channel="telegram", external_id="77", display_name="C")
    url = reverse("admin:sessions_app_channelaccount_change", args=[account.pk])
    assert client.post(url, {"user": str(person.pk), "writable": "on"}).status_code == 302
    link = only(Action.CHAT_ACCOUNT_LINK)
    assert_by_operator(link, operator, ("chat_account", str(account.pk)))
    assert link.details["user"] == "carol" and link.details["writable"] is True
    assert link.details["account"] == "telegram:77"
    # Saving it unchanged records nothing.
    assert client.post(url, {"user": str(person.pk), "writable": "on"}).status_code == 302
    assert AuditEvent.objects.count() == 1
    assert client.post(url, {"user": ""}).status_code == 302
    unlink = only(Action.CHAT_ACCOUNT_UNLINK)
    assert_by_operator(unlink, operator, ("chat_account", str(account.pk)))
    assert unlink.details["previous_user"] == "carol" and unlink.details["user"] is None
    assert ChannelAccount.objects.get().user_id is None
    page = client.get(url)
    assert f"target_type=chat_account&amp;target_id={account.pk}" in page.content.decode()


def test_admin_user_staff_and_active_changes_are_recorded(
    client: Client, operator: Any, user: Any
) -> None:
    # covers: H5
    url = reverse("admin:auth_user_change", args=[user.pk])
    page = client.get(url)
    assert f"target_type=user&amp;target_id={user.pk}" in page.content.decode()
    # ... and the actions the user made.
    services.session_rename(session=dialog(user, "u"), title="Mine", actor=Actor.of_user(user))
    by_user = client.get(f"{AUDIT}?actor_user__id__exact={user.pk}")
    assert [r.action for r in by_user.context["cl"].result_list] == [Action.DIALOG_RENAME]
    assert f"{AUDIT}?actor_user__id__exact={user.pk}" in page.content.decode()
    form = form_inputs(page)
    # Unchanged flags (active, not staff): nothing to record.
    assert client.post(url, {**form, "is_active": "on"}).status_code == 302
    assert not AuditEvent.objects.filter(action=Action.USER_CHANGE).exists()
    assert client.post(url, {**form, "is_staff": "on"}).status_code == 302  # and inactive
    change = only(Action.USER_CHANGE)
    assert_by_operator(change, operator, ("user", str(user.pk)))
    assert change.details["is_staff"] == [False, True]
    assert change.details["is_active"] == [True, False]
    assert change.details["user"] == "alice"
    # A refused save (a bad username) leaves none.
    assert client.post(url, {**form, "username": "bad name!", "is_active": "on"}).status_code == 200
    assert AuditEvent.objects.filter(action=Action.USER_CHANGE).count() == 1


def test_ensure_demo_user_reset_of_flags_is_recorded_as_system(make_user: Any) -> None:
    # covers: H5
    demo = make_user("demo")
    assert not demo.is_staff
    call_command("ensure_demo_user", "--reset", "--staff", stdout=io.StringIO())
    change = only(Action.USER_CHANGE)
    assert (change.actor, change.target_id) == ("system", str(demo.pk))
    assert change.details["is_staff"] == [False, True]
    assert change.details["via"] == "manage.py ensure_demo_user"
    # Nothing changes the second time: nothing recorded.
    call_command("ensure_demo_user", "--reset", "--staff", stdout=io.StringIO())
    assert AuditEvent.objects.filter(action=Action.USER_CHANGE).count() == 1


def test_admin_user_deletion_is_recorded(client: Client, operator: Any, make_user: Any) -> None:
    # covers: H5
    gone, kept = make_user("gone"), make_user("kept")
    dialog(kept, "a")
    # A user with dialogs cannot be deleted here (their messages are read-only): no record.
    assert (
        client.post(reverse("admin:auth_user_delete", args=[kept.pk]), {"post": "yes"}).status_code
        == 403
    )
    url = reverse("admin:auth_user_delete", args=[gone.pk])
    assert client.post(url, {"post": "yes"}).status_code == 302
    deleted = only(Action.USER_DELETE)
    assert_by_operator(deleted, operator, ("user", str(gone.pk)))
    assert deleted.details["user"] == "gone"
    # The record outlives the user it names.
    assert deleted.actor_user_id == operator.pk
    assert AuditEvent.objects.count() == 1


# --- The sweep and retention --------------------------------------------------------------


def test_the_purge_sweep_is_recorded_as_system(user: Any) -> None:
    # covers: H5, A7
    s = dialog(user, "old")
    services.session_soft_delete(session=s, actor=Actor.of_user(user))
    later = timezone.now() + timedelta(days=400)
    assert services.sessions_purge_expired(now=later) == 1
    purge = only(Action.DIALOG_PURGE)
    assert (purge.actor, purge.actor_user_id, purge.details["via"]) == ("system", None, "sweep")
    assert purge.target_id == s.pk
    assert only(Action.DIALOG_DELETE).actor == "alice"


def test_retention_purges_only_older_records(user: Any) -> None:
    # covers: H5
    now = timezone.now()
    for age in (400, 366, 364, 1):
        AuditEvent.objects.create(
            at=now - timedelta(days=age),
            actor="alice",
            action=Action.DIALOG_RENAME,
            target_type=TargetType.DIALOG,
            target_id=f"d{age}",
        )
    assert audit_purge_expired(now=now) == 2
    assert sorted(AuditEvent.objects.values_list("target_id", flat=True)) == ["d1", "d364"]
    with override_settings(CHAT={**_chat(), "AUDIT_RETENTION_DAYS": 0}):
        assert audit_purge_expired(now=now + timedelta(days=5000)) == 0
    assert AuditEvent.objects.count() == 2


def test_the_scheduled_purge_also_purges_old_audit_records(user: Any) -> None:
    # covers: H5 (scaled mode: the beat's purge task; embedded: the engine's sweep)
    from sessions_app.tasks import purge_deleted_sessions

    old = timezone.now() - timedelta(days=366)
    for when, target in ((old, "old"), (timezone.now(), "new")):
        AuditEvent.objects.create(
            at=when,
            actor="system",
            action=Action.DIALOG_PURGE,
            target_type=TargetType.DIALOG,
            target_id=target,
        )
    purge_deleted_sessions()
    assert list(AuditEvent.objects.values_list("target_id", flat=True)) == ["new"]


def _chat() -> dict[str, Any]:
    from django.conf import settings

    return dict(settings.CHAT)


# --- Read-only ----------------------------------------------------------------------------


def test_records_cannot_be_changed_or_deleted_even_by_a_superuser(
    client: Client, operator: Any, user: Any
) -> None:
    # covers: H5
    assert operator.is_superuser
    services.session_rename(session=dialog(user, "r"), title="T", actor=Actor.of_user(user))
    record = only(Action.DIALOG_RENAME)
    change = reverse("admin:audit_auditevent_change", args=[record.pk])
    page = client.get(change)
    assert page.status_code == 200  # viewable, read-only
    assert 'name="_save"' not in page.content.decode()
    assert client.post(change, {"actor": "someone"}).status_code == 403
    delete = reverse("admin:audit_auditevent_delete", args=[record.pk])
    assert client.get(delete).status_code == 403
    assert client.post(delete, {"post": "yes"}).status_code == 403
    assert client.get(reverse("admin:audit_auditevent_add")).status_code == 403
    listing = client.get(AUDIT)
    assert listing.status_code == 200
    assert listing.context["cl"].model_admin.get_actions(listing.wsgi_request) == {}
    # And in code: the model and its queryset refuse too.
    record.actor = "someone"
    with pytest.raises(AppendOnly):
        record.save()
    with pytest.raises(AppendOnly):
        record.delete()
    with pytest.raises(AppendOnly):
        AuditEvent.objects.filter(pk=record.pk).update(actor="someone")
    with pytest.raises(AppendOnly):
        AuditEvent.objects.all().delete()
    record.refresh_from_db()
    assert record.actor == "alice"


def test_admin_list_filters_by_action_actor_and_date(client: Client, user: Any) -> None:
    # covers: H5
    s = dialog(user, "f")
    services.session_rename(session=s, title="T", actor=Actor.of_user(user))
    services.session_soft_delete(session=s, actor=Actor.system())
    by_action = client.get(AUDIT, {"action": "dialog.delete"})
    assert [r.action for r in by_action.context["cl"].result_list] == ["dialog.delete"]
    by_actor = client.get(AUDIT, {"actor": "alice"})
    assert [r.actor for r in by_actor.context["cl"].result_list] == ["alice"]
    # As the date filter's own "Today" link says it: midnight in the current time zone.
    today = timezone.localtime().replace(hour=0, minute=0, second=0, microsecond=0)
    by_date = client.get(AUDIT, {"at__gte": str(today), "at__lt": str(today + timedelta(days=1))})
    assert len(by_date.context["cl"].result_list) == 2
    searched = client.get(AUDIT, {"q": s.pk})
    assert len(searched.context["cl"].result_list) == 2


# --- manage.py audit ----------------------------------------------------------------------


def audit_lines(*args: str) -> list[dict[str, Any]]:
    out = io.StringIO()
    call_command("audit", *args, stdout=out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_audit_command_prints_json_lines_oldest_first_and_filters(user: Any) -> None:
    # covers: H5, PROTOCOL Audit
    now = timezone.now()
    for days, act in (
        (3, Action.DIALOG_DELETE),
        (2, Action.DIALOG_RENAME),
        (1, Action.DIALOG_RENAME),
    ):
        AuditEvent.objects.create(
            at=now - timedelta(days=days),
            actor="alice",
            actor_user_id=user.pk,
            action=act,
            target_type=TargetType.DIALOG,
            target_id=f"d{days}",
            details={"old": "a", "new": "标题"},
            ip="192.0.2.1",
        )
    every = audit_lines()
    assert [r["target"]["id"] for r in every] == ["d3", "d2", "d1"]
    assert every[0] == {
        "id": every[0]["id"],
        "at": (now - timedelta(days=3)).isoformat(),
        "actor": "alice",
        "actor_id": user.pk,
        "action": "dialog.delete",
        "target": {"type": "dialog", "id": "d3"},
        "details": {"old": "a", "new": "标题"},
        "ip": "192.0.2.1",
    }
    since = (now - timedelta(days=2, hours=1)).isoformat()
    assert [r["target"]["id"] for r in audit_lines("--since", since)] == ["d2", "d1"]
    renamed = audit_lines("--action", "dialog.rename")
    assert [r["target"]["id"] for r in renamed] == ["d2", "d1"]
    assert [
        r["target"]["id"] for r in audit_lines("--since", since, "--action", "dialog.delete")
    ] == []
    # A date alone, without an offset, is UTC.
    day = (now - timedelta(days=1)).date().isoformat()
    assert all(r["at"] >= day for r in audit_lines("--since", day))
    with pytest.raises(CommandError, match="ISO-8601"):
        audit_lines("--since", "yesterday")
    with pytest.raises(CommandError):
        audit_lines("--action", "dialog.nonsense")


# --- The client address -------------------------------------------------------------------


def test_client_address_honours_the_trusted_proxy_switch() -> None:
    # covers: H5
    meta = {"REMOTE_ADDR": "10.0.0.2", "HTTP_X_FORWARDED_FOR": "6.6.6.6, 203.0.113.5"}
    with override_settings(TRUST_X_FORWARDED_FOR=False):
        assert client_ip(meta) == "10.0.0.2"
    with override_settings(TRUST_X_FORWARDED_FOR=True):
        assert client_ip(meta) == "203.0.113.5"
        assert client_ip({**meta, "HTTP_X_FORWARDED_FOR": "not-an-ip"}) == "10.0.0.2"
    assert client_ip({}) is None
