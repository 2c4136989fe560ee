"""Operators link a chat-app account to a web user in the admin (E2, A1)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from sessions_app.chatapps import store
from sessions_app.models import ChannelAccount, Session

pytestmark = [pytest.mark.django_db]


def test_an_operator_links_an_account_and_its_dialogs_follow(make_user: Any) -> None:
    # covers: A1, E2
    operator = make_user("ops", staff=True)
    person = make_user("carol")
    ctx = store.chat_context(
        channel="telegram",
        chat_id="4242",
        is_group=False,
        chat_title="",
        sender_id="77",
        sender_name="Carol",
    )
    account = ChannelAccount.objects.get()
    assert ctx.current.owner_id == account.service_user_id
    client = Client()
    client.force_login(operator)
    listing = client.get("/admin/sessions_app/channelaccount/?q=Carol")
    assert listing.status_code == 200 and b"Carol" in listing.content
    assert client.get("/admin/sessions_app/channelaccount/add/").status_code == 403
    response = client.post(
        f"/admin/sessions_app/channelaccount/{account.pk}/change/",
        {"user": str(person.pk), "writable": "on"},
    )
    assert response.status_code == 302, response.content[:2000]
    account.refresh_from_db()
    assert account.user_id == person.pk and account.writable
    assert list(Session.objects.values_list("owner_id", flat=True)) == [person.pk]
    # Unlinking gives the dialogs back to the account's own identity.
    client.post(f"/admin/sessions_app/channelaccount/{account.pk}/change/", {"user": ""})
    assert list(Session.objects.values_list("owner_id", flat=True)) == [account.service_user_id]
    # The chat list is read-only for operators.
    chats = client.get("/admin/sessions_app/channelchat/")
    assert chats.status_code == 200 and b"4242" in chats.content


def test_a_platform_account_cannot_log_in(make_user: Any) -> None:
    # covers: F2 (service identities have no usable password)
    store.account_get_or_create(channel="feishu", external_id="ou_x", display_name="X")
    account = ChannelAccount.objects.select_related("service_user").get()
    assert not Client().login(username=account.service_user.username, password="")
    assert not account.service_user.has_usable_password()
