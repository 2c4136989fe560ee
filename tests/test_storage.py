"""Dialogs and their stored history: ids, a new dialog and its welcome, seqs (SPEC A1-A3,
B2). Retried writes, the history cache, eviction and the lifecycle are in
`test_storage_durability.py`.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from chatcore.common.errors import BadRequest, NotFound, StorageError
from chatcore.common.ids import SessionKey, owner_chat_id, validate_part
from chatcore.engine.sessions import SessionStates
from sessions_app import services
from sessions_app.models import Message, MessageKind, Role, Session, TitleSource
from tests.storage_helpers import (
    SESSION_TABLE,
    FailStatements,
    assistant_msg,
    create,
    fresh,
    stored_seqs,
    user_msg,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


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


def test_row_ids_are_random_uuids_unique_across_threads_and_a_forked_child() -> None:
    # covers: A2 (rows keyed by random UUIDs, as `uuid4` makes, read from the OS in blocks;
    # a forked worker never repeats its parent's)
    import os
    import threading
    import uuid

    from chatcore.common.ids import new_uuid

    seen: list[uuid.UUID] = []

    def draw() -> None:
        seen.extend(new_uuid() for _ in range(2000))

    threads = [threading.Thread(target=draw) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == len(seen) == 8000
    assert {(u.version, u.variant) for u in seen} == {(4, uuid.RFC_4122)}

    new_uuid()  # the parent holds a block read already
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.close(read)
        os.write(write, b"".join(new_uuid().bytes for _ in range(16)))
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    child = {uuid.UUID(bytes=data[i : i + 16]) for i in range(0, len(data), 16)}
    parent = {new_uuid() for _ in range(16)}
    assert len(child) == 16 and not child & parent


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
    # The web chat's welcome speaks of the web chat (issue 54) ...
    assert welcome.content.startswith("New dialog started.") and "/switch" not in welcome.content
    # ... other channels' names the dialog and the commands (B2).
    cli = services.session_create(
        owner=user, channel="cli", chat_id=f"u{user.pk}", dialog_id="work"
    )
    text = Message.objects.get(session=cli).content
    assert "work" in text and "/sessions" in text and "/switch" in text
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
    api = services.session_create(owner=user, channel="api", chat_id=f"u{user.pk}")
    assert api.dialog_id in Message.objects.get(session=api).content  # B2: named in its welcome


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


# --- F7: the context's read window ----------------------------------------------------------


def test_a_turns_context_is_one_statement(user, django_user_model):
    # covers: G6, B5, C8, F7 (compaction, window and memory notes before every first token)
    from datetime import timedelta

    from django.db.backends.utils import CursorWrapper
    from django.utils import timezone

    from sessions_app import selectors
    from sessions_app.models import Compaction, MemoryNote

    session = create(user)
    other = django_user_model.objects.create_user("someone-else")

    def read() -> tuple[Any, int, list[str]]:
        statements = []
        real = CursorWrapper._execute

        def count(self: Any, sql: str, *args: Any) -> Any:
            statements.append(sql)
            return real(self, sql, *args)

        CursorWrapper._execute = count  # type: ignore[method-assign]
        try:
            found = selectors.turn_context(
                session_pk=session.pk, owner_id=user.pk, max_chars=25, notes_limit=3
            )
        finally:
            CursorWrapper._execute = real  # type: ignore[method-assign]
        assert len(statements) == 1
        return found.compaction, found.window_start, found.notes

    # A new dialog: no compaction, no notes, everything in the window.
    assert read() == (None, 0, [])

    services.messages_append(session_pk=session.pk, messages=[user_msg("x" * 10) for _ in range(6)])
    seqs = stored_seqs(session)[-6:]
    now = timezone.now()
    for i, content in enumerate(["first", "second", "third", "fourth"]):
        MemoryNote.objects.create(owner=user, content=content, created_at=now + timedelta(i))
    MemoryNote.objects.create(owner=other, content="not theirs", created_at=now + timedelta(9))
    # 25 characters: the two newest fit, the third crosses; the three newest notes, in order.
    assert read() == (None, seqs[3] - 1, ["second", "third", "fourth"])

    # The newest compaction counts, and the window never starts before its end.
    Compaction.objects.create(session=session, through_seq=seqs[1], summary="old", created_at=now)
    Compaction.objects.create(session=session, through_seq=seqs[4], summary="new", created_at=now)
    compaction, window, notes = read()
    assert compaction is not None and compaction.summary == "new"
    assert (window, notes) == (seqs[4], ["second", "third", "fourth"])


def test_history_window_keeps_the_newest_messages_and_the_one_that_crosses_the_limit(user):
    # covers: F7, C7
    from sessions_app import selectors
    from sessions_app.models import Compaction

    session = create(user)
    start = fresh(session).last_seq
    # What came before is compacted: the window starts after it.
    Compaction.objects.create(session=session, through_seq=start, summary="before")
    services.messages_append(session_pk=session.pk, messages=[user_msg("x" * 10) for _ in range(5)])
    seqs = stored_seqs(session)[-5:]

    def window(dialog: Session, max_chars: int) -> int:
        found = selectors.turn_context(session_pk=dialog.pk, owner_id=user.pk, max_chars=max_chars)
        # What it leaves out is counted too: the messages past the newest compaction's end
        # up to the window's start.
        through = found.compaction.through_seq if found.compaction else 0
        outside = Message.objects.filter(
            session_id=dialog.pk, seq__gt=through, seq__lte=found.window_start
        ).count()
        assert found.skipped == outside
        return found.window_start

    # Everything fits: nothing is left out.
    assert window(session, 50) == start
    # 25 characters: the two newest fit, the third crosses the limit and is still read.
    assert window(session, 25) == seqs[2] - 1
    # 20 characters fill exactly with the two newest; the third still crosses, and is read.
    assert window(session, 20) == seqs[2] - 1
    # Never before the newest compaction's end.
    Compaction.objects.create(session=session, through_seq=seqs[3], summary="later")
    assert window(session, 5) == seqs[3]
    # Another dialog's messages do not count.
    other = create(user, dialog_id="other")
    assert window(other, 5) == 0


def test_the_window_of_a_long_or_cleared_dialog_counts_what_it_leaves_out(user):
    # covers: F7, C7, A3 (the window is read from the newest message as far as its boundary,
    # and what it leaves out is counted from seqs: exact for a dialog many times longer than
    # the window, and after its messages were cleared, whose seqs resume above the gap)
    from sessions_app import selectors

    session = create(user)
    services.messages_append(
        session_pk=session.pk, messages=[user_msg("x" * 10) for _ in range(60)]
    )

    def read() -> tuple[int, int]:
        found = selectors.turn_context(session_pk=session.pk, owner_id=user.pk, max_chars=35)
        outside = Message.objects.filter(session_id=session.pk, seq__lte=found.window_start).count()
        assert found.skipped == outside
        return found.window_start, found.skipped

    last = fresh(session).last_seq
    # The three newest fit in 35 characters, the fourth crosses and is read: the rest (the
    # welcome among them) is left out.
    assert read() == (last - 4, last - 4)
    services.messages_clear(session=session)
    services.messages_append(session_pk=session.pk, messages=[user_msg("y" * 10) for _ in range(6)])
    last = fresh(session).last_seq
    assert read() == (last - 4, 2)


def test_the_window_counts_characters_of_messages_however_they_were_written(user):
    # covers: F7, C7 (the window sums each message's length as the database keeps it, in
    # characters: text beyond ASCII counts as the model reads it, not by its bytes)
    from sessions_app import selectors
    from sessions_app.models import Compaction

    session = create(user)
    start = fresh(session).last_seq
    Compaction.objects.create(session=session, through_seq=start, summary="before")
    # Through the turn's own writes (one statement) ...
    services.messages_append(
        session_pk=session.pk, messages=[user_msg("é" * 10), user_msg("\U0001f600" * 10)]
    )
    # ... and through the ORM, as an operator's tool or a migration would write one.
    Message.objects.create(session=session, seq=start + 3, role=Role.USER, content="ü" * 10)
    seqs = stored_seqs(session)[-3:]
    assert list(
        Message.objects.filter(seq__in=seqs).order_by("seq").values_list("content_chars", flat=True)
    ) == [10, 10, 10]

    def window(max_chars: int) -> int:
        found = selectors.turn_context(session_pk=session.pk, owner_id=user.pk, max_chars=max_chars)
        return found.window_start

    # 20 characters fill exactly with the two newest (28 and 30 bytes in UTF-8); the third
    # crosses the limit and is still read.
    assert window(20) == seqs[0] - 1
    assert window(30) == start
    assert window(9) == seqs[2] - 1


@pytest.mark.parametrize("coming", [3, 12, 40])
def test_a_context_read_ahead_of_a_message_gives_the_window_its_append_will(user, coming):
    # covers: F7, G6 (a send's context read while its admission runs: the same window as a
    # read after its user message is appended, and the revision to check that by)
    from sessions_app import selectors

    session = create(user)
    services.messages_append(session_pk=session.pk, messages=[user_msg("x" * 10) for _ in range(5)])
    before = fresh(session)
    ahead = selectors.turn_context(
        session_pk=session.pk, owner_id=user.pk, max_chars=25, ahead=coming
    )
    assert ahead.revision == (before.last_seq, before.state_version)
    services.messages_append(session_pk=session.pk, messages=[user_msg("y" * coming)])
    after = selectors.turn_context(session_pk=session.pk, owner_id=user.pk, max_chars=25)
    assert ahead.window_start == after.window_start
    # The same messages left out, whether the new one crosses the limit by itself (every
    # older one is left out) or not.
    outside = Message.objects.filter(session_id=session.pk, seq__lte=after.window_start).count()
    assert ahead.skipped == after.skipped == outside
    assert outside >= (6 if coming > 25 else 2)
    assert after.revision is None
    row = fresh(session)
    assert ahead.revision == (row.last_seq - 1, row.state_version - 1)


# --- G6: the turn's writes without query compilation store what the ORM stores ------------


def test_rows_written_in_one_statement_read_back_as_the_orm_wrote_them(user):
    # covers: A3, G6
    from datetime import timedelta

    from django.utils import timezone

    from sessions_app import rows
    from sessions_app.models import Turn

    session = create(user)
    when = timezone.now() - timedelta(minutes=3)
    source = {"kind": "user_input", "text": "caf\u00e9 \u5bf9\u8bdd", "nested": [1, {"a": None}]}
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    raw = [
        Message(
            session=session, seq=100, role=Role.USER, content="one", created_at=when, source=source
        ),
        Message(
            session=session,
            seq=101,
            role=Role.ASSISTANT,
            content="",
            tool_calls=calls,
            created_at=when,
        ),
    ]
    orm = Message(
        session=session, seq=102, role=Role.USER, content="one", created_at=when, source=source
    )
    rows.insert(raw)
    orm.save()
    assert not raw[0]._state.adding
    stored = {m.seq: m for m in Message.objects.filter(session=session, seq__gte=100)}
    for field in ("role", "content", "created_at", "source", "tool_calls", "media_refs", "status"):
        assert getattr(stored[100], field) == getattr(stored[102], field), field
    assert stored[101].tool_calls == calls and stored[100].pk == raw[0].pk

    turn = Turn(session=session, owner=user, number=7, content="q", source=source, received_at=when)
    rows.insert([turn])
    turn.status, turn.started_at, turn.usage = "running", when, {"prompt_tokens": 3}
    rows.update(turn, ["status", "started_at", "usage"])
    back = Turn.objects.get(pk=turn.pk)
    assert (back.status, back.started_at, back.usage, back.source) == (
        "running",
        when,
        {"prompt_tokens": 3},
        source,
    )
    session.title = "renamed"
    rows.update(session, ["title"])
    assert fresh(session).title == "renamed"

    # Rows read in SQL (`rows.from_row`) are the ORM's, field by field (datetimes, JSON, the
    # lease's fields, booleans, the owner's key).
    from django.db import transaction

    from sessions_app.models import Compaction
    from sessions_app.selectors import turn_context

    Session.objects.filter(pk=session.pk).update(
        plan="step one", lease_owner="p1", lease_expires_at=when, lease_epoch=4
    )
    with transaction.atomic():
        locked = services.lock_session(session.pk)
    orm_session = Session.objects.get(pk=session.pk)
    assert locked is not None and not locked._state.adding
    for field in Session._meta.concrete_fields:
        assert getattr(locked, field.attname) == getattr(orm_session, field.attname), field.name
    Compaction.objects.create(session=session, through_seq=2, summary="caf\u00e9", created_at=when)
    read = turn_context(session_pk=session.pk, owner_id=user.pk, max_chars=10).compaction
    orm_compaction = Compaction.objects.get(session=session)
    assert read is not None
    for field in Compaction._meta.concrete_fields:
        assert getattr(read, field.attname) == getattr(orm_compaction, field.attname), field.name
    from sessions_app.selectors import messages_for_context

    context = messages_for_context(session_pk=session.pk, after_seq=99)
    orm_messages = list(Message.objects.filter(session=session, seq__gt=99).order_by("seq"))
    assert [m.seq for m in context] == [100, 101, 102]
    for read_message, orm_message in zip(context, orm_messages, strict=True):
        for field in Message._meta.concrete_fields:
            assert getattr(read_message, field.attname) == getattr(orm_message, field.attname)
    # ...and the instances are the ORM's too: the same attributes and state, a lazy related
    # object, and a save that updates the row rather than adding one.
    for read_message, orm_message in zip(context, orm_messages, strict=True):
        assert vars(read_message).keys() == vars(orm_message).keys()
        assert (read_message._state.adding, read_message._state.db) == (False, "default")
    assert context[0].session.pk == session.pk and context[0].session.title == "renamed"
    context[0].content = "edited"
    context[0].save(update_fields=["content"])
    assert Message.objects.get(pk=context[0].pk).content == "edited"
    assert Message.objects.filter(session=session, seq__gte=100).count() == 3


def test_rows_read_in_sql_send_the_init_signals_to_whoever_listens(user):
    # covers: A3 (a row made without `Model.__init__` is still one a listener of the model's
    # `pre_init` / `post_init` hears about, as it hears of the ORM's)
    from django.db.models.signals import post_init, pre_init

    from sessions_app.selectors import messages_for_context

    session = create(user)
    for seq in (100, 101):
        Message.objects.create(session=session, seq=seq, role=Role.USER, content=f"m{seq}")
    heard: list[tuple[str, Any]] = []

    def before(sender: Any, **kwargs: Any) -> None:
        heard.append(("pre", sender))

    def after(sender: Any, instance: Any, **kwargs: Any) -> None:
        heard.append(("post", instance.content))

    quiet = messages_for_context(session_pk=session.pk, after_seq=99)
    assert [m.content for m in quiet] == ["m100", "m101"] and heard == []
    pre_init.connect(before, sender=Message)
    post_init.connect(after, sender=Message)
    try:
        read = messages_for_context(session_pk=session.pk, after_seq=99)
    finally:
        pre_init.disconnect(before, sender=Message)
        post_init.disconnect(after, sender=Message)
    assert [m.content for m in read] == ["m100", "m101"]
    assert heard == [("pre", Message), ("post", "m100"), ("pre", Message), ("post", "m101")]
    for fast, slow in zip(quiet, read, strict=True):
        assert vars(fast).keys() == vars(slow).keys()
        assert {k: v for k, v in vars(fast).items() if k != "_state"} == {
            k: v for k, v in vars(slow).items() if k != "_state"
        }


def test_values_the_orm_would_convert_are_written_converted_in_one_statement(user):
    # covers: A3, G6 (a value given in another type than its field's, or a naive time, is
    # stored as the ORM stores it, not passed through as it is)
    import datetime
    import uuid

    from sessions_app import rows

    session = create(user)
    naive = datetime.datetime(2026, 3, 1, 12, 30, 15, 250000)  # noqa: DTZ001 (naive on purpose)
    key = uuid.uuid4()
    raw = Message(session=session, seq=200, role=Role.USER, content="a", created_at=naive)
    raw.id = key.hex  # a UUID given as its text
    orm = Message(session=session, seq=201, role=Role.USER, content="a", created_at=naive)
    with pytest.warns(RuntimeWarning, match="naive datetime"):
        rows.insert([raw])
    with pytest.warns(RuntimeWarning, match="naive datetime"):
        orm.save()
    stored = {m.seq: m for m in Message.objects.filter(session=session, seq__gte=200)}
    assert stored[200].pk == key
    assert stored[200].created_at == stored[201].created_at
    assert stored[200].created_at.utcoffset() == datetime.timedelta(0)


# --- I2: an update that matches no row is an error, never a silent success ------------------


def _turn(session: Session, number: int, **fields: Any) -> Any:
    from sessions_app.models import Turn

    return Turn(session=session, owner_id=session.owner_id, number=number, **fields)


def test_an_update_that_matches_no_row_raises_and_its_transaction_commits_nothing(user):
    # covers: A3, C10, I2 (a turn's end, or a dialog's row gone under its append: alone, in
    # one merged statement, or sent in a pipeline, the write fails and nothing of its
    # transaction commits)
    import uuid

    from django.db import DatabaseError, transaction

    from sessions_app import rows, turn_services

    with pytest.raises(DatabaseError, match="matched 0 rows"):
        turn_services.turn_finish(turn_pk=uuid.uuid4(), status="completed")

    session = create(user, "gone")
    before = stored_seqs(session)
    with pytest.raises(DatabaseError, match="matched 0 rows"), transaction.atomic():
        locked = services.lock_session(session.pk)
        assert locked is not None
        Session.objects.filter(pk=session.pk).delete()
        with rows.merged():
            services.append_locked(locked, [user_msg("lost")])
    assert fresh(session).last_seq == before[-1]
    assert stored_seqs(session) == before

    kept = _turn(session, 1)
    rows.insert([kept])
    ghost = _turn(session, 2)  # never stored
    kept.status = ghost.status = "running"
    with pytest.raises(DatabaseError, match="matched 0 rows"), transaction.atomic():
        with rows.pipelined():
            rows.update(kept, ["status"])
            rows.update(ghost, ["status"])
    assert type(kept).objects.get(pk=kept.pk).status == "queued"  # rolled back with it
    with transaction.atomic(), rows.pipelined():
        rows.update(kept, ["status"])
    assert type(kept).objects.get(pk=kept.pk).status == "running"


def test_a_merged_update_of_a_row_inserted_beside_it_is_refused_on_postgresql(user):
    # covers: I2 (the parts of one data-modifying statement all see the snapshot from before
    # it: the update would silently do nothing there; it raises instead. SQLite runs each
    # write at once, so there it sees the row)
    from django.db import DatabaseError, transaction

    from sessions_app import rows
    from sessions_app.models import Turn

    session = create(user, "beside")
    turn = _turn(session, 1)

    def insert_then_update() -> None:
        with transaction.atomic(), rows.merged():
            rows.insert([turn])
            turn.status = "running"
            rows.update(turn, ["status"])

    if connection.vendor == "postgresql":
        with pytest.raises(DatabaseError, match="matched 0 rows"):
            insert_then_update()
        assert not Turn.objects.filter(pk=turn.pk).exists()
    else:
        insert_then_update()
        assert Turn.objects.get(pk=turn.pk).status == "running"
