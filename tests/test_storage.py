"""Dialogs and their stored history: ids, welcome, seqs, retried writes, the per-process
history cache, eviction and the delete/restore/purge lifecycle (SPEC A1-A8, B2).

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
from django.db import DatabaseError, OperationalError, connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from chatcore.common import publish
from chatcore.common.errors import BadRequest, NotFound, StorageError
from chatcore.common.ids import SessionKey, owner_chat_id, validate_part
from chatcore.engine.sessions import SessionStates
from sessions_app import selectors, services
from sessions_app.models import Message, MessageKind, Role, Session, TitleSource, Turn

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]

MESSAGE_TABLE = "sessions_app_message"
SESSION_TABLE = "sessions_app_session"


# --- helpers ------------------------------------------------------------------------------


def create(user: Any, dialog_id: str | None = "default", **kw: Any) -> Session:
    return services.session_create(
        owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id=dialog_id, **kw
    )


def user_msg(text: str) -> services.NewMessage:
    return services.NewMessage(role=Role.USER, content=text, kind=MessageKind.USER_INPUT)


def assistant_msg(text: str) -> services.NewMessage:
    return services.NewMessage(role=Role.ASSISTANT, content=text, kind=MessageKind.ASSISTANT)


def stored_seqs(session: Session) -> list[int]:
    return list(
        Message.objects.filter(session_id=session.pk).order_by("seq").values_list("seq", flat=True)
    )


def fresh(session: Session) -> Session:
    return Session.objects.get(pk=session.pk)


class FailStatements:
    """An execute wrapper that makes the first `failures` matching statements raise, like a
    database that is briefly unavailable; it counts every matching attempt."""

    def __init__(self, table: str, verb: str, failures: int) -> None:
        self.table = f'"{table}"'
        self.verb = verb
        self.remaining = failures
        self.attempts = 0

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if self.table in sql and sql.lstrip().upper().startswith(self.verb):
            self.attempts += 1
            if self.remaining > 0:
                self.remaining -= 1
                raise OperationalError("injected: disk I/O error at /secret/path")
        return execute(sql, params, many, context)


@pytest.fixture
def fast_retries(settings: Any) -> list[float]:
    """Retry delays of 1, 2, 3 ms; returns the list of sleeps the retry loop made."""
    chat = dict(settings.CHAT)
    chat["STORAGE_RETRY_DELAYS_MS"] = [1, 2, 3]
    settings.CHAT = chat
    return []


@pytest.fixture
def sleeps(fast_retries: list[float], monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record (and still perform) the sleeps between storage attempts."""
    real_sleep = time.sleep

    def recording_sleep(seconds: float) -> None:
        fast_retries.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(services.time, "sleep", recording_sleep)
    return fast_retries


# --- A1: ids ------------------------------------------------------------------------------

BAD_PARTS = [
    pytest.param("", id="empty"),
    pytest.param("a" * 65, id="65-chars"),
    pytest.param("two words", id="space"),
    pytest.param("a:b", id="colon"),
    pytest.param("a/b", id="slash"),
    pytest.param("caf\u00e9", id="unicode-letter"),
    pytest.param("\u0661\u0662", id="unicode-digits"),
    pytest.param("\u5bf9\u8bdd", id="cjk"),
    pytest.param("tab\there", id="tab"),
    pytest.param(42, id="int"),
    pytest.param(None, id="none"),
    pytest.param(["a"], id="list"),
]


@pytest.mark.parametrize("value", BAD_PARTS)
def test_validate_part_rejects_bad_parts_with_a_clear_message(value: Any) -> None:
    # covers: A1
    with pytest.raises(BadRequest) as info:
        validate_part(value, field="dialog_id")
    assert info.value.code == "bad_request"
    assert "dialog_id" in info.value.message
    assert "1 to 64" in info.value.message


@pytest.mark.parametrize("value", ["a", "a" * 64, "u42.work", "Ab-9_x.y", "default"])
def test_validate_part_accepts_the_allowed_alphabet(value: str) -> None:
    # covers: A1
    assert validate_part(value, field="chat_id") == value


def test_session_create_never_stores_a_dialog_id_with_a_trailing_newline(user: Any) -> None:
    # covers: A1
    with pytest.raises(BadRequest):
        create(user, "work\n")
    assert Session.objects.count() == 0


