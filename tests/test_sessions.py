"""Which dialog an inbound message goes to (SPEC B1, B2) and who may see which dialog (F2)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from chatcore.common.errors import BadRequest, NotFound
from chatcore.engine.sessions import dialog_after_delete, resolve_dialog
from sessions_app import selectors, services
from sessions_app.models import Message, MessageKind, Session, Turn

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


def chat(user: Any) -> str:
    return f"u{user.pk}"


def create(user: Any, dialog_id: str | None = "default", **kw: Any) -> Session:
    return services.session_create(
        owner=user, channel="web", chat_id=chat(user), dialog_id=dialog_id, **kw
    )


def resolve(user: Any, dialog_id: str | None = None, **kw: Any) -> Session:
    return resolve_dialog(owner=user, channel="web", chat_id=chat(user), dialog_id=dialog_id, **kw)


def set_active(session: Session, ago: timedelta) -> None:
    Session.objects.filter(pk=session.pk).update(last_active_at=timezone.now() - ago)


def ttl() -> timedelta:
    return timedelta(seconds=django_settings.CHAT["SESSION_TTL_SECONDS"])


# --- B1: resolving --------------------------------------------------------------------------


def test_a_named_dialog_is_that_dialog(user: Any) -> None:
    # covers: B1
    work = create(user, "work")
    create(user, "play")  # more recent, but not asked for
    assert resolve(user, "work").pk == work.pk


def test_an_unknown_named_dialog_is_not_found_and_not_created(user: Any) -> None:
    # covers: B1
    create(user, "work")
    with pytest.raises(NotFound) as info:
        resolve(user, "nope")
    assert "nope" in info.value.message
    assert Session.objects.count() == 1


def test_an_unknown_named_dialog_is_created_on_request_with_its_welcome(user: Any) -> None:
    # covers: B1, B2
    session = resolve(user, "fresh", create=True)
    assert session.dialog_id == "fresh"
    welcome = Message.objects.get(session=session)
    # The web chat's welcome speaks of the web chat (issue 54), not of the id and commands.
    assert welcome.source["kind"] == MessageKind.WELCOME
    assert welcome.content.startswith("New dialog started.")
    # Asking again returns the same dialog rather than a second one.
    assert resolve(user, "fresh", create=True).pk == session.pk
    assert Session.objects.count() == 1


@pytest.mark.parametrize("dialog_id", ["", "a b", "a:b", "x" * 65])
def test_a_bad_dialog_id_is_refused_and_nothing_is_created(user: Any, dialog_id: str) -> None:
    # covers: A1, B1
    with pytest.raises(BadRequest):
        resolve(user, dialog_id, create=True)
    assert Session.objects.count() == 0


def test_without_an_id_the_most_recently_active_dialog_is_used(user: Any) -> None:
    # covers: B1
    older = create(user, "older")
    newer = create(user, "newer")
    set_active(older, timedelta(minutes=5))
    set_active(newer, timedelta(minutes=30))
    assert resolve(user).pk == older.pk
    # Activity moves the choice.
    services.messages_append(
        session_pk=newer.pk,
        messages=[services.NewMessage(role="user", content="hi", kind=MessageKind.USER_INPUT)],
    )
    assert resolve(user).pk == newer.pk
    assert Session.objects.count() == 2


def test_a_dialog_just_inside_the_ttl_is_still_used(user: Any) -> None:
    # covers: B1, A8
    session = create(user)
    set_active(session, ttl() - timedelta(minutes=5))
    assert resolve(user).pk == session.pk
    assert Session.objects.count() == 1


def test_when_the_most_recent_dialog_is_past_the_ttl_a_new_dialog_starts(user: Any) -> None:
    # covers: B1, B2
    old = create(user)
    set_active(old, ttl() + timedelta(minutes=5))
    new = resolve(user)
    assert new.pk != old.pk
    assert new.dialog_id != old.dialog_id
    assert new.deleted_at is None and new.owner_id == user.pk
    assert [m.source["kind"] for m in Message.objects.filter(session=new)] == ["welcome"]
    # The old dialog is untouched and still reachable by name.
    assert resolve(user, "default").pk == old.pk
    # The next message without an id goes to the new dialog, not a third one.
    assert resolve(user).pk == new.pk
    assert Session.objects.count() == 2


def test_an_empty_chat_gets_a_new_dialog(user: Any) -> None:
    # covers: B1, B2
    session = resolve(user)
    assert session.channel == "web" and session.chat_id == chat(user)
    assert Message.objects.filter(session=session).count() == 1
    assert resolve(user).pk == session.pk


def test_deleted_dialogs_are_never_picked(user: Any) -> None:
    # covers: B1, A7
    live = create(user, "live")
    gone = create(user, "gone")
    set_active(live, timedelta(minutes=10))
    services.session_soft_delete(session=gone)
    Session.objects.filter(pk=gone.pk).update(last_active_at=timezone.now())
    assert resolve(user).pk == live.pk
    with pytest.raises(NotFound):
        resolve(user, "gone")
    # With only deleted dialogs left, a new one starts.
    services.session_soft_delete(session=live)
    new = resolve(user)
    assert new.pk not in {live.pk, gone.pk}
    assert Session.objects.filter(deleted_at__isnull=True).count() == 1


def test_other_users_dialogs_are_never_picked(user: Any, other_user: Any) -> None:
    # covers: B1, F2
    mine = services.session_create(
        owner=user, channel="telegram", chat_id="group-7", dialog_id="mine"
    )
    # Another account's more recent dialog under the same external chat id (a row written
    # directly, so this test does not depend on who may create dialogs there).
    theirs = Session.objects.create(
        owner=other_user,
        channel="telegram",
        chat_id="group-7",
        dialog_id="theirs",
        title="Dialog theirs",
    )
    set_active(mine, timedelta(minutes=30))
    got = resolve_dialog(owner=user, channel="telegram", chat_id="group-7")
    assert got.pk == mine.pk
    with pytest.raises(NotFound):
        resolve_dialog(owner=user, channel="telegram", chat_id="group-7", dialog_id="theirs")
    # With nothing live of their own there, the user is never handed the other's dialog;
    # the chat is shared with another account, so nothing is created either.
    services.session_soft_delete(session=mine)
    with pytest.raises(NotFound):
        resolve_dialog(owner=user, channel="telegram", chat_id="group-7")
    assert Session.objects.filter(chat_id="group-7", deleted_at__isnull=True).get().pk == theirs.pk


def test_another_users_first_party_dialog_cannot_be_resolved_or_created(
    user: Any, other_user: Any
) -> None:
    # covers: A1, B1, F2
    theirs = create(other_user, "secret")
    for create_flag in (False, True):
        with pytest.raises(NotFound):
            resolve_dialog(
                owner=user,
                channel="web",
                chat_id=chat(other_user),
                dialog_id="secret",
                create=create_flag,
            )
        with pytest.raises(NotFound):
            resolve_dialog(
                owner=user,
                channel="web",
                chat_id=chat(other_user),
                dialog_id="x",
                create=create_flag,
            )
    with pytest.raises(NotFound):
        resolve_dialog(owner=user, channel="web", chat_id=chat(other_user))
    assert list(Session.objects.values_list("pk", flat=True)) == [theirs.pk]


def test_after_delete_the_most_recent_remaining_dialog_becomes_current(user: Any) -> None:
    # covers: B3, A7
    a = create(user, "a")
    b = create(user, "b")
    set_active(a, timedelta(minutes=1))
    set_active(b, timedelta(minutes=2))
    services.session_soft_delete(session=a)
    current = dialog_after_delete(owner=user, channel="web", chat_id=chat(user))
    assert current.pk == b.pk
    services.session_soft_delete(session=b)
    current = dialog_after_delete(owner=user, channel="web", chat_id=chat(user))
    assert current.pk not in {a.pk, b.pk}
    assert current.deleted_at is None
    assert Message.objects.filter(session=current, source__kind="welcome").count() == 1


def test_a_user_cannot_add_a_dialog_to_another_accounts_external_chat(
    user: Any, other_user: Any
) -> None:
    # covers: A1, F2
    services.session_create(
        owner=other_user, channel="telegram", chat_id="group-9", dialog_id="default"
    )
    with pytest.raises(NotFound):
        services.session_create(
            owner=user, channel="telegram", chat_id="group-9", dialog_id="intruder"
        )
    assert Session.objects.filter(chat_id="group-9").count() == 1


# --- F2: owner-scoped reads -----------------------------------------------------------------


def test_session_get_for_owner_only_finds_the_callers_dialogs(user: Any, other_user: Any) -> None:
    # covers: F2
    mine = create(user, "mine")
    theirs = create(other_user, "theirs")
    got = selectors.session_get_for_owner(owner_id=user.pk, session_id=mine.session_id)
    assert got.pk == mine.pk
    with pytest.raises(NotFound) as info:
        selectors.session_get_for_owner(owner_id=user.pk, session_id=theirs.session_id)
    assert info.value.http_status == 404
    # The same answer as for a dialog that does not exist: nothing leaks.
    with pytest.raises(NotFound) as missing:
        selectors.session_get_for_owner(owner_id=user.pk, session_id=f"web:{chat(other_user)}:nope")
    assert missing.value.message == info.value.message


@pytest.mark.parametrize(
    "session_id", ["", "nope", "web:u1", "web:u1:a:b", "web:u 1:d", "web:u1:d\u00e9", None, 5]
)
def test_session_get_for_owner_with_a_malformed_id_is_not_found(user: Any, session_id: Any) -> None:
    # covers: F2, A1
    with pytest.raises(NotFound):
        selectors.session_get_for_owner(owner_id=user.pk, session_id=session_id)


def test_session_list_for_owner_never_shows_other_users_dialogs(user: Any, other_user: Any) -> None:
    # covers: F2
    mine = [create(user, f"m{i}") for i in range(3)]
    create(other_user, "t0")
    create(other_user, "t1")
    items, total = selectors.session_list_for_owner(owner_id=user.pk)
    assert total == 3
    assert {s.pk for s in items} == {s.pk for s in mine}
    # Filters naming the other user's chat find nothing, rather than their dialogs.
    assert selectors.session_list_for_owner(
        owner_id=user.pk, channel="web", chat_id=chat(other_user)
    ) == ([], 0)
    assert selectors.session_list_for_owner(owner_id=user.pk, chat_id=chat(other_user)) == (
        [],
        0,
    )
    assert (
        selectors.dialog_list_for_chat(owner_id=user.pk, channel="web", chat_id=chat(other_user))
        == []
    )
    with pytest.raises(NotFound):
        selectors.dialog_get(
            owner_id=user.pk, channel="web", chat_id=chat(other_user), dialog_id="t0"
        )


def test_session_list_for_owner_pages_most_recent_first(user: Any) -> None:
    # covers: F2, B3
    sessions = [create(user, f"d{i}") for i in range(5)]
    for i, s in enumerate(sessions):
        set_active(s, timedelta(minutes=i))
    page, total = selectors.session_list_for_owner(owner_id=user.pk, limit=2)
    assert total == 5
    assert [s.dialog_id for s in page] == ["d0", "d1"]
    page, _ = selectors.session_list_for_owner(owner_id=user.pk, limit=2, offset=4)
    assert [s.dialog_id for s in page] == ["d4"]


def test_turn_get_for_owner_only_finds_the_callers_turns(user: Any, other_user: Any) -> None:
    # covers: F2
    mine = create(user)
    theirs = create(other_user)
    my_turn = Turn.objects.create(session=mine, owner=user, number=1, content="x")
    their_turn = Turn.objects.create(session=theirs, owner=other_user, number=1, content="x")
    got = selectors.turn_get_for_owner(owner_id=user.pk, turn_id=str(my_turn.pk))
    assert got.pk == my_turn.pk and got.session.pk == mine.pk
    with pytest.raises(NotFound):
        selectors.turn_get_for_owner(owner_id=user.pk, turn_id=str(their_turn.pk))
    with pytest.raises(NotFound):
        selectors.turn_get_for_owner(owner_id=user.pk, turn_id=str(uuid.uuid4()))


@pytest.mark.parametrize("turn_id", ["", "not-a-uuid", "1234", "' OR 1=1 --", "x" * 300])
def test_turn_get_for_owner_with_a_malformed_id_is_not_found(user: Any, turn_id: str) -> None:
    # covers: F2
    create(user)
    with pytest.raises(NotFound):
        selectors.turn_get_for_owner(owner_id=user.pk, turn_id=turn_id)
    # The database connection is still usable afterwards (no broken transaction).
    assert Session.objects.filter(owner=user).count() == 1
