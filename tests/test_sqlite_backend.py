"""Embedded mode's SQLite backend (`chatcore/sqlite/base.py`): the process's write
transactions take turns on a lock of the process instead of in SQLite's sleeping busy
handler; read transactions never wait for a writer; a failed transaction leaves the lock free."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, connections, transaction

from sessions_app import selectors
from sessions_app.models import Session
from tests.storage_helpers import create

pytestmark = pytest.mark.django_db(transaction=True)


def _in_thread(fn: Any) -> threading.Thread:
    def run() -> None:
        try:
            fn()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_writers_take_turns_and_readers_never_wait(user: Any) -> None:
    # covers: G6, F7 (several database threads on one SQLite file)
    if connection.vendor != "sqlite":
        pytest.skip("embedded mode's SQLite backend")
    session = create(user, "turns")
    holding, release = threading.Event(), threading.Event()
    order: list[str] = []

    def first_writer() -> None:
        with transaction.atomic():
            Session.objects.filter(pk=session.pk).update(title="first")
            holding.set()
            release.wait(30)
            order.append("first commits")

    def second_writer() -> None:
        with transaction.atomic():
            Session.objects.filter(pk=session.pk).update(title="second")
            order.append("second writes")

    read: list[str] = []

    def reader() -> None:
        with selectors.read_transaction():
            read.append(Session.objects.get(pk=session.pk).title)

    a = _in_thread(first_writer)
    assert holding.wait(10)
    b = _in_thread(second_writer)
    c = _in_thread(reader)
    c.join(10)
    assert not c.is_alive() and read == ["Dialog turns"]  # the writer's change is not seen
    b.join(0.5)
    assert b.is_alive()  # waits for the first writer, without failing
    release.set()
    a.join(10)
    b.join(10)
    assert order == ["first commits", "second writes"]
    assert Session.objects.get(pk=session.pk).title == "second"


def test_a_failed_write_leaves_the_next_one_free(user: Any) -> None:
    # covers: A4 (a rolled-back transaction releases the lock)
    if connection.vendor != "sqlite":
        pytest.skip("embedded mode's SQLite backend")
    session = create(user, "fails")
    with pytest.raises(RuntimeError), transaction.atomic():
        Session.objects.filter(pk=session.pk).update(title="rolled back")
        raise RuntimeError("boom")

    def other_writer() -> None:
        with transaction.atomic():
            Session.objects.filter(pk=session.pk).update(title="written by another thread")

    writer = _in_thread(other_writer)
    writer.join(10)
    assert not writer.is_alive()
    assert Session.objects.get(pk=session.pk).title == "written by another thread"
