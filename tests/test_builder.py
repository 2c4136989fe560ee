"""The input builder (`chatcore.engine.turns.builder`) on its own, against the real database:
what the model is sent for a dialog (C7, C8, E5)."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chatcore.engine.sessions import SessionStates
from chatcore.engine.turns.builder import RUNTIME_MARKER, RuntimeInfo, TurnInputBuilder
from chatcore.engine.turns.outcome import PendingMessage
from sessions_app import services, turn_services
from sessions_app.models import MessageKind, Role

pytestmark = [pytest.mark.django_db(transaction=True)]

PROMPT = "You are the test assistant."


def _dialog(user: Any) -> Any:
    return services.session_create(owner=user, channel="web", chat_id=f"u{user.pk}")


def _add(session: Any, *messages: services.NewMessage) -> None:
    services.messages_append(session_pk=session.pk, messages=list(messages))


def _user(text: str) -> services.NewMessage:
    return services.NewMessage(role=Role.USER, content=text, kind=MessageKind.USER_INPUT)


def _assistant(text: str, **kw: Any) -> services.NewMessage:
    return services.NewMessage(role=Role.ASSISTANT, content=text, kind=MessageKind.ASSISTANT, **kw)


def _builder(**kw: Any) -> TurnInputBuilder:
    return TurnInputBuilder(states=SessionStates(), system_prompt=PROMPT, skills_dir="/none", **kw)


def _runtime(session: Any) -> RuntimeInfo:
    return RuntimeInfo(channel="web", dialog_id=session.dialog_id, title=session.title)


async def test_history_in_order_behind_one_system_message_with_runtime_at_the_end(user):
    # covers: C7, C8
    session = await sync_to_async(_dialog)(user)
    await sync_to_async(_add)(session, _user("first"), _assistant("reply"), _user("second"))
    prepared = await _builder().prepare(session_pk=session.pk, runtime=_runtime(session))
    roles = [m["role"] for m in prepared.messages]
    assert roles == ["system", "user", "assistant", "user"]
    assert prepared.messages[0]["content"].startswith(PROMPT)
    # The welcome message never reaches the model; the runtime block is on the last user
    # message only, once.
    assert prepared.messages[1]["content"] == "first"
    assert prepared.messages[-1]["content"].startswith("second" + RUNTIME_MARKER)
    assert sum(str(m["content"]).count(RUNTIME_MARKER) for m in prepared.messages) == 1
    assert prepared.dropped_for_budget == 0 and prepared.estimated_tokens > 0


async def test_memory_notes_and_plan_go_into_the_system_message(user):
    # covers: C8
    session = await sync_to_async(_dialog)(user)
    await sync_to_async(_add)(session, _user("hi"))
    await sync_to_async(turn_services.memory_note_add)(owner_id=user.pk, content="likes tea")
    await sync_to_async(turn_services.session_plan_set)(session_pk=session.pk, plan="1. greet")
    prepared = await _builder().prepare(session_pk=session.pk, runtime=_runtime(session))
    system = prepared.messages[0]["content"]
    assert "- likes tea" in system and "1. greet" in system


async def test_a_tool_call_without_its_result_is_left_out(user):
    # covers: C8
    session = await sync_to_async(_dialog)(user)
    call = {"id": "c1", "type": "function", "function": {"name": "x", "arguments": "{}"}}
    await sync_to_async(_add)(
        session, _user("use a tool"), _assistant("", tool_calls=[call]), _user("again")
    )
    prepared = await _builder().prepare(session_pk=session.pk, runtime=_runtime(session))
    assert not any(m.get("tool_calls") for m in prepared.messages)
    assert [m["role"] for m in prepared.messages] == ["system", "user", "user"]


async def test_an_earlier_turns_long_tool_result_is_trimmed_and_this_turns_is_not(user):
    # covers: C8 (oversized tool results of earlier turns are trimmed in the model input
    # only; the stored message and the turn's own results stay whole)
    from django.conf import settings

    from chatcore.engine.turns.builder import TRIMMED_NOTE
    from sessions_app.models import Message

    limit = settings.CHAT["TOOL_RESULT_TRIM_CHARS"]
    session = await sync_to_async(_dialog)(user)
    call = {"id": "c1", "type": "function", "function": {"name": "x", "arguments": "{}"}}
    result = services.NewMessage(
        role=Role.TOOL,
        content="r" * (limit + 500),
        kind=MessageKind.TOOL_RESULT,
        tool_call_id="c1",
        tool_name="x",
    )
    await sync_to_async(_add)(
        session, _user("use a tool"), _assistant("", tool_calls=[call]), result, _assistant("ok")
    )
    now = {"id": "c2", "type": "function", "function": {"name": "x", "arguments": "{}"}}
    pending = [
        PendingMessage(role="assistant", content="", kind="assistant", tool_calls=[now]),
        PendingMessage(
            role="tool", content="s" * (limit + 500), kind="tool_result", tool_call_id="c2"
        ),
    ]
    prepared = await _builder().prepare(
        session_pk=session.pk, runtime=_runtime(session), pending=pending
    )
    tools = [m for m in prepared.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tools] == ["c1", "c2"]
    assert tools[0]["content"] == "r" * limit + TRIMMED_NOTE
    assert tools[1]["content"] == "s" * (limit + 500)
    stored = await sync_to_async(Message.objects.get)(session=session, role=Role.TOOL)
    assert len(stored.content) == limit + 500
    # Without a tool anywhere, every message goes as it is stored.
    plain = await sync_to_async(_dialog)(user)
    await sync_to_async(_add)(plain, _user("q" * (limit + 500)), _assistant("a" * (limit + 500)))
    again = await _builder().prepare(session_pk=plain.pk, runtime=_runtime(plain))
    assert [m["role"] for m in again.messages] == ["system", "user", "assistant"]
    assert again.messages[1]["content"].startswith("q" * (limit + 500) + RUNTIME_MARKER)
    assert again.messages[2]["content"] == "a" * (limit + 500)


async def test_oldest_messages_leave_first_when_over_budget(user):
    # covers: C7
    session = await sync_to_async(_dialog)(user)
    words = " ".join(["word"] * 300)
    await sync_to_async(_add)(
        session, *[_user(f"old {i} {words}") for i in range(6)], _user("the newest")
    )
    prepared = await _builder(context_window=2000).prepare(
        session_pk=session.pk, runtime=_runtime(session)
    )
    contents = [str(m["content"]) for m in prepared.messages[1:]]
    assert prepared.dropped_for_budget > 0
    assert contents[-1].startswith("the newest")
    assert not any(c.startswith("old 0 ") for c in contents)


async def test_pending_messages_of_the_turn_follow_history(user):
    # covers: C4, E5
    session = await sync_to_async(_dialog)(user)
    await sync_to_async(_add)(session, _user("question"))
    lead = [PendingMessage(role=Role.USER, content="go on", kind="continue")]
    prepared = await _builder().prepare(
        session_pk=session.pk, runtime=_runtime(session), pending=lead
    )
    assert prepared.messages[-2]["content"] == "question"
    assert prepared.messages[-1]["content"].startswith("go on" + RUNTIME_MARKER)


async def test_every_turn_of_a_long_dialog_is_sent_what_a_fresh_process_would_send(user):
    # covers: A5, C7, C8, E5
    # A process keeps a dialog's loaded messages and what each gives the model from turn to
    # turn; what it sends must never drift from a build that starts from the database: the
    # runtime block moves to the new last user message, a continuation stays joined to its
    # answer, an old tool result stays trimmed, and nothing added to one turn's input sticks.
    session = await sync_to_async(_dialog)(user)
    kept = _builder()
    call = {"id": "c1", "type": "function", "function": {"name": "x", "arguments": "{}"}}
    rounds: list[list[services.NewMessage]] = [
        [_user("first"), _assistant("an answer cut sh", status="interrupted")],
        [_user("use a tool"), _assistant("", tool_calls=[call])],
        [
            services.NewMessage(
                role=Role.TOOL,
                content="r" * 5000,
                kind=MessageKind.TOOL_RESULT,
                tool_call_id="c1",
                tool_name="x",
            ),
            _assistant("the tool said r"),
        ],
        [_user("third"), _assistant("")],
    ]

    def add(messages: list[services.NewMessage]) -> None:
        appended = services.messages_append(session_pk=session.pk, messages=messages)
        if messages[0].content == "first":
            cut = appended.messages[-1]
            services.messages_append(
                session_pk=session.pk,
                messages=[_assistant("ort, and its rest", source={"continues": str(cut.pk)})],
            )

    for added in rounds:
        await sync_to_async(add)(added)
        await sync_to_async(_add)(session, _user(f"after {len(added)}"))
        sent = await kept.prepare(session_pk=session.pk, runtime=_runtime(session))
        fresh = await _builder().prepare(session_pk=session.pk, runtime=_runtime(session))
        assert sent.messages == fresh.messages
        assert sent.estimated_tokens == fresh.estimated_tokens
        assert sum(str(m["content"]).count(RUNTIME_MARKER) for m in sent.messages) == 1
        assert sent.messages[-1]["content"].startswith(f"after {len(added)}" + RUNTIME_MARKER)
    contents = [m["content"] for m in sent.messages]
    assert "an answer cut short, and its rest" in contents
    assert "" not in contents  # E5: the empty answer is never replayed
    tool = next(m for m in sent.messages if m["role"] == "tool")
    assert len(tool["content"]) < 5000 and tool["content"].startswith("r" * 4000)


async def test_the_request_body_is_the_windows_join_plus_what_a_step_appends(user, monkeypatch):
    # covers: F7 (the event loop does not serialise the dialog's history for each request)
    import json

    from chatcore.engine.provider_types import EncodedMessage, encode_body

    session = await sync_to_async(_dialog)(user)
    for i in range(5):
        await sync_to_async(_add)(session, _user(f'q{i} ü "x"'), _assistant(f"a{i}"))
    prepared = await _builder().prepare(session_pk=session.pk, runtime=_runtime(session))
    window = [dict(m) for m in prepared.messages]

    # A request of the window takes its join as it is: no message is encoded again.
    encoded = EncodedMessage.encoded
    calls = []

    def counting(self: EncodedMessage) -> bytes:
        calls.append(self)
        return encoded(self)

    monkeypatch.setattr(EncodedMessage, "encoded", counting)
    messages = prepared.messages.copy()
    body = encode_body({"model": "m", "messages": messages, "stream": True})
    assert calls == []
    assert json.loads(body) == {"model": "m", "messages": window, "stream": True}

    # A tool step appends its call and result: only those are encoded.
    step = [{"role": "assistant", "content": None, "tool_calls": []}, {"role": "tool"}]
    messages.extend(step)
    assert json.loads(encode_body({"messages": messages}))["messages"] == window + step

    # Anything else drops the join, and the body still says what the list holds.
    messages[1] = {"role": "user", "content": "replaced"}
    expected = [window[0], {"role": "user", "content": "replaced"}, *window[2:], *step]
    assert json.loads(encode_body({"messages": messages}))["messages"] == expected
    del messages[0]
    assert json.loads(encode_body({"messages": messages}))["messages"] == expected[1:]


def _tool_round(call_id: str) -> list[services.NewMessage]:
    """An assistant's tool call and the tool's result."""
    call = {"id": call_id, "type": "function", "function": {"name": "x", "arguments": "{}"}}
    return [
        _assistant("", tool_calls=[call]),
        services.NewMessage(
            role=Role.TOOL, content="ok", kind=MessageKind.TOOL_RESULT, tool_call_id=call_id
        ),
    ]


def _cut_then_continued(session: Any) -> services.NewMessage:
    """A cut answer stored in `session`, and the answer that continues it (E5), to store."""
    cut = services.messages_append(
        session_pk=session.pk, messages=[_assistant("cut sh", status="interrupted")]
    )
    return _assistant("ort", source={"continues": str(cut.messages[-1].pk)})


def _counted_walks(monkeypatch: Any) -> list[int]:
    """The length of the history each build walks in full from now on, in order."""
    from chatcore.engine.turns import builder as builder_module

    walks: list[int] = []
    walk = builder_module.TurnInputBuilder._walk

    def counted(self: Any, history: Any, *args: Any) -> Any:
        walks.append(len(history))
        return walk(self, history, *args)

    monkeypatch.setattr(builder_module.TurnInputBuilder, "_walk", counted)
    return walks


async def _built_as_fresh(kept: TurnInputBuilder, session: Any, context_window: int) -> Any:
    """`kept`'s build of the dialog's next turn, checked against a fresh builder's: the same
    messages, token estimate, count of what was left out, and request body, byte for byte
    (the kept builder's walk, if any, is counted first)."""
    from chatcore.engine.provider_types import encode_body

    sent = await kept.prepare(session_pk=session.pk, runtime=_runtime(session))
    fresh = await _builder(context_window=context_window).prepare(
        session_pk=session.pk, runtime=_runtime(session)
    )
    assert sent.messages == fresh.messages
    assert (sent.estimated_tokens, sent.dropped_for_budget) == (
        fresh.estimated_tokens,
        fresh.dropped_for_budget,
    )
    payload = {"model": "m", "stream": True}
    assert encode_body({**payload, "messages": sent.messages}) == encode_body(
        {**payload, "messages": list(fresh.messages)}
    )
    assert sent.messages[-1]["content"].count(RUNTIME_MARKER) == 1
    return sent


async def test_a_turns_build_goes_on_from_the_last_and_sends_what_a_fresh_build_sends(
    user, monkeypatch
):
    # covers: C7, C8, E5, F7 (STYLE 18: a turn's first build walks, counts and joins only
    # what was appended since the dialog's last one; past the budget the window moves on; a
    # continuation, a tool's messages and a new note each make it walk again; and whatever
    # path it took, the request body is byte for byte a fresh build's)
    walks = _counted_walks(monkeypatch)
    session = await sync_to_async(_dialog)(user)
    # A window small enough for the dialog to outgrow it: the oldest messages drop out.
    kept = _builder(context_window=600)
    went_on = 0
    for turn in range(40):
        await sync_to_async(_add)(session, _user(f"question {turn} " + "q" * (turn % 7) * 20))
        walks.clear()
        sent = await _built_as_fresh(kept, session, 600)
        # The kept builder's own walk is the first one counted; a fresh one always walks.
        went_on += len(walks) == 1
        answer = _assistant(f"answer {turn} " + "a" * 90)
        if turn == 12:
            answer = await sync_to_async(_cut_then_continued)(session)
        elif turn == 20:
            await sync_to_async(_add)(session, *_tool_round("c9"))
        elif turn == 25:
            answer = _assistant("")  # E5: an empty answer is never replayed
        elif turn == 30:
            await sync_to_async(turn_services.memory_note_add)(owner_id=user.pk, content="tea")
        await sync_to_async(_add)(session, answer)
    assert sent.dropped_for_budget > 0  # the window did move on
    # Every turn went on from the last build but the first and those right after the
    # continuation, the tool's messages and the note.
    assert went_on >= 34, went_on


async def test_a_dialog_longer_than_its_read_window_still_goes_on_from_the_last_build(
    user, monkeypatch
):
    # covers: C7, E5, F7 (STYLE 18: once a dialog is longer than the read window, that
    # window's start moves on with every turn; the build still goes on from the last one, a
    # continuation or a tool's call left behind by that start makes it walk once, and the
    # request body and what it says was left out are a fresh build's)
    walks = _counted_walks(monkeypatch)
    session = await sync_to_async(_dialog)(user)
    # 600 tokens: a read window of 9,600 characters, about fifteen of these turns.
    kept = _builder(context_window=600)
    went_on, read = 0, []
    for turn in range(48):
        await sync_to_async(_add)(session, _user(f"question {turn} " + "q" * (turn % 5) * 30))
        walks.clear()
        await _built_as_fresh(kept, session, 600)
        # The kept builder's own walk is the first one counted; a fresh one always walks.
        went_on += len(walks) == 1
        read.append(walks[-1])
        answer = _assistant(f"answer {turn} " + "a" * 560)
        if turn == 4:
            answer = await sync_to_async(_cut_then_continued)(session)
        elif turn == 9:
            await sync_to_async(_add)(session, *_tool_round("c7"))
        await sync_to_async(_add)(session, answer)
    stored = await sync_to_async(lambda: type(session).objects.get(pk=session.pk).last_seq)()
    # The read window did move on: the last builds read far fewer messages than stored, and
    # about as many as some turns before.
    assert read[-1] < stored / 2 and abs(read[-1] - read[-10]) <= 2, (read, stored)
    # Every build went on from the last but the first, the one right after the continuation
    # and the tool's messages, and one each time the window's start passed those.
    assert went_on >= 43, went_on


async def test_what_builds_carry_for_the_next_stays_within_its_bytes(user):
    # covers: A6, F7 (the carried builds hold the messages' JSON the history cache may have
    # let go: the least recently built dialog goes first once they pass their bound)
    first, second = await sync_to_async(_dialog)(user), await sync_to_async(_dialog)(user)
    kept = _builder()
    for session in (first, second):
        await sync_to_async(_add)(session, _user("x" * 3000), _assistant("y" * 3000))
    await kept.prepare(session_pk=first.pk, runtime=_runtime(first))
    held = kept.carried.get(first.pk)
    assert held is not None and held.window.size > 6000
    kept.carried.max_bytes = held.window.size + 100
    await kept.prepare(session_pk=second.pk, runtime=_runtime(second))
    assert kept.carried.get(first.pk) is None
    assert kept.carried.get(second.pk) is not None
    # A dialog whose carried build is gone is built from its messages, as before.
    again = await kept.prepare(session_pk=first.pk, runtime=_runtime(first))
    fresh = await _builder().prepare(session_pk=first.pk, runtime=_runtime(first))
    assert again.messages == fresh.messages
