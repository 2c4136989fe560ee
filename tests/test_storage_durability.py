"""Stored history, continued (A4-A8): retried writes, the per-process history cache, eviction
and the delete/restore/purge lifecycle.

Database failures are real: `connection.execute_wrapper` makes chosen statements raise
`OperationalError` before they reach the database, so the retry and fallback paths run the
same code a flaky disk or a lost PostgreSQL connection would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings as django_settings
from django.db import DatabaseError, connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from chatcore.common import publish
from chatcore.common.errors import BadRequest, NotFound, StorageError
from chatcore.engine.sessions import SessionStates
from sessions_app import selectors, services
from sessions_app.models import Message, Role, Session, Turn
from tests.storage_helpers import (
    MESSAGE_TABLE,
    FailStatements,
    assistant_msg,
    create,
    fresh,
    stored_seqs,
    user_msg,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


# --- A4: retried writes ---------------------------------------------------------------------


def test_retry_defaults_are_100_200_300_ms() -> None:
    # covers: A4, A8
    assert list(django_settings.CHAT["STORAGE_RETRY_DELAYS_MS"]) == [100, 200, 300]


def test_an_append_that_fails_twice_succeeds_on_the_third_attempt(
    user: Any, sleeps: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    # covers: A4
    session = create(user)
    caplog.set_level(logging.WARNING, logger="sessions_app.storage")
    fail = FailStatements(MESSAGE_TABLE, "INSERT", failures=2)
    with connection.execute_wrapper(fail):
        appended = services.messages_append(session_pk=session.pk, messages=[user_msg("kept")])
    assert fail.attempts == 3
    assert sleeps == [0.001, 0.002]
    assert [m.seq for m in appended.messages] == [2]
    rows = list(Message.objects.filter(session=session).order_by("seq"))
    assert [(m.seq, m.content) for m in rows] == [(1, rows[0].content), (2, "kept")]
    assert fresh(session).last_seq == 2
    retries = [r for r in caplog.records if r.name == "sessions_app.storage"]
    assert [r.levelno for r in retries] == [logging.WARNING, logging.WARNING]


def test_an_append_that_fails_on_the_last_attempt_only_still_succeeds(
    user: Any, sleeps: list[float]
) -> None:
    # covers: A4 (4 attempts in all: the 4th is a real chance)
    session = create(user)
    fail = FailStatements(MESSAGE_TABLE, "INSERT", failures=3)
    with connection.execute_wrapper(fail):
        services.messages_append(session_pk=session.pk, messages=[user_msg("late")])
    assert fail.attempts == 4
    assert sleeps == [0.001, 0.002, 0.003]
    assert stored_seqs(session) == [1, 2]


def test_an_append_that_keeps_failing_raises_stores_nothing_and_logs(
    user: Any, sleeps: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    # covers: A4, C10
    session = create(user)
    before = fresh(session)
    caplog.set_level(logging.WARNING, logger="sessions_app.storage")
    fail = FailStatements(MESSAGE_TABLE, "INSERT", failures=100)
    with connection.execute_wrapper(fail), pytest.raises(StorageError) as info:
        services.messages_append(session_pk=session.pk, messages=[user_msg("lost")])
    assert fail.attempts == 4
    assert sleeps == [0.001, 0.002, 0.003]
    # C10: the user-facing error is safe; the raw database error only goes to the log.
    assert info.value.code == "storage_error"
    assert "injected" not in info.value.message and "/secret" not in info.value.message
    after = fresh(session)
    assert stored_seqs(session) == [1]
    assert (after.last_seq, after.total_message_count, after.message_count) == (1, 1, 0)
    assert after.state_version == before.state_version
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "messages_append" in errors[0].getMessage()
    assert getattr(errors[0], "session_id", None) == session.session_id


async def test_a_failed_append_notifies_the_chat_and_leaves_memory_untouched(
    user: Any, sleeps: list[float], recorder: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # covers: A4, D2, C10
    session = await sync_to_async(create)(user)
    states = SessionStates()
    before = await sync_to_async(states.history)(session)
    assert [m.seq for m in before] == [1]
    rec = await recorder(publish.chat_group(session.channel, session.chat_id))
    caplog.set_level(logging.WARNING, logger="sessions_app.storage")

    def failing_append() -> int:
        fail = FailStatements(MESSAGE_TABLE, "INSERT", failures=100)
        with connection.execute_wrapper(fail), pytest.raises(StorageError):
            services.messages_append(session_pk=session.pk, messages=[user_msg("lost")])
        return fail.attempts

    assert await sync_to_async(failing_append)() == 4
    frame = await rec.next(timeout=5)
    assert frame["type"] == "system_notification"
    assert frame["level"] == "error"
    assert frame["session_id"] == session.session_id
    assert frame["content"] and "injected" not in frame["content"]
    # The notification is not history: no delta follows, nothing is stored.
    with pytest.raises(asyncio.TimeoutError):
        await rec.next(timeout=0.3)
    assert await sync_to_async(stored_seqs)(session) == [1]
    assert any(r.levelno == logging.ERROR for r in caplog.records)

    # Memory still holds exactly the pre-failure history and needs no reload for it.
    reloaded = await sync_to_async(fresh)(session)

    def cached() -> tuple[list[Message], int]:
        with CaptureQueriesContext(connection) as queries:
            rows = states.history(reloaded)
        return rows, len(queries)

    rows, queries = await sync_to_async(cached)()
    assert [(m.pk, m.seq) for m in rows] == [(m.pk, m.seq) for m in before]
    assert queries == 0


def test_a_failed_session_create_stores_nothing(user: Any, sleeps: list[float]) -> None:
    # covers: A4, B2 (the dialog and its welcome are written together or not at all)
    fail = FailStatements(MESSAGE_TABLE, "INSERT", failures=100)
    with connection.execute_wrapper(fail), pytest.raises(StorageError):
        create(user, "doomed")
    assert fail.attempts == 4
    assert Session.objects.count() == 0
    assert Message.objects.count() == 0
    # Once the database is back the same dialog can be created.
    assert stored_seqs(create(user, "doomed")) == [1]


def test_a_failed_read_falls_back_to_the_in_memory_history(user: Any) -> None:
    # covers: A4, A5
    session = create(user)
    services.messages_append(session_pk=session.pk, messages=[user_msg("one")])
    states = SessionStates()
    cached = states.history(fresh(session))
    assert [m.seq for m in cached] == [1, 2]
    # Another writer moves the dialog on; this process has not seen it yet.
    services.messages_append(session_pk=session.pk, messages=[assistant_msg("two")])
    newer = fresh(session)
    assert newer.last_seq == 3
    fail = FailStatements(MESSAGE_TABLE, "SELECT", failures=100)
    with connection.execute_wrapper(fail):
        got = states.history(newer)
    assert fail.attempts >= 1
    assert [(m.pk, m.seq) for m in got] == [(m.pk, m.seq) for m in cached]
    # When reads work again, the missing message is picked up.
    assert [m.seq for m in states.history(newer)] == [1, 2, 3]


def test_a_failed_read_without_in_memory_state_raises(user: Any) -> None:
    # covers: A4, A5
    session = create(user)
    states = SessionStates()
    fail = FailStatements(MESSAGE_TABLE, "SELECT", failures=100)
    with connection.execute_wrapper(fail), pytest.raises(DatabaseError):
        states.history(fresh(session))
    assert session.pk not in states
    assert [m.seq for m in states.history(fresh(session))] == [1]


# --- A5: the history cache ------------------------------------------------------------------


def test_a_fresh_process_loads_the_full_history_from_the_database(user: Any) -> None:
    # covers: A5
    session = create(user)
    services.messages_append(session_pk=session.pk, messages=[user_msg("q1"), assistant_msg("a1")])
    services.messages_append(session_pk=session.pk, messages=[user_msg("q2")])
    states = SessionStates()  # as after a restart
    rows = states.history(fresh(session))
    assert [(m.seq, m.role) for m in rows] == [
        (1, Role.SYSTEM),
        (2, Role.USER),
        (3, Role.ASSISTANT),
        (4, Role.USER),
    ]
    assert [m.content for m in rows[1:]] == ["q1", "a1", "q2"]


def test_history_loads_only_what_is_new(user: Any) -> None:
    # covers: A5, A6 (query counts pinned: STYLE 12)
    session = create(user)
    states = SessionStates()
    loaded = fresh(session)
    with CaptureQueriesContext(connection) as first:
        assert [m.seq for m in states.history(loaded)] == [1]
    assert len(first) == 1
    unchanged = fresh(session)
    with CaptureQueriesContext(connection) as second:
        assert [m.seq for m in states.history(unchanged)] == [1]
    assert len(second) == 0
    services.messages_append(session_pk=session.pk, messages=[user_msg("a"), user_msg("b")])
    moved = fresh(session)
    executed: list[tuple[str, Any]] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        executed.append((sql, params))
        return execute(sql, params, many, context)

    # The statement and its parameters (on PostgreSQL the value is bound on the server, so
    # the statement's text alone does not show it).
    with connection.execute_wrapper(record):
        rows = states.history(moved)
    assert [m.seq for m in rows] == [1, 2, 3]
    assert len(executed) == 1
    sql, params = executed[0]
    assert MESSAGE_TABLE in sql and '"seq" > %s' in sql
    assert list(params) == [session.pk, 1]
    with CaptureQueriesContext(connection) as fourth:
        assert [m.seq for m in states.history(moved)] == [1, 2, 3]
    assert len(fourth) == 0


def test_memory_follows_successful_appends_without_rereading(user: Any) -> None:
    # covers: A4, A5
    session = create(user)
    states = SessionStates()
    states.history(fresh(session))
    appended = services.messages_append(session_pk=session.pk, messages=[user_msg("hi")])
    states.apply_appended(appended)
    reloaded = fresh(session)
    with CaptureQueriesContext(connection) as queries:
        rows = states.history(reloaded)
    assert len(queries) == 0
    assert [(m.seq, m.content) for m in rows][1:] == [(2, "hi")]


def test_an_append_already_read_after_its_commit_keeps_the_history_held(user: Any) -> None:
    # covers: A5, G6 (a send's input is built from the moment its admission commits, and that
    # build may read the new message before the admission records it: the record then
    # changes nothing, and the dialog's history stays held for its next turns)
    session = create(user)
    states = SessionStates()
    states.history(fresh(session))
    appended = services.messages_append(session_pk=session.pk, messages=[user_msg("hi")])
    assert [m.seq for m in states.history(fresh(session))] == [1, 2]  # read after the commit
    states.apply_appended(appended)  # recorded after that read: nothing new
    answered = services.messages_append(session_pk=session.pk, messages=[assistant_msg("yes")])
    states.apply_appended(answered)
    reloaded = fresh(session)
    with CaptureQueriesContext(connection) as queries:
        rows = states.history(reloaded)
    assert len(queries) == 0
    assert [(m.seq, m.content) for m in rows][1:] == [(2, "hi"), (3, "yes")]


def test_history_after_clearing_holds_only_the_new_messages(user: Any) -> None:
    # covers: A3, A5
    session = create(user)
    services.messages_append(session_pk=session.pk, messages=[user_msg("old")])
    states = SessionStates()
    assert len(states.history(fresh(session))) == 2
    services.messages_clear(session=session)
    services.messages_append(session_pk=session.pk, messages=[user_msg("new")])
    rows = states.history(fresh(session))
    assert [(m.seq, m.content) for m in rows] == [(3, "new")]


def test_an_append_committed_while_a_build_reads_the_history_is_not_read_again(
    user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: A5, G6 (a send's input is read beside its admission; the admission's commit
    # can land before that read is stored, and the next turn must not read it again)
    session = create(user)
    services.messages_append(session_pk=session.pk, messages=[user_msg("first")])
    before = fresh(session)
    states = SessionStates()
    real_read = selectors.messages_for_context
    committed: list[services.Appended] = []

    def read_while_another_commits(**kwargs: Any) -> list[Message]:
        rows = real_read(**kwargs)
        appended = services.messages_append(session_pk=session.pk, messages=[user_msg("second")])
        states.apply_appended(appended)  # as the admission does once committed
        committed.append(appended)
        return rows

    monkeypatch.setattr(selectors, "messages_for_context", read_while_another_commits)
    built = states.history_through(before, after_seq=0, through_seq=before.last_seq)
    monkeypatch.setattr(selectors, "messages_for_context", real_read)
    assert [m.content for m in built][-1:] == ["first"]
    assert committed
    after = fresh(session)
    with CaptureQueriesContext(connection) as queries:
        rows = states.history(after)
    assert len(queries) == 0
    assert [m.content for m in rows][-2:] == ["first", "second"]


def test_a_read_that_misses_another_process_write_reads_from_there(
    user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # covers: A5 (an append that does not follow on from the read: read from there, no gap)
    session = create(user)
    before = fresh(session)
    states = SessionStates()
    real_read = selectors.messages_for_context

    def read_while_two_commit(**kwargs: Any) -> list[Message]:
        rows = real_read(**kwargs)
        services.messages_append(session_pk=session.pk, messages=[user_msg("elsewhere")])
        states.apply_appended(
            services.messages_append(session_pk=session.pk, messages=[user_msg("here")])
        )
        return rows

    monkeypatch.setattr(selectors, "messages_for_context", read_while_two_commit)
    states.history_through(before, after_seq=0, through_seq=before.last_seq)
    monkeypatch.setattr(selectors, "messages_for_context", real_read)
    reads: list[int] = []

    def spied(**kwargs: Any) -> list[Message]:
        reads.append(kwargs["after_seq"])
        return real_read(**kwargs)

    monkeypatch.setattr(selectors, "messages_for_context", spied)
    rows = states.history(fresh(session))
    assert reads == [before.last_seq]  # from the last message it read on, not from the start
    assert [m.content for m in rows][-2:] == ["elsewhere", "here"]


def test_a_message_committed_during_a_first_read_is_not_held_twice(user: Any) -> None:
    # covers: A5 (a read from a session row older than the table: the state holds what the
    # row's revision says, and the next read brings the rest once)
    session = create(user)
    stale = fresh(session)  # read before the append, e.g. by a concurrent builder
    services.messages_append(session_pk=session.pk, messages=[user_msg("hi")])
    states = SessionStates()
    assert [m.seq for m in states.history(stale)] == [1]
    rows = states.history(fresh(session))
    assert [m.seq for m in rows] == [1, 2]


def test_a_stale_session_row_never_duplicates_cached_messages(user: Any) -> None:
    # covers: A5, A3
    session = create(user)
    states = SessionStates()
    states.history(fresh(session))
    stale = fresh(session)  # read before the append, e.g. by a concurrent builder
    appended = services.messages_append(session_pk=session.pk, messages=[user_msg("hi")])
    states.apply_appended(appended)
    states.history(stale)
    rows = states.history(fresh(session))
    assert [m.seq for m in rows] == [1, 2]


# --- A6: eviction ---------------------------------------------------------------------------


def test_idle_states_are_evicted_after_the_ttl_but_busy_ones_stay(user: Any) -> None:
    # covers: A6, A8
    ttl = django_settings.CHAT["SESSION_TTL_SECONDS"]
    assert ttl == 24 * 3600
    assert django_settings.CHAT["CLEANUP_INTERVAL_SECONDS"] == 60 * 60
    idle = create(user, "idle")
    busy = create(user, "busy")
    services.messages_append(session_pk=idle.pk, messages=[user_msg("remember me")])
    states = SessionStates()
    before = states.history(fresh(idle))
    states.history(fresh(busy))
    # Within the TTL nothing goes.
    assert states.evict_expired(busy=set(), now=time.monotonic() + ttl - 60) == 0
    assert len(states) == 2
    # Past the TTL the idle state goes; the one with a running or queued turn stays.
    assert states.evict_expired(busy={busy.pk}, now=time.monotonic() + ttl + 1) == 1
    assert idle.pk not in states
    assert busy.pk in states
    # The database kept everything: coming back reloads the same history.
    back = fresh(idle)
    with CaptureQueriesContext(connection) as queries:
        after = states.history(back)
    assert len(queries) == 1
    assert [(m.pk, m.seq, m.content) for m in after] == [(m.pk, m.seq, m.content) for m in before]
    assert idle.pk in states


def test_using_a_state_keeps_it_from_expiring(user: Any) -> None:
    # covers: A6
    ttl = django_settings.CHAT["SESSION_TTL_SECONDS"]
    session = create(user)
    states = SessionStates()
    states.history(fresh(session))
    assert states.evict_expired(busy=set(), now=time.monotonic() + ttl / 2) == 0
    assert states.evict_expired(busy=set(), now=time.monotonic() + 2 * ttl) == 1
    assert len(states) == 0


# --- A7: delete, restore, purge -------------------------------------------------------------


def test_soft_delete_hides_the_dialog_at_once_and_restore_brings_it_back(user: Any) -> None:
    # covers: A7, F2
    session = create(user, "work")
    services.messages_append(session_pk=session.pk, messages=[user_msg("keep me")])
    chat = f"u{user.pk}"
    services.session_soft_delete(session=session)
    assert selectors.dialog_list_for_chat(owner_id=user.pk, channel="web", chat_id=chat) == []
    assert selectors.session_list_for_owner(owner_id=user.pk) == ([], 0)
    with pytest.raises(NotFound):
        selectors.session_get_for_owner(owner_id=user.pk, session_id=session.session_id)
    with pytest.raises(NotFound):
        selectors.dialog_get(owner_id=user.pk, channel="web", chat_id=chat, dialog_id="work")
    # Hidden, not gone: the row and its history stay until purged.
    assert stored_seqs(session) == [1, 2]
    restored = services.session_restore(session=fresh(session))
    assert restored.deleted_at is None
    got = selectors.session_get_for_owner(owner_id=user.pk, session_id=session.session_id)
    assert got.pk == session.pk
    assert [
        s.pk for s in selectors.dialog_list_for_chat(owner_id=user.pk, channel="web", chat_id=chat)
    ] == [session.pk]
    assert [m.content for m in Message.objects.filter(session=session)][1:] == ["keep me"]


def test_deleting_twice_is_not_found(user: Any) -> None:
    # covers: A7
    session = create(user)
    services.session_soft_delete(session=session)
    with pytest.raises(NotFound):
        services.session_soft_delete(session=session)


def test_soft_delete_cancels_queued_turns_as_stale(user: Any) -> None:
    # covers: A7, C9
    session = create(user)
    queued = Turn.objects.create(session=session, owner=user, number=1, content="later")
    services.session_soft_delete(session=session)
    queued.refresh_from_db()
    assert (queued.status, queued.reason) == ("cancelled", "stale")
    assert queued.finished_at is not None


def test_restore_is_refused_while_a_live_dialog_has_the_same_id(user: Any) -> None:
    # covers: A7, A1
    old = create(user, "default")
    services.session_soft_delete(session=old)
    new = create(user, "default")
    old = fresh(old)
    version = old.state_version
    with pytest.raises(BadRequest) as info:
        services.session_restore(session=old)
    assert "default" in info.value.message
    old_after = fresh(old)
    assert old_after.deleted_at is not None
    assert old_after.state_version == version
    assert fresh(new).deleted_at is None
    assert Session.objects.filter(dialog_id="default", deleted_at__isnull=True).count() == 1


def test_purge_removes_dialogs_deleted_past_the_retention_with_their_messages(
    user: Any,
) -> None:
    # covers: A7, A8
    assert django_settings.CHAT["RETENTION_DAYS"] == 30
    expired = create(user, "expired")
    services.messages_append(session_pk=expired.pk, messages=[user_msg("bye")])
    Turn.objects.create(session=expired, owner=user, number=1, content="x", status="completed")
    recent = create(user, "recent")
    live = create(user, "live")
    services.session_soft_delete(session=expired)
    services.session_soft_delete(session=recent)
    now = timezone.now()
    Session.objects.filter(pk=expired.pk).update(deleted_at=now - timedelta(days=31))
    Session.objects.filter(pk=recent.pk).update(deleted_at=now - timedelta(days=29))

    assert services.sessions_purge_expired() == 1
    assert not Session.objects.filter(pk=expired.pk).exists()
    assert Message.objects.filter(session_id=expired.pk).count() == 0
    assert Turn.objects.filter(session_id=expired.pk).count() == 0
    assert Session.objects.filter(pk=recent.pk).exists()
    assert stored_seqs(recent) == [1]
    assert fresh(live).deleted_at is None
    assert stored_seqs(live) == [1]
    # Idempotent: a second sweep finds nothing.
    assert services.sessions_purge_expired() == 0
    # A deletion ages into the retention window and is then purged too.
    assert services.sessions_purge_expired(now=now + timedelta(days=2)) == 1
    assert not Session.objects.filter(pk=recent.pk).exists()
    assert Session.objects.filter(pk=live.pk).exists()
