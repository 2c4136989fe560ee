"""Embedded mode's database: Django's SQLite backend, in WAL mode, each write transaction
begun IMMEDIATE, waiting in SQLite's busy handler up to the busy timeout (settings,
`OPTIONS["transaction_mode"]` and `OPTIONS["timeout"]`). A writer waits for the one before
it instead of failing at once, and fails "database is locked" only once the timeout has
passed; read transactions never wait for a writer; a failed transaction leaves the next
writer free; a writer that waits on something else inside its transaction holds up the
writers of its own database file only (SPEC G6, I3)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import load_backend

from sessions_app import selectors
from sessions_app.models import Session
from tests.storage_helpers import create

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _sqlite_only() -> None:
    if connection.vendor != "sqlite":
        pytest.skip("embedded mode's SQLite database")


def _in_thread(fn: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        try:
            fn()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@contextmanager
def _database(alias: str, **options: Any) -> Iterator[BaseDatabaseWrapper]:
    """Another connection of this thread (`transaction.atomic(using=alias)`), with the test
    database's settings and `options` (`NAME` another file, or `OPTIONS`)."""
    settings_dict = {**connection.settings_dict, **options}
    settings_dict["OPTIONS"] = {**connection.settings_dict["OPTIONS"], **options.get("OPTIONS", {})}
    wrapper = load_backend(settings_dict["ENGINE"]).DatabaseWrapper(settings_dict, alias)
    connections[alias] = wrapper
    try:
        yield wrapper
    finally:
        wrapper.close()
        del connections[alias]


@contextmanager
def _write_held(session: Session) -> Iterator[threading.Event]:
    """A write transaction on another thread, open (its write lock taken) until the event
    the block gets is set, or the block ends."""
    holding, release = threading.Event(), threading.Event()

    def writer() -> None:
        with transaction.atomic():
            Session.objects.filter(pk=session.pk).update(title="held")
            holding.set()
            release.wait(30)

    thread = _in_thread(writer)
    assert holding.wait(10)
    try:
        yield release
    finally:
        release.set()
        thread.join(10)


def test_djangos_backend_in_wal_mode_begins_writes_immediate_with_a_busy_timeout() -> None:
    # covers: G6, I1 (the library's documented options, nothing of our own)
    assert connection.settings_dict["ENGINE"] == "django.db.backends.sqlite3"
    options = connection.settings_dict["OPTIONS"]
    assert (options["transaction_mode"], options["timeout"]) == ("IMMEDIATE", 20)
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        assert cursor.fetchone()[0] == "wal"
        cursor.execute("PRAGMA busy_timeout")
        assert cursor.fetchone()[0] == 20_000


def test_writers_take_turns_and_readers_never_wait(user: Any) -> None:
    # covers: G6, F7 (several database threads on one SQLite file)
    session = create(user, "turns")
    order: list[str] = []
    read: list[str] = []

    def second_writer() -> None:
        with transaction.atomic():
            Session.objects.filter(pk=session.pk).update(title="second")
            order.append("second writes")

    def reader() -> None:
        with selectors.read_transaction():
            read.append(Session.objects.get(pk=session.pk).title)

    with _write_held(session) as release:
        b = _in_thread(second_writer)
        c = _in_thread(reader)
        c.join(10)
        assert not c.is_alive() and read == ["Dialog turns"]  # the writer's change is unseen
        b.join(0.5)
        assert b.is_alive()  # waits for the first writer, without failing
        order.append("first commits")
        release.set()
        b.join(10)
    assert order == ["first commits", "second writes"]
    assert Session.objects.get(pk=session.pk).title == "second"


def test_a_writer_fails_only_once_its_busy_timeout_has_passed(user: Any) -> None:
    # covers: A4, I3 (a locked database is waited for up to the timeout, then an error that
    # storage retries; never a failure at once)
    session = create(user, "patience")
    with (
        _database("impatient", OPTIONS={"timeout": 0.4}),
        _write_held(session),
    ):
        began = time.monotonic()
        with pytest.raises(OperationalError, match="database is locked"):
            with transaction.atomic(using="impatient"):
                pass
        waited = time.monotonic() - began
    assert 0.35 <= waited < 5
    with _database("impatient", OPTIONS={"timeout": 0.4}), transaction.atomic(using="impatient"):
        pass  # free again once the other writer committed


def test_a_failed_write_leaves_the_next_one_free(user: Any) -> None:
    # covers: A4 (a rolled-back transaction ends its write lock)
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


def test_a_writer_waiting_on_something_else_holds_up_only_its_own_database(
    user: Any, tmp_path: Path
) -> None:
    # covers: I3 (no process-wide write lock: a transaction that waits, say on Redis, keeps
    # the writers of its own file waiting, as SQLite must, and no one else)
    session = create(user, "elsewhere")
    with _database("other", NAME=str(tmp_path / "other.sqlite3")) as other:
        with other.cursor() as cursor:
            cursor.execute("CREATE TABLE notes (text TEXT)")
        with _write_held(session):
            began = time.monotonic()
            with transaction.atomic(using="other"), other.cursor() as cursor:
                cursor.execute("INSERT INTO notes VALUES ('written')")
            assert time.monotonic() - began < 1
        with other.cursor() as cursor:
            cursor.execute("SELECT text FROM notes")
            assert cursor.fetchall() == [("written",)]
