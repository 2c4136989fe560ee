"""Uploaded files in the admin (H3, E2): listed per user and per dialog with size and type,
read-only; a message's attachments on its dialog's page."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from sessions_app import files, services
from sessions_app.models import File, Session
from tests.file_helpers import png_bytes

pytestmark = [pytest.mark.django_db, pytest.mark.both_dbs]

FILES = reverse("admin:sessions_app_file_changelist")


@pytest.fixture(autouse=True)
def storage_dir(settings: Any, tmp_path: Path) -> Path:
    settings.STORAGES = {
        **settings.STORAGES,
        "default": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(tmp_path / "files")},
        },
    }
    return tmp_path / "files"


@pytest.fixture
def operator(client: Client, make_user: Callable[..., Any]) -> Any:
    staff = make_user("operator", staff=True)
    client.force_login(staff)
    return staff


def stored(owner: Any, name: str, data: bytes) -> File:
    kept = files.file_store_bytes(stream=io.BytesIO(data), name=name, size=len(data))
    return files.file_create(owner_id=owner.pk, stored=kept)


def attach(owner: Any, dialog_id: str, *attached: File) -> Session:
    session = services.session_create(
        owner=owner, channel="web", chat_id=f"u{owner.pk}", dialog_id=dialog_id
    )
    services.messages_append(
        session_pk=session.pk,
        messages=[
            services.NewMessage(
                role="user",
                content="see attached",
                kind="user_input",
                media_refs=[f.as_ref() for f in attached],
            )
        ],
    )
    return session


def test_files_per_user_and_per_dialog_with_size_and_type(
    client: Client, operator: Any, user: Any, other_user: Any
) -> None:
    # covers: H3, E2
    photo = stored(user, "photo.png", png_bytes((30, 30)))
    notes = stored(user, "notes.txt", b"x" * 2048)
    theirs = stored(other_user, "theirs.txt", b"hello")
    session = attach(user, "with-files", photo, notes)

    response = client.get(FILES, {"owner": user.pk})
    assert response.status_code == 200
    listed = {f.pk for f in response.context["cl"].result_list}
    assert listed == {photo.pk, notes.pk}
    body = response.content.decode()
    assert "image/png" in body and "2.0\xa0KB" in body

    response = client.get(FILES, {"session": session.pk})
    assert {f.pk for f in response.context["cl"].result_list} == {photo.pk, notes.pk}
    everyone = {f.pk for f in client.get(FILES).context["cl"].result_list}
    assert everyone == {photo.pk, notes.pk, theirs.pk}

    page = client.get(reverse("admin:sessions_app_session_change", args=[session.pk]))
    text = page.content.decode()
    assert "photo.png (image/png," in text and "notes.txt (text/plain, 2.0\xa0KB)" in text
    assert f"?session={session.pk}" in text

    detail = client.get(reverse("admin:sessions_app_file_change", args=[photo.pk]))
    assert detail.status_code == 200
    assert "with-files" in detail.content.decode()


def test_files_are_read_only_in_the_admin(client: Client, operator: Any, user: Any) -> None:
    # covers: H3, E2
    kept = stored(user, "a.txt", b"abc")
    change = reverse("admin:sessions_app_file_change", args=[kept.pk])
    response = client.post(change, {"name": "renamed.txt"})
    assert response.status_code == 403
    assert client.get(reverse("admin:sessions_app_file_add")).status_code == 403
    assert client.get(reverse("admin:sessions_app_file_delete", args=[kept.pk])).status_code == 403
    kept.refresh_from_db()
    assert kept.name == "a.txt"
