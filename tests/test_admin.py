"""The operators' admin (E2): dialogs, messages, turns, tokens; writes go through services."""

from __future__ import annotations

from collections.abc import Callable
from html.parser import HTMLParser
from typing import Any

import pytest
from django.contrib import messages as django_messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from sessions_app import services
from sessions_app.auth import hash_token
from sessions_app.models import ApiToken, Message, Session, TitleSource

pytestmark = pytest.mark.django_db

CHANGELIST = reverse("admin:sessions_app_session_changelist")
# The change form posts the read-only message inline's management form back unchanged.
NO_INLINE_FORMS = {
    "messages-TOTAL_FORMS": "0",
    "messages-INITIAL_FORMS": "0",
    "messages-MIN_NUM_FORMS": "0",
    "messages-MAX_NUM_FORMS": "0",
}


class _FormInputs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "input" and found.get("name") and found.get("type") not in {"submit", "checkbox"}:
            self.data[str(found["name"])] = found.get("value") or ""


def form_inputs(response: Any) -> dict[str, str]:
    """What a browser would post back from a rendered change form."""
    parser = _FormInputs()
    parser.feed(response.content.decode())
    return parser.data


def change_url(session: Session) -> str:
    return reverse("admin:sessions_app_session_change", args=[session.pk])


def dialog(owner: Any, dialog_id: str, title: str | None = None) -> Session:
    return services.session_create(
        owner=owner, channel="web", chat_id=f"u{owner.pk}", dialog_id=dialog_id, title=title
    )


def say(session: Session, content: str, role: str = "user", kind: str = "user_input") -> None:
    services.messages_append(
        session_pk=session.pk,
        messages=[services.NewMessage(role=role, content=content, kind=kind)],
    )


def run_action(client: Client, action: str, *sessions: Session, **extra: str) -> Any:
    data = {"action": action, ACTION_CHECKBOX_NAME: [s.pk for s in sessions], **extra}
    return client.post(CHANGELIST, data, follow=True)


def listed(response: Any) -> set[str]:
    return {s.pk for s in response.context["cl"].result_list}


def flashed(response: Any) -> list[tuple[int, str]]:
    return [(m.level, str(m)) for m in response.context["messages"]]


@pytest.fixture
def operator(client: Client, make_user: Callable[..., Any]) -> Any:
    staff = make_user("operator", staff=True)
    client.force_login(staff)
    return staff


# --- Dialog list, search, filters ---------------------------------------------------------


# covers: E2
def test_changelist_lists_dialogs_with_their_columns(
    client: Client, operator: Any, user: Any
) -> None:
    s = dialog(user, "work", title="Trip planning")
    response = client.get(CHANGELIST)
    assert response.status_code == 200
    body = response.content.decode()
    assert s.session_id in body
    assert "Trip planning" in body
    assert user.username in body
    assert listed(response) == {s.pk}


# covers: E2
def test_search_by_message_text_finds_the_dialog_once(
    client: Client, operator: Any, user: Any
) -> None:
    hit = dialog(user, "zoo")
    miss = dialog(user, "office")
    # Two matching messages must still list the dialog once.
    say(hit, "find the zebra")
    say(hit, "another zebra")
    say(miss, "nothing to see")
    response = client.get(CHANGELIST, {"q": "zebra"})
    assert response.status_code == 200
    assert [s.pk for s in response.context["cl"].result_list] == [hit.pk]


# covers: E2
@pytest.mark.parametrize(
    ("term", "expected"),
    [("Trip", {"a"}), ("u{pk}", {"a", "b"}), ("alice", {"a", "b"}), ("web", {"a", "b"})],
)
def test_search_by_title_chat_owner_and_channel(
    client: Client, operator: Any, user: Any, other_user: Any, term: str, expected: set[str]
) -> None:
    ids = {"a": dialog(user, "a", title="Trip").pk, "b": dialog(user, "b", title="Work").pk}
    dialog(other_user, "c", title="Other")
    response = client.get(CHANGELIST, {"q": term.format(pk=user.pk)})
    found = listed(response)
    assert {k for k, pk in ids.items() if pk in found} == expected
    if term != "web":
        assert len(found) == len(expected)