def test_session_key_parse_and_build_round_trip() -> None:
    # covers: A1
    key = SessionKey.parse("web:u42.work:default")
    assert (key.channel, key.chat_id, key.dialog_id) == ("web", "u42.work", "default")
    assert str(key) == "web:u42.work:default"
    assert SessionKey.build("api", "u7", "d1") == SessionKey.parse("api:u7:d1")


@pytest.mark.parametrize(
    "raw",
    [
        "web:u1",
        "web:u1:d1:extra",
        "web::d1",
        ":u1:d1",
        "web:u1:",
        "web:u 1:d1",
        "web:u1:d/1",
        "web:u1:" + "d" * 65,
        "web:u1:\u00e9",
        "",
        None,
        42,
    ],
)
def test_session_key_parse_rejects_malformed_ids(raw: Any) -> None:
    # covers: A1
    with pytest.raises(BadRequest) as info:
        SessionKey.parse(raw)
    assert info.value.message  # a clear, non-empty reason


@pytest.mark.parametrize(
    "parts",
    [("web", "u1", ""), ("w eb", "u1", "d"), ("web", "u1/x", "d"), ("web", 1, "d")],
)
def test_session_key_build_rejects_each_bad_part(parts: tuple[Any, Any, Any]) -> None:
    # covers: A1
    with pytest.raises(BadRequest):
        SessionKey.build(*parts)


@pytest.mark.parametrize(
    "dialog_id", ["a b", "a:b", "a/b", "x" * 65, "\u00e9t\u00e9", "\u5bf9\u8bdd", 7]
)
def test_session_create_with_a_bad_dialog_id_raises_and_stores_nothing(
    user: Any, dialog_id: Any
) -> None:
    # covers: A1
    with pytest.raises(BadRequest) as info:
        create(user, dialog_id)
    assert "dialog_id" in info.value.message
    assert Session.objects.count() == 0
    assert Message.objects.count() == 0


@pytest.mark.parametrize("chat_id", ["", "u1 2", "u1:2", "u1/2", "c" * 65])
def test_session_create_with_a_bad_chat_id_raises_and_stores_nothing(
    user: Any, chat_id: str
) -> None:
    # covers: A1
    with pytest.raises(BadRequest):
        services.session_create(owner=user, channel="web", chat_id=chat_id, dialog_id="default")
    assert Session.objects.count() == 0


def test_session_create_with_an_explicit_empty_dialog_id_is_rejected(user: Any) -> None:
    # covers: A1
    with pytest.raises(BadRequest):
        create(user, "")
    assert Session.objects.count() == 0


def test_user_cannot_create_a_dialog_in_another_users_chat(user: Any, other_user: Any) -> None:
    # covers: A1, F2
    for chat_id in (f"u{other_user.pk}", f"u{other_user.pk}.work"):
        with pytest.raises(NotFound):
            services.session_create(owner=user, channel="web", chat_id=chat_id, dialog_id="default")
    assert Session.objects.count() == 0
    assert Message.objects.count() == 0


@pytest.mark.parametrize("channel", ["web", "api", "cli"])
def test_a_chat_id_that_only_starts_like_the_owners_is_not_theirs(user: Any, channel: str) -> None:
    # covers: A1 (`u4` must not own `u42` or `u4x`)
    for chat_id in (f"u{user.pk}0", f"u{user.pk}x", f"x{user.pk}", f"U{user.pk}"):
        with pytest.raises(NotFound):
            services.session_create(owner=user, channel=channel, chat_id=chat_id, dialog_id="d")
    assert Session.objects.count() == 0


def test_owner_suffix_chat_ids_work(user: Any) -> None:
    # covers: A1
    chat_id = owner_chat_id(user.pk, "work")
    assert chat_id == f"u{user.pk}.work"
    session = services.session_create(
        owner=user, channel="web", chat_id=chat_id, dialog_id="default"
    )
    assert session.session_id == f"web:u{user.pk}.work:default"
    plain = create(user, "default")
    # Two chats of one owner are separate: both can have a `default` dialog.
    assert plain.pk != session.pk
    assert Session.objects.filter(owner=user, dialog_id="default").count() == 2


def test_a_second_live_dialog_with_the_same_id_is_refused(user: Any) -> None:
    # covers: A1, A2
    create(user, "work")
    with pytest.raises(BadRequest) as info:
        create(user, "work")
    assert "work" in info.value.message
    assert Session.objects.filter(dialog_id="work").count() == 1
    assert Message.objects.count() == 1


