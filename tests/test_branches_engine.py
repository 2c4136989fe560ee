"""Edit, regenerate and branch on the engine (SPEC H1): every version kept, the model sees
the active path only, each turn queued and stopped like a send."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chatcore.common import publish
from chatcore.common.errors import BadRequest
from chatcore.engine import branching
from sessions_app import selectors
from sessions_app.models import Message, Session, Turn
from tests.engine_helpers import chat_group_of, history, make_dialog, send
from tests.fakemodel import Reply, user_texts
from tests.test_engine_turns import streamed, terminals

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


async def row(session: Session) -> Session:
    return await sync_to_async(Session.objects.get)(pk=session.pk)


async def page(session: Session) -> list[Message]:
    fresh = await row(session)
    messages, _more = await sync_to_async(selectors.messages_page)(
        session_pk=session.pk, session=fresh
    )
    return messages


async def answered(engine, session, rec, text: str) -> Any:
    ack = await send(engine, session, text)
    await terminals(rec, [ack.turn_id])
    return ack


async def test_edit_makes_a_sibling_and_the_model_sees_the_new_path(
    make_engine, fake_model, recorder, user
):
    # covers: H1
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="A1"), Reply(text="A2"), Reply(text="B1"))
    await answered(engine, session, rec, "first question")
    await answered(engine, session, rec, "second question")
    rows = await history(session)
    second = next(m for m in rows if m.content == "second question")
    before = await row(session)

    ack = await branching.edit(
        engine, session, owner=user, seq=second.seq, content="second, edited", channel="web"
    )
    assert ack.mode == "edit"
    done = await terminals(rec, [ack.turn_id])
    assert done[ack.turn_id]["status"] == "completed"

    request = fake_model.turn_requests()[-1]
    assert user_texts(request) == ["first question", "second, edited"]
    assert not any("A2" in str(m["content"]) for m in request.messages)

    after = await history(session)
    assert len(after) == len(rows) + 2  # nothing rewritten, two rows added
    edited = next(m for m in after if m.content == "second, edited")
    assert edited.parent_seq == second.parent_seq
    fresh = await row(session)
    assert fresh.forked and fresh.last_seq > before.last_seq
    shown = await page(session)
    assert [m.content for m in shown if m.role != "system"] == [
        "first question",
        "A1",
        "second, edited",
        "B1",
    ]
    versions = next(m for m in shown if m.seq == edited.seq)
    assert versions.siblings == [second.seq, edited.seq]


async def test_regenerate_answers_the_same_message_again_and_branch_switches_back(
    make_engine, fake_model, recorder, user
):
    # covers: H1
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="old answer"), Reply(text="new answer"), Reply(text="after"))
    await answered(engine, session, rec, "question")
    old = (await history(session))[-1]
    ack = await branching.regenerate(engine, session, owner=user, seq=None, channel="web")
    assert ack.mode == "regenerate"
    await terminals(rec, [ack.turn_id])
    request = fake_model.turn_requests()[-1]
    assert user_texts(request) == ["question"]
    assert not any(m["role"] == "assistant" for m in request.messages)
    new = (await history(session))[-1]
    assert new.content == "new answer" and new.parent_seq == old.parent_seq
    assert [m.content for m in await page(session)][-2:] == ["question", "new answer"]

    # Back to the first answer: the next send follows it, the new answer is kept aside.
    switched = await branching.branch(session, seq=old.seq)
    assert switched.head_seq == old.seq
    assert [m.content for m in await page(session)][-2:] == ["question", "old answer"]
    await answered(engine, session, rec, "follow-up")
    request = fake_model.turn_requests()[-1]
    texts = [str(m["content"]) for m in request.messages]
    assert any("old answer" in t for t in texts) and not any("new answer" in t for t in texts)
    shown = [m.content for m in await page(session)]
    assert shown[-4:] == ["question", "old answer", "follow-up", "after"]
    # Still every version stored.
    assert {"old answer", "new answer", "after"} <= {m.content for m in await history(session)}


async def test_bad_targets_are_refused_and_change_nothing(make_engine, fake_model, recorder, user):
    # covers: H1
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="an answer"))
    await answered(engine, session, rec, "question")
    rows = await history(session)
    user_msg = next(m for m in rows if m.role == "user")
    answer = rows[-1]
    before = await row(session)
    turns = await sync_to_async(Turn.objects.filter(session_id=session.pk).count)()
    with pytest.raises(BadRequest):
        await branching.edit(
            engine, session, owner=user, seq=answer.seq, content="x", channel="web"
        )
    with pytest.raises(BadRequest):
        await branching.regenerate(engine, session, owner=user, seq=user_msg.seq, channel="web")
    with pytest.raises(BadRequest):
        await branching.edit(engine, session, owner=user, seq=999, content="x", channel="web")
    with pytest.raises(BadRequest):
        await branching.branch(session, seq=999)
    with pytest.raises(BadRequest):
        await branching.edit(
            engine, session, owner=user, seq=user_msg.seq, content="  ", channel="web"
        )
    after = await row(session)
    assert (after.last_seq, after.head_seq, after.forked) == (
        before.last_seq,
        before.head_seq,
        before.forked,
    )
    assert await sync_to_async(Turn.objects.filter(session_id=session.pk).count)() == turns
    assert len(await history(session)) == len(rows)


async def test_an_edit_during_a_turn_waits_and_a_stop_keeps_its_branch_active(
    make_engine, fake_model, recorder, user
):
    # covers: H1, C1, C6
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    snaps = await recorder(publish.session_group(session.pk))
    fake_model.script(
        Reply(text="first answer"),
        Reply(text="slow answer", endless=True),
        Reply(text="edited partial", endless=True),
        Reply(text="retried answer"),
    )
    await answered(engine, session, rec, "one")
    first = next(m for m in await history(session) if m.content == "one")
    running = await send(engine, session, "two")
    await streamed(snaps, "slow")
    ack = await branching.edit(
        engine, session, owner=user, seq=first.seq, content="one, again", channel="web"
    )
    assert ack.position == 1  # behind the running turn, never interleaved
    await engine.stop(session)
    done = await terminals(rec, [running.turn_id, ack.turn_id])
    assert done[ack.turn_id]["reason"] == "dropped"

    # Edit again while idle: it starts, streams, and a stop leaves its branch active.
    ack = await branching.edit(
        engine, session, owner=user, seq=first.seq, content="one, third", channel="web"
    )
    await streamed(snaps, "edited")
    await engine.stop(session)
    await terminals(rec, [ack.turn_id])
    shown = await page(session)
    assert [m.content for m in shown if m.role == "user"] == ["one, third"]
    assert shown[-1].status == "cancelled"
    # Two versions of the first message: the original and the edit that ran (the dropped
    # edit never started, so it wrote none).
    third = next(m for m in shown if m.content == "one, third")
    assert third.siblings == [first.seq, third.seq]

    # Retry on the active path answers the edited message again.
    retry = await engine.retry(session, owner=user)
    await terminals(rec, [retry.turn_id])
    assert user_texts(fake_model.turn_requests()[-1]) == ["one, third"]
    assert (await page(session))[-1].content == "retried answer"


async def test_the_path_change_is_announced(make_engine, fake_model, recorder, user):
    # covers: H1, D2
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    fake_model.script(Reply(text="a"), Reply(text="b"))
    await answered(engine, session, rec, "q")
    old = (await history(session))[-1]
    ack = await branching.regenerate(engine, session, owner=user, seq=old.seq, channel="web")
    changed = (await rec.until(lambda f: f["type"] == "path_changed", 10))[-1]
    assert changed["session_id"] == session.session_id
    await terminals(rec, [ack.turn_id])
    await branching.branch(session, seq=old.seq)
    frames = await rec.until(
        lambda f: (
            f["type"] == "path_changed" and f["history_revision"] > changed["history_revision"]
        ),
        10,
    )
    assert frames[-1]["history_revision"] == (await row(session)).last_seq


async def test_two_edits_of_one_message_make_three_versions(
    make_engine, fake_model, recorder, user
):
    # covers: H1, C1
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session))
    await answered(engine, session, rec, "original")
    first = next(m for m in await history(session) if m.content == "original")
    one = await branching.edit(
        engine, session, owner=user, seq=first.seq, content="version two", channel="web"
    )
    two = await branching.edit(
        engine, session, owner=user, seq=first.seq, content="version three", channel="web"
    )
    done = await terminals(rec, [one.turn_id, two.turn_id])
    assert {d["status"] for d in done.values()} == {"completed"}
    shown = await page(session)
    assert [m.content for m in shown][1:] == ["version three", "echo: version three"]
    versions = [m.seq for m in await history(session) if m.parent_seq == first.parent_seq]
    assert len(versions) == 3 and shown[1].siblings == versions
    # Each answer followed its own version: the model never saw two versions at once.
    for request in fake_model.turn_requests()[-2:]:
        assert len(user_texts(request)) == 1