# covers: E2, A7
def test_filters_by_channel_and_deleted_state(client: Client, operator: Any, user: Any) -> None:
    live = dialog(user, "live")
    gone = dialog(user, "gone")
    services.session_soft_delete(session=gone)
    cli = services.session_create(owner=user, channel="cli", chat_id=f"u{user.pk}")

    assert listed(client.get(CHANGELIST)) == {live.pk, gone.pk, cli.pk}
    assert listed(client.get(CHANGELIST, {"deleted": "live"})) == {live.pk, cli.pk}
    assert listed(client.get(CHANGELIST, {"deleted": "deleted"})) == {gone.pk}
    assert listed(client.get(CHANGELIST, {"channel": "cli"})) == {cli.pk}
    assert listed(client.get(CHANGELIST, {"channel": "web", "deleted": "live"})) == {live.pk}


# covers: E2
def test_filter_by_activity_date(client: Client, operator: Any, user: Any) -> None:
    recent = dialog(user, "recent")
    old = dialog(user, "old")
    Session.objects.filter(pk=old.pk).update(last_active_at=old.last_active_at.replace(year=2020))
    # Follow the filter's own "Today" link, as an operator would.
    cl = client.get(CHANGELIST).context["cl"]
    spec = next(f for f in cl.filter_specs if getattr(f, "field_path", "") == "last_active_at")
    today = next(c for c in spec.choices(cl) if str(c["display"]) == "Today")
    assert listed(client.get(CHANGELIST + today["query_string"])) == {recent.pk}
    response = client.get(CHANGELIST, {"last_active_at__year": "2020"})
    assert listed(response) == {old.pk}


# --- The change page ----------------------------------------------------------------------


# covers: E2
def test_change_page_shows_messages_in_seq_order(client: Client, operator: Any, user: Any) -> None:
    s = dialog(user, "ordered")
    say(s, "first question")
    say(s, "the answer", role="assistant", kind="assistant")
    say(s, "second question")
    response = client.get(change_url(s))
    assert response.status_code == 200
    body = response.content.decode()
    positions = [
        body.index(text)
        for text in ("New dialog started", "first question", "the answer", "second question")
    ]
    assert positions == sorted(positions)
    formset = response.context["inline_admin_formsets"][0].formset
    assert [m.seq for m in formset.queryset] == [1, 2, 3, 4]
    # Read-only but for the title and the dialog's settings (H4).
    assert list(response.context["adminform"].form.fields) == ["title", "model", "system_prompt"]