def test_deleted_default_dialog_can_be_created_again(user: Any) -> None:
    # covers: A1, A7
    first = create(user, "default")
    services.messages_append(session_pk=first.pk, messages=[user_msg("old words")])
    services.session_soft_delete(session=first)
    second = create(user, "default")
    assert second.pk != first.pk
    assert second.session_id == first.session_id
    assert Session.objects.filter(dialog_id="default").count() == 2
    # The new dialog starts afresh; the old one keeps its history for restore.
    assert [m.content for m in Message.objects.filter(session=second)][0].startswith("New dialog")
    assert stored_seqs(second) == [1]
    assert stored_seqs(first) == [1, 2]
    assert fresh(first).deleted_at is not None


# --- A2, B2: a new dialog and its welcome ----------------------------------------------------


def test_new_dialog_has_exactly_one_welcome_message(user: Any) -> None:
    # covers: A2, B2, B4
    session = create(user, "work")
    rows = list(Message.objects.filter(session=session))
    assert len(rows) == 1
    welcome = rows[0]
    assert welcome.seq == 1
    assert welcome.role == Role.SYSTEM
    assert welcome.source["kind"] == MessageKind.WELCOME
    assert "work" in welcome.content
    assert "/sessions" in welcome.content and "/switch" in welcome.content
    session = fresh(session)
    assert session.message_count == 0
    assert session.total_message_count == 1
    assert session.last_seq == 1
    assert session.title == "Dialog work"
    assert session.title_source == TitleSource.DEFAULT
    assert session.owner_id == user.pk
    assert session.deleted_at is None


def test_new_dialog_with_a_title_keeps_it(user: Any) -> None:
    # covers: A2, B4
    session = fresh(create(user, "trip", title="  Trip   to Kyoto "))
    assert session.title == "Trip to Kyoto"
    assert session.title_source == TitleSource.USER
    assert Message.objects.filter(session=session).count() == 1


def test_new_dialog_without_an_id_gets_a_valid_generated_one(user: Any) -> None:
    # covers: A1, B2
    a = create(user, None)
    b = create(user, None)
    assert a.dialog_id != b.dialog_id
    for s in (a, b):
        assert validate_part(s.dialog_id, field="dialog_id") == s.dialog_id
        assert fresh(s).title == f"Dialog {s.dialog_id}"
        assert s.dialog_id in Message.objects.get(session=s).content


@pytest.mark.parametrize("title", ["", "   ", "x" * 201])
def test_new_dialog_with_a_bad_title_stores_nothing(user: Any, title: str) -> None:
    # covers: A1, B4
    with pytest.raises(BadRequest):
        create(user, "t", title=title)
    assert Session.objects.count() == 0


# --- A3: seqs -----------------------------------------------------------------------------


def test_seqs_start_at_one_and_grow_by_one_per_message(user: Any) -> None:
    # covers: A3, A2
    session = create(user)
    one = services.messages_append(session_pk=session.pk, messages=[user_msg("hi")])
    assert [m.seq for m in one.messages] == [2]
    assert (one.base_revision, one.revision) == (1, 2)
    batch = services.messages_append(
        session_pk=session.pk,
        messages=[assistant_msg("a"), user_msg("b"), assistant_msg("c")],
    )
    assert [m.seq for m in batch.messages] == [3, 4, 5]
    assert (batch.base_revision, batch.revision) == (2, 5)
    assert stored_seqs(session) == [1, 2, 3, 4, 5]
    session = fresh(session)
    assert session.last_seq == 5
    # A2: message_count counts the user's messages only; the total counts everything.
    assert session.message_count == 2
    assert session.total_message_count == 5


def test_a_batch_append_is_atomic(user: Any, fast_retries: list[float]) -> None:
    # covers: A3, A4 (the messages are inserted, then the dialog update fails: none stay)
    session = create(user)
    fail = FailStatements(SESSION_TABLE, "UPDATE", failures=10)
    with connection.execute_wrapper(fail), pytest.raises(StorageError):
        services.messages_append(
            session_pk=session.pk, messages=[user_msg("q"), assistant_msg("a")]
        )
    assert fail.attempts == 4
    assert stored_seqs(session) == [1]
    after = fresh(session)
    assert (after.last_seq, after.total_message_count, after.message_count) == (1, 1, 0)
    # The next append takes the seqs the failed batch did not keep.
    ok = services.messages_append(session_pk=session.pk, messages=[user_msg("q")])
    assert [m.seq for m in ok.messages] == [2]


