"""The message tree on its own (SPEC H1): the path walk, the pages clients read, and the
builder's model input with compaction summaries across forks."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import transaction

from chatcore.engine.sessions import SessionStates
from chatcore.engine.turns.builder import RuntimeInfo, TurnInputBuilder
from sessions_app import branch_services, branches, selectors, services, turn_services
from sessions_app.models import Message, MessageKind, Role, Session

# The path walk's SQL runs on both databases.
pytestmark = pytest.mark.both_dbs

# covers: H1


def test_the_path_runs_from_the_first_message_to_the_head():
    #   1 - 2 - 3 - 4
    #         \ 5 - 6
    #             \ 7
    parents = {1: None, 2: 1, 3: 2, 4: 3, 5: 2, 6: 5, 7: 5}
    assert branches.path_to(parents, 4) == [1, 2, 3, 4]
    assert branches.path_to(parents, 6) == [1, 2, 5, 6]
    assert branches.path_to(parents, 7) == [1, 2, 5, 7]
    assert branches.path_to(parents, 99) == []
    assert branches.children_of(parents)[2] == [3, 5]
    assert branches.children_of(parents)[5] == [6, 7]
    # A branch goes down to the newest message of its subtree.
    assert branches.newest_leaf(parents, 3) == 4
    assert branches.newest_leaf(parents, 5) == 7
    assert branches.newest_leaf(parents, 2) == 7
    assert branches.newest_leaf(parents, 4) == 4


def test_a_missing_parent_ends_the_walk():
    parents = {5: 3, 6: 5, 7: 6, 8: 7}  # 3 was cleared away
    assert branches.path_to(parents, 8) == [5, 6, 7, 8]


def _dialog(user: Any) -> Session:
    return services.session_create(owner=user, channel="web", chat_id=f"u{user.pk}")


def _msg(role: str, text: str) -> services.NewMessage:
    kind = MessageKind.USER_INPUT if role == Role.USER else MessageKind.ASSISTANT
    return services.NewMessage(role=role, content=text, kind=kind)


def _append(session: Session, *new: services.NewMessage, parent: Any = False) -> list[int]:
    with transaction.atomic():
        live = services.lock_session(session.pk)
        assert live is not None
        appended = services.append_locked(live, list(new), parent_seq=parent)
    return [m.seq for m in appended.messages]


def _builder() -> TurnInputBuilder:
    return TurnInputBuilder(states=SessionStates(), system_prompt="P", skills_dir="/none")


def _texts(prepared: Any) -> list[str]:
    return [str(m["content"]).split("\n\n[runtime")[0] for m in prepared.messages[1:]]


@pytest.mark.django_db(transaction=True)
async def test_pages_hold_the_active_path_with_siblings(user):
    session = await sync_to_async(_dialog)(user)
    q1, a1 = await sync_to_async(_append)(session, _msg("user", "q1"), _msg("assistant", "a1"))
    parent = (await sync_to_async(Message.objects.get)(session_id=session.pk, seq=q1)).parent_seq
    (q1b,) = await sync_to_async(_append)(session, _msg("user", "q1 edited"), parent=parent)
    fresh = await sync_to_async(Session.objects.get)(pk=session.pk)
    assert fresh.forked and fresh.head_seq == q1b
    page, more = await sync_to_async(selectors.messages_page)(session_pk=session.pk, session=fresh)
    assert [m.content for m in page][1:] == ["q1 edited"] and not more
    assert page[-1].siblings == [q1, q1b]
    # REST pages from a seq on: the path only, ascending.
    page, _ = await sync_to_async(selectors.messages_from)(
        session_pk=session.pk, from_seq=2, session=fresh
    )
    assert [m.seq for m in page] == [q1b]
    # Back to the first version: the whole old branch, down to its answer.
    await sync_to_async(branch_services.branch_switch)(session=session, seq=q1)
    fresh = await sync_to_async(Session.objects.get)(pk=session.pk)
    assert fresh.head_seq == a1
    page, _ = await sync_to_async(selectors.messages_page)(session_pk=session.pk, session=fresh)
    assert [m.content for m in page][1:] == ["q1", "a1"]
    assert page[1].siblings == [q1, q1b] and not hasattr(page[2], "siblings")


@pytest.mark.django_db(transaction=True)
async def test_a_summary_is_used_only_where_it_lies_on_the_active_path(user):
    session = await sync_to_async(_dialog)(user)
    seqs = await sync_to_async(_append)(
        session,
        _msg("user", "old q1"),
        _msg("assistant", "old a1"),
        _msg("user", "old q2"),
        _msg("assistant", "old a2"),
    )
    q1, a1, q2, a2 = seqs
    # A summary through the second answer, then a third exchange after it.
    await sync_to_async(turn_services.compaction_commit)(
        session_pk=session.pk, through=a2, generation=session.generation, summary="SUMMARY"
    )
    await sync_to_async(_append)(session, _msg("user", "q3"))
    builder = _builder()
    runtime = RuntimeInfo(channel="web", dialog_id=session.dialog_id, title="t")
    prepared = await builder.prepare(session_pk=session.pk, runtime=runtime)
    assert "SUMMARY" in _texts(prepared)[0] and _texts(prepared)[1:] == ["q3"]

    # A fork after the summarised part keeps the summary...
    (q3b,) = await sync_to_async(_append)(session, _msg("user", "q3 edited"), parent=a2)
    prepared = await builder.prepare(session_pk=session.pk, runtime=runtime)
    assert "SUMMARY" in _texts(prepared)[0] and _texts(prepared)[1:] == ["q3 edited"]
    assert prepared.compacted_through == a2

    # ...a fork before it rebuilds the path from its messages, without the summary.
    (q2b,) = await sync_to_async(_append)(session, _msg("user", "q2 edited"), parent=a1)
    prepared = await builder.prepare(session_pk=session.pk, runtime=runtime)
    texts = _texts(prepared)
    assert not any("SUMMARY" in t for t in texts)
    assert texts == ["old q1", "old a1", "q2 edited"]
    assert prepared.compacted_through == 0

    # Switching back to the summarised branch uses the summary again.
    await sync_to_async(branch_services.branch_switch)(session=session, seq=q3b)
    prepared = await builder.prepare(session_pk=session.pk, runtime=runtime)
    assert "SUMMARY" in _texts(prepared)[0] and _texts(prepared)[1:] == ["q3 edited"]
    assert q2b > q3b > q1


@pytest.mark.django_db(transaction=True)
def test_titles_and_summaries_read_the_active_path(user):
    from chatcore.engine import jobs

    session = _dialog(user)
    _append(session, _msg("user", "about cats"), _msg("assistant", "cats are fine"))
    _append(session, _msg("user", "about dogs"), parent=1)
    for n in range(4):
        _append(session, _msg("assistant", f"dog answer {n}"), _msg("user", f"dog question {n}"))
    from sessions_app.models import TitleSource

    title = jobs._title_input(session.pk, TitleSource.FIRST)
    assert title is not None
    transcript = title[1]["content"]
    assert "about dogs" in transcript and "cats" not in transcript
    summary = jobs._compaction_input(session.pk)
    assert summary is not None
    text = summary[0][1]["content"]
    assert "about dogs" in text and "cats" not in text


@pytest.mark.django_db(transaction=True)
def test_older_pages_of_a_forked_dialog_follow_its_path(user):
    session = _dialog(user)
    seqs = _append(
        session, *[_msg("user" if n % 2 == 0 else "assistant", f"m{n}") for n in range(6)]
    )
    (fork,) = _append(session, _msg("user", "m4 again"), parent=seqs[3])
    _append(session, _msg("assistant", "a4 again"))
    fresh = Session.objects.get(pk=session.pk)
    page, more = selectors.messages_page(session_pk=session.pk, session=fresh, limit=3)
    assert [m.content for m in page] == ["m3", "m4 again", "a4 again"] and more
    older, more = selectors.messages_page(
        session_pk=session.pk, session=fresh, before_seq=page[0].seq, limit=3
    )
    assert [m.content for m in older] == ["m0", "m1", "m2"] and more
    first, more = selectors.messages_page(
        session_pk=session.pk, session=fresh, before_seq=older[0].seq, limit=3
    )
    assert [m.seq for m in first] == [1] and not more
    assert page[1].siblings == [seqs[4], fork]


@pytest.mark.django_db(transaction=True)
def test_clearing_history_starts_one_straight_branch_again(user):
    session = _dialog(user)
    _append(session, _msg("user", "q"), _msg("assistant", "a"))
    _append(session, _msg("user", "q2"), parent=1)
    services.messages_clear(session=session)
    cleared = Session.objects.get(pk=session.pk)
    assert (cleared.head_seq, cleared.forked, cleared.forks) == (0, False, {})
    (first,) = _append(session, _msg("user", "fresh start"))
    row = Message.objects.get(session_id=session.pk, seq=first)
    assert row.parent_seq is None
    assert not Session.objects.get(pk=session.pk).forked


@pytest.mark.django_db(transaction=True)
def test_a_regenerate_answers_the_user_message_past_the_tools(user):
    from chatcore.common.errors import BadRequest

    session = _dialog(user)
    call = {"id": "c1", "type": "function", "function": {"name": "x", "arguments": "{}"}}
    q, _call, _result, answer = _append(
        session,
        _msg("user", "use a tool"),
        services.NewMessage(role=Role.ASSISTANT, content="", kind="assistant", tool_calls=[call]),
        services.NewMessage(role=Role.TOOL, content="42", kind="tool_result", tool_call_id="c1"),
        _msg("assistant", "it is 42"),
    )
    target, answered = branch_services.regenerate_target(session, answer)
    assert (target.seq, answered) == (answer, q)
    # Without a seq: the active path's last answer.
    assert branch_services.regenerate_target(session, None)[0].seq == answer
    with pytest.raises(BadRequest):
        branch_services.regenerate_target(session, q)