# covers: E2
def test_change_page_pages_through_long_histories(
    client: Client, operator: Any, user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sessions_app.admin import dialogs as session_admin

    monkeypatch.setattr(session_admin, "MESSAGE_PAGE_SIZE", 2)
    s = dialog(user, "long")
    for n in range(4):
        say(s, f"message {n}")

    def seqs(response: Any) -> list[int]:
        return [m.seq for m in response.context["inline_admin_formsets"][0].formset.queryset]

    first = client.get(change_url(s))
    assert seqs(first) == [1, 2]
    assert "messages_page=3" in first.content.decode()
    assert seqs(client.get(change_url(s), {"messages_page": "3"})) == [5]
    # Out-of-range pages land on the last page instead of failing.
    assert seqs(client.get(change_url(s), {"messages_page": "99"})) == [5]


# covers: E2
def test_rename_through_the_change_page_uses_the_operator_source(
    client: Client, operator: Any, user: Any
) -> None:
    s = dialog(user, "rename")
    say(s, "hello")
    before = Session.objects.get(pk=s.pk)
    data = form_inputs(client.get(change_url(s)))
    # The read-only message inline is posted back as rendered.
    assert data["messages-INITIAL_FORMS"] == "2"
    data["title"] = "  Renamed   by ops "
    response = client.post(change_url(s), data)
    assert response.status_code == 302
    after = Session.objects.get(pk=s.pk)
    assert after.title == "Renamed by ops"
    assert after.title_source == TitleSource.OPERATOR
    assert after.state_version == before.state_version + 1
    # Nothing else of the dialog was written back.
    assert after.message_count == before.message_count
    assert after.last_active_at == before.last_active_at
    assert Message.objects.filter(session=s).count() == 2


# covers: E2
def test_rename_rejects_a_blank_title(client: Client, operator: Any, user: Any) -> None:
    s = dialog(user, "blank", title="Keep me")
    response = client.post(change_url(s), {"title": "   ", **NO_INLINE_FORMS})
    assert response.status_code == 200
    assert response.context["adminform"].form.errors
    assert Session.objects.get(pk=s.pk).title == "Keep me"


# covers: E2
def test_saving_without_a_title_change_writes_nothing(
    client: Client, operator: Any, user: Any
) -> None:
    s = dialog(user, "same", title="Same")
    before = Session.objects.get(pk=s.pk)
    response = client.post(change_url(s), {"title": "Same", **NO_INLINE_FORMS})
    assert response.status_code == 302
    after = Session.objects.get(pk=s.pk)
    assert (after.title_source, after.state_version) == (TitleSource.USER, before.state_version)


# --- Actions ------------------------------------------------------------------------------


# covers: E2, A7
def test_soft_delete_then_restore(client: Client, operator: Any, user: Any) -> None:
    s = dialog(user, "cycle")
    response = run_action(client, "soft_delete_selected", s)
    assert response.status_code == 200
    assert Session.objects.get(pk=s.pk).deleted_at is not None
    assert (django_messages.SUCCESS, "Soft-deleted 1 dialog.") in flashed(response)
    assert listed(client.get(CHANGELIST, {"deleted": "live"})) == set()

    response = run_action(client, "restore_selected", s)
    assert Session.objects.get(pk=s.pk).deleted_at is None
    assert (django_messages.SUCCESS, "Restored 1 dialog.") in flashed(response)
    assert listed(client.get(CHANGELIST, {"deleted": "live"})) == {s.pk}


# covers: E2, A7
def test_restore_conflict_is_reported_and_changes_nothing(
    client: Client, operator: Any, user: Any
) -> None:
    old = dialog(user, "same-id")
    services.session_soft_delete(session=old)
    live = dialog(user, "same-id")
    deleted_at = Session.objects.get(pk=old.pk).deleted_at

    response = run_action(client, "restore_selected", old)
    assert response.status_code == 200
    errors = [text for level, text in flashed(response) if level == django_messages.ERROR]
    assert len(errors) == 1
    assert old.session_id in errors[0]
    assert Session.objects.get(pk=old.pk).deleted_at == deleted_at
    assert Session.objects.get(pk=live.pk).deleted_at is None


# covers: E2, A7
def test_purge_asks_first_then_removes_the_dialog_and_its_messages(
    client: Client, operator: Any, user: Any
) -> None:
    s = dialog(user, "purge")
    say(s, "soon gone")
    keep = dialog(user, "keep")

    confirm = run_action(client, "purge_selected", s)
    assert confirm.status_code == 200
    assert s.session_id in confirm.content.decode()
    assert confirm.context["summary"]["messages"] == 2
    assert Session.objects.filter(pk=s.pk).exists()

    response = run_action(client, "purge_selected", s, post="yes")
    assert response.status_code == 200
    assert (django_messages.SUCCESS, "Purged 1 dialog.") in flashed(response)
    assert not Session.objects.filter(pk=s.pk).exists()
    assert not Message.objects.filter(session_id=s.pk).exists()
    assert Session.objects.filter(pk=keep.pk).exists()


# covers: E2, A7
def test_delete_button_on_the_change_page_purges_through_services(
    client: Client, operator: Any, user: Any
) -> None:
    s = dialog(user, "single")
    say(s, "bye")
    url = reverse("admin:sessions_app_session_delete", args=[s.pk])
    page = client.get(url)
    assert page.status_code == 200
    assert not page.context["perms_lacking"]
    response = client.post(url, {"post": "yes"})
    assert response.status_code == 302
    assert not Session.objects.filter(pk=s.pk).exists()
    assert not Message.objects.filter(session_id=s.pk).exists()


# covers: E2
def test_default_bulk_delete_is_not_offered(client: Client, operator: Any, user: Any) -> None:
    dialog(user, "any")
    response = client.get(CHANGELIST)
    choices = [name for name, _label in response.context["action_form"].fields["action"].choices]
    assert "delete_selected" not in choices
    assert {"soft_delete_selected", "restore_selected", "purge_selected"} <= set(choices)


# --- Permissions --------------------------------------------------------------------------


# covers: E2, F2
def test_non_staff_is_sent_to_the_admin_login(client: Client, user: Any) -> None:
    client.force_login(user)
    response = client.get(CHANGELIST)
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("admin:login"))


# covers: E2, F2
def test_staff_without_permissions_gets_403(client: Client) -> None:
    staff = get_user_model().objects.create_user("clerk", "clerk@example.com", "pw-12345!")
    staff.is_staff = True
    staff.save()
    client.force_login(staff)
    assert client.get(CHANGELIST).status_code == 403