def test_seqs_are_never_reused_after_clearing(user: Any) -> None:
    # covers: A3
    session = create(user)
    services.messages_append(session_pk=session.pk, messages=[user_msg("a"), assistant_msg("b")])
    assert stored_seqs(session) == [1, 2, 3]
    removed = services.messages_clear(session=session)
    assert removed == 3
    assert stored_seqs(session) == []
    assert fresh(session).last_seq == 3
    again = services.messages_append(session_pk=session.pk, messages=[user_msg("c")])
    assert [m.seq for m in again.messages] == [4]
    assert again.base_revision == 3
    assert stored_seqs(session) == [4]
    after = fresh(session)
    assert (after.last_seq, after.message_count, after.total_message_count) == (4, 1, 1)


def test_seq_continues_from_the_stored_maximum_after_a_restart(user: Any) -> None:
    # covers: A3, A5
    session = create(user)
    for text in ("one", "two", "three"):
        services.messages_append(session_pk=session.pk, messages=[user_msg(text)])
    # A restart: nothing in memory, a fresh row from the database, a fresh cache.
    reloaded = fresh(session)
    states = SessionStates()
    assert [m.seq for m in states.history(reloaded)] == [1, 2, 3, 4]
    nxt = services.messages_append(session_pk=reloaded.pk, messages=[user_msg("four")])
    assert [m.seq for m in nxt.messages] == [5]
    assert stored_seqs(session) == [1, 2, 3, 4, 5]


def test_history_revision_never_goes_back(user: Any) -> None:
    # covers: A3, D2
    session = create(user)
    seen = [fresh(session).last_seq]

    def step() -> None:
        seen.append(fresh(session).last_seq)

    services.messages_append(session_pk=session.pk, messages=[user_msg("a")])
    step()
    services.session_rename(session=session, title="Renamed")
    step()
    services.messages_clear(session=session)
    step()
    services.session_soft_delete(session=session)
    step()
    services.session_restore(session=fresh(session))
    step()
    services.messages_append(session_pk=session.pk, messages=[user_msg("b")])
    step()
    assert seen == sorted(seen)
    assert seen[0] == 1 and seen[-1] == 3


def test_seqs_are_unique_per_session_not_global(user: Any) -> None:
    # covers: A3
    a = create(user, "a")
    b = create(user, "b")
    services.messages_append(session_pk=a.pk, messages=[user_msg("x")])
    services.messages_append(session_pk=b.pk, messages=[user_msg("y")])
    assert stored_seqs(a) == [1, 2]
    assert stored_seqs(b) == [1, 2]


# --- A4: retried writes ---------------------------------------------------------------------


def test_retry_defaults_are_100_200_300_ms() -> None:
    # covers: A4, A8
    assert list(django_settings.CHAT["STORAGE_RETRY_DELAYS_MS"]) == [100, 200, 300]


def test_an_append_that_fails_twice_succeeds_on_the_third_attempt(
    user: Any, sleeps: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    # covers: A4
    session = create(user)
    caplog.set_level(logging.WARNING, logger="sessions_app.services")
    fail = FailStatements(MESSAGE_TABLE, "INSERT", failures=2)
    with connection.execute_wrapper(fail):
        appended = services.messages_append(session_pk=session.pk, messages=[user_msg("kept")])
    assert fail.attempts == 3
    assert sleeps == [0.001, 0.002]
    assert [m.seq for m in appended.messages] == [2]
    rows = list(Message.objects.filter(session=session).order_by("seq"))
    assert [(m.seq, m.content) for m in rows] == [(1, rows[0].content), (2, "kept")]
    assert fresh(session).last_seq == 2
    retries = [r for r in caplog.records if r.name == "sessions_app.services"]
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
    caplog.set_level(logging.WARNING, logger="sessions_app.services")
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
    caplog.set_level(logging.WARNING, logger="sessions_app.services")

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
    with CaptureQueriesContext(connection) as third:
        rows = states.history(moved)
    assert [m.seq for m in rows] == [1, 2, 3]
    assert len(third) == 1
    sql = third.captured_queries[0]["sql"]
    assert MESSAGE_TABLE in sql and '"seq" > 1' in sql
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