# covers: E2, F2
def test_actions_follow_the_operators_permissions(
    client: Client, user: Any, make_user: Callable[..., Any]
) -> None:
    staff = get_user_model().objects.create_user("viewer", "viewer@example.com", "pw-12345!")
    staff.is_staff = True
    staff.save()
    staff.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="sessions_app",
            codename__in=["view_session", "change_session"],
        )
    )
    client.force_login(staff)
    s = dialog(user, "perm")
    response = client.get(CHANGELIST)
    assert response.status_code == 200
    choices = {name for name, _label in response.context["action_form"].fields["action"].choices}
    assert {"soft_delete_selected", "restore_selected"} <= choices
    assert "purge_selected" not in choices
    run_action(client, "purge_selected", s, post="yes")
    assert Session.objects.filter(pk=s.pk).exists()


# --- Messages, turns, tokens --------------------------------------------------------------


# covers: E2
def test_message_admin_is_read_only(client: Client, operator: Any, user: Any) -> None:
    s = dialog(user, "msgs")
    say(s, "find the zebra")
    changelist = reverse("admin:sessions_app_message_changelist")
    response = client.get(changelist, {"q": "zebra"})
    assert response.status_code == 200
    assert [m.content for m in response.context["cl"].result_list] == ["find the zebra"]
    assert client.get(changelist, {"role": "system"}).context["cl"].result_count == 1
    assert client.get(changelist, {"session": s.pk}).context["cl"].result_count == 2
    assert client.get(reverse("admin:sessions_app_message_add")).status_code == 403
    message = Message.objects.get(session=s, seq=2)
    change = reverse("admin:sessions_app_message_change", args=[message.pk])
    assert client.get(change).status_code == 200
    client.post(change, {"content": "tampered"})
    assert Message.objects.get(pk=message.pk).content == "find the zebra"
    delete = reverse("admin:sessions_app_message_delete", args=[message.pk])
    assert client.post(delete, {"post": "yes"}).status_code == 403


# covers: E2
def test_turn_admin_lists_and_is_read_only(client: Client, operator: Any) -> None:
    response = client.get(reverse("admin:sessions_app_turn_changelist"), {"status": "failed"})
    assert response.status_code == 200
    assert client.get(reverse("admin:sessions_app_turn_add")).status_code == 403


# covers: E2
def test_memory_note_admin_searches(client: Client, operator: Any, user: Any) -> None:
    user.memory_notes.create(content="likes green tea")
    response = client.get(reverse("admin:sessions_app_memorynote_changelist"), {"q": "tea"})
    assert response.status_code == 200
    assert response.context["cl"].result_count == 1


# covers: E2, F2
def test_issuing_a_token_shows_the_key_once_and_stores_only_its_hash(
    client: Client, operator: Any, user: Any
) -> None:
    add = reverse("admin:sessions_app_apitoken_add")
    form = client.get(add)
    assert form.status_code == 200
    assert list(form.context["adminform"].form.fields) == ["user", "name"]

    response = client.post(add, {"user": user.pk, "name": "laptop"}, follow=True)
    assert response.status_code == 200
    token = ApiToken.objects.get()
    assert (token.user, token.name) == (user, "laptop")
    shown = [text for _level, text in flashed(response) if "copy it now" in text]
    assert len(shown) == 1
    raw = shown[0].split(": ", 1)[1].split(" ")[0]
    assert raw.startswith(token.prefix)
    assert token.key_hash == hash_token(raw)
    assert raw not in {token.key_hash, token.prefix, token.name}

    # The key is not shown again, and its hash never is.
    page = client.get(reverse("admin:sessions_app_apitoken_change", args=[token.pk]))
    body = page.content.decode()
    assert raw not in body
    assert token.key_hash not in body
    listing = client.get(reverse("admin:sessions_app_apitoken_changelist")).content.decode()
    assert raw not in listing
    assert token.key_hash not in listing


# covers: E2, F2
def test_revoke_action(client: Client, operator: Any, user: Any) -> None:
    token, _raw = services.api_token_issue(user=user, name="old")
    response = client.post(
        reverse("admin:sessions_app_apitoken_changelist"),
        {"action": "revoke_selected", ACTION_CHECKBOX_NAME: [token.pk]},
        follow=True,
    )
    assert (django_messages.SUCCESS, "Revoked 1 token.") in flashed(response)
    token.refresh_from_db()
    assert token.revoked_at is not None
