"""Fairness: one user never degrades the others (SPEC F7), through the real engine, the real
ASGI application and REST API, and the fake model server counting concurrent calls per user.

- the model input of a long dialog is built off the event loop, counting each message once;
- at most CHAT["USER_RUNNING_TURNS"] running turns per user (also across processes), the rest
  waiting in order; a process-wide bound on model calls;
- budgets: retry and /compact on the send rate, other writes on a second budget, open sockets
  per user, history pages bounded in bytes;
- the history cache's byte budget (LRU, after the last compaction) and the turn deadline.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import override_settings

from chatcore.engine import runtime
from chatcore.engine.sessions import SessionStates
from chatcore.engine.tokens import TokenCache, TokenCounter, counter_for_model, heuristic_count
from chatcore.engine.turns.builder import RuntimeInfo, TurnInputBuilder
from sessions_app import services
from sessions_app.models import Compaction, Message, MessageKind, Session, Turn, TurnStatus
from tests.engine_helpers import chat_group_of, make_dialog, send
from tests.fakemodel import Reply, strip_runtime
from tests.ws_helpers import WS, bearer, open_ws

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


def chat_cfg(**changes: Any) -> Any:
    return override_settings(CHAT={**settings.CHAT, **changes})


def fill_history(session: Session, n: int, *, size: int = 300, big_every: int = 0) -> int:
    """Append n stored messages (user/assistant alternating; every `big_every`-th a 60,000
    character inject) straight to the table, as a long-lived dialog would have them."""
    start = Session.objects.get(pk=session.pk).last_seq
    rows = []
    for i in range(1, n + 1):
        user_turn = i % 2 == 1
        if big_every and i % big_every == 0:
            content, kind = "inject " * 8570, MessageKind.INJECT
        else:
            content = f"message {i} " + "lorem ipsum " * (size // 12)
            kind = MessageKind.USER_INPUT if user_turn else MessageKind.ASSISTANT
        rows.append(
            Message(
                session_id=session.pk,
                seq=start + i,
                # One straight branch (H1): each message follows the one before it.
                parent_seq=(start + i - 1) or None,
                role="user" if user_turn or kind == MessageKind.INJECT else "assistant",
                content=content,
                source={"kind": kind},
            )
        )
    Message.objects.bulk_create(rows, batch_size=2000)
    Session.objects.filter(pk=session.pk).update(
        last_seq=start + n, head_seq=start + n, total_message_count=start + n
    )
    return start + n


def last_user(body: dict[str, Any]) -> str:
    users = [m for m in body["messages"] if m["role"] == "user"]
    return strip_runtime(users[-1]["content"]) if users else ""


async def ws_connect(user: Any) -> WS:
    ws, connected = await open_ws(await bearer(user))
    assert connected
    assert (await ws.next())["type"] == "sessions"
    assert (await ws.next())["type"] == "session_history"
    return ws


async def terminals(rec: Any, turn_ids: list[str], timeout: float = 60.0) -> dict[str, Any]:
    wanted = set(turn_ids)
    done: dict[str, Any] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while wanted - set(done):
        frame = await rec.next(max(0.05, deadline - loop.time()))
        if frame["type"] == "turn_updated" and frame["turn_id"] in wanted:
            done[frame["turn_id"]] = frame
    return done


# --- Item 1: long dialogs are built off the loop, counting each message once ---------------


async def test_trimming_counts_each_message_once(user: Any) -> None:
    # covers: F7, C7 (linear trimming; counts kept by message id)
    session = await make_dialog(user)
    await sync_to_async(fill_history)(session, 3000)
    counter = TokenCounter("heuristic", heuristic_count)
    builder = TurnInputBuilder(
        states=SessionStates(), context_window=32768, counter=counter, token_cache=TokenCache(10**6)
    )
    runtime_info = RuntimeInfo(channel="web", dialog_id="default", title="t")
    prepared = await builder.prepare(session_pk=session.pk, runtime=runtime_info)
    budget = int(32768 * settings.CHAT["COMPACTION_BUDGET_RATIO"])
    assert prepared.dropped_for_budget > 2000
    assert prepared.estimated_tokens <= budget
    kept = len(prepared.messages)
    # The head, each kept message, the one that no longer fit, the runtime block: a
    # quadratic trim would count ~N^2/2 messages here.
    assert counter.calls <= kept + 2
    # The estimate is the sum of what was sent (within rounding of the runtime block).
    recount = sum(
        TokenCounter("check", heuristic_count).count_message(m) for m in prepared.messages
    )
    assert abs(recount - prepared.estimated_tokens) <= 2
    # The newest messages are kept, the oldest dropped.
    assert prepared.messages[-1]["content"].startswith("message 3000 ")

    # One more message: only it is new; everything else comes from the cache.
    await sync_to_async(services.messages_append)(
        session_pk=session.pk,
        messages=[services.NewMessage(role="user", content="and one more", kind="user_input")],
        publish_delta=False,
    )
    before = counter.calls
    again = await builder.prepare(session_pk=session.pk, runtime=runtime_info)
    # The new message and the runtime block: the system prompt's count is kept.
    assert counter.calls - before <= 2
    assert strip_runtime(again.messages[-1]["content"]) == "and one more"

    # Without trimming, every message is counted exactly once too.
    wide = TokenCounter("wide", heuristic_count)
    whole = TurnInputBuilder(
        states=SessionStates(), context_window=10**9, counter=wide, token_cache=TokenCache(10**6)
    )
    full = await whole.prepare(session_pk=session.pk, runtime=runtime_info)
    assert full.dropped_for_budget == 0
    assert wide.calls == len(full.messages) + 1  # + the runtime block


def test_a_long_dialog_is_read_through_a_window_bounded_by_the_model(user: Any) -> None:
    # covers: F7 (rows read for a model input are bounded by the model's window, not the
    # dialog's length; what lies outside counts as dropped, so compaction is asked for)
    from sessions_app import selectors

    session = services.session_create(
        owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id="window"
    )
    last = fill_history(session, 10, size=96)  # ~100 characters each

    def window(max_chars: int) -> int:
        return selectors.turn_context(
            session_pk=session.pk, owner_id=user.pk, max_chars=max_chars
        ).window_start

    # The newest two hold 213 characters, the newest three 319.
    assert window(250) == last - 3  # the newest three: two within the bound, the boundary one
    assert window(10**9) == 0
    # After a compaction the window never reaches back before it.
    Compaction.objects.create(session=session, through_seq=last - 1, summary="compacted")
    assert window(1) == last - 1


async def test_the_builder_reads_only_the_window_and_counts_the_rest_as_dropped(
    user: Any,
) -> None:
    # covers: F7, C7
    from django.db.backends.utils import CursorWrapper

    session = await make_dialog(user)
    last = await sync_to_async(fill_history)(session, 4000)
    states = SessionStates()
    builder = TurnInputBuilder(states=states, context_window=4096)
    runtime_info = RuntimeInfo(channel="web", dialog_id="default", title="t")
    statements: list[str] = []
    real = CursorWrapper._execute

    def recorded(self: Any, sql: str, *args: Any) -> Any:
        if not sql.startswith(("BEGIN", "COMMIT")):  # a read transaction's own
            statements.append(sql)
        return real(self, sql, *args)

    CursorWrapper._execute = recorded  # type: ignore[method-assign]
    try:
        prepared = await builder.prepare(session_pk=session.pk, runtime=runtime_info)
        read_first = list(statements)
        statements.clear()
        again = await builder.prepare(session_pk=session.pk, runtime=runtime_info)
    finally:
        CursorWrapper._execute = real  # type: ignore[method-assign]
    # The dialog's row, the context with what the window leaves out counted in the same
    # statement, then the window's messages; once they are cached, only the first two.
    assert len(read_first) == 3, read_first
    assert len(statements) == 2, statements
    assert again.dropped_for_budget == prepared.dropped_for_budget
    # 4096 tokens x 16 characters: a few hundred of the 4000 messages were read and cached,
    # not all (about 1.4 KB each as the cache counts them).
    assert 0 < states.size < 500 * 1500
    kept = len(prepared.messages) - 1  # the system prompt
    # Every stored message is either sent or counted as left out (the old welcome among them).
    assert kept + prepared.dropped_for_budget == last
    assert prepared.messages[-1]["content"].startswith(f"message {last - 1} ") or prepared.messages[
        -1
    ]["content"].startswith(f"message {last - 2} ")


def test_the_bpe_counter_knows_openai_models_and_falls_back_otherwise() -> None:
    # covers: C7 (a real tokenizer where one ships offline; the heuristic elsewhere)
    bpe = counter_for_model("gpt-4o-mini")
    assert bpe.name.startswith("bpe:")
    assert bpe.count_text("hello world") == 2
    assert bpe.count_text("x" * 100_000) > 0  # long texts are counted in slices
    assert counter_for_model("openai/gpt-4o-mini").name == bpe.name
    other = counter_for_model("llama-3-some-local-model")
    assert other.name == "heuristic"
    assert other.count_text("abcdefgh") == 2 and other.count_text("你好") == 2
    # CJK (symbols and punctuation through unified ideographs) and Hangul: a token each;
    # the rest four characters a token; just outside those ranges counts as the rest.
    assert heuristic_count("한국어 텍스트, 日本語「テスト」。 and some words") == 15 + 18 // 4
    assert heuristic_count("\u3000\u9fff\uac00\ud7af") == 4
    assert heuristic_count("\u2fff\ua000\ud7b0\uabff") == 1


async def test_sessions_answered_while_another_users_long_dialog_is_built(
    make_engine: Any, fake_model: Any, user: Any, other_user: Any
) -> None:
    # covers: F7 (the event loop and the ORM thread stay free while a long dialog is built)
    # A model with a large window: the build reads and trims thousands of messages.
    with override_settings(LLM={**settings.LLM, "CONTEXT_WINDOW": 200_000}):
        engine = await make_engine()
    runtime.set_engine(engine)
    try:
        session = await make_dialog(user)
        await sync_to_async(fill_history)(session, 12_000, big_every=600)
        alice = await ws_connect(user)
        bob = await ws_connect(other_user)
        await alice.send({"type": "send", "content": "one more question", "client_msg_id": "a1"})
        # The user message enters history when the turn starts; the input build follows.
        await alice.until(
            lambda f: (
                f["type"] == "history_delta"
                and any(m["content"] == "one more question" for m in f["messages"])
            ),
            timeout=30,
        )
        for i in range(3):
            answer = await bob.ask({"type": "sessions", "client_msg_id": f"s{i}"})
            assert answer["type"] == "sessions"
            # Answered before the long build reached the model.
            assert fake_model.turn_requests() == [], f"round trip {i} waited for the build"
        done = await alice.until(lambda f: f["type"] == "turn_updated", timeout=120)
        assert done[-1]["status"] == "completed"
        sent = fake_model.turn_requests()[0].messages
        assert 1000 < len(sent) < 12_000  # thousands of messages, trimmed to the budget
        await alice.close()
        await bob.close()
    finally:
        runtime.set_engine(None)


# --- Item 2: running turns per user, model calls per process --------------------------------


def _gated_for(prefix: str, gate: threading.Event) -> Any:
    def reply(body: dict[str, Any]) -> Reply:
        text = last_user(body)
        return Reply(text=f"ok {text}", gate=gate if text.startswith(prefix) else None)

    return reply


async def test_one_user_runs_at_most_four_turns_and_others_still_start(
    make_engine: Any, fake_model: Any, recorder: Any, user: Any, other_user: Any
) -> None:
    # covers: F7 (4 running turns per user; the rest wait in order, never refused)
    gates = {f"A{i}": threading.Event() for i in range(10)}

    def reply(body: dict[str, Any]) -> Reply:
        text = last_user(body)
        return Reply(text=f"ok {text}", gate=gates.get(text))

    fake_model.default = reply
    fake_model.key_of = lambda body: last_user(body)[:1]
    engine = await make_engine()
    dialogs = [await make_dialog(user, f"a{i}") for i in range(10)]
    rec = await recorder(chat_group_of(dialogs[0]))
    acks = [await send(engine, d, f"A{i}") for i, d in enumerate(dialogs)]
    assert all(a.turn_id for a in acks)  # none refused
    await fake_model.requests_made(4)

    # Another user's turn starts and ends while six of the first user's sends wait.
    other = await make_dialog(other_user, "b0")
    other_rec = await recorder(chat_group_of(other))
    ack_b = await send(engine, other, "B0")
    done_b = await terminals(other_rec, [ack_b.turn_id])
    assert done_b[ack_b.turn_id]["status"] == "completed"
    started = [last_user(r.body) for r in fake_model.requests]
    assert sorted(started) == ["A0", "A1", "A2", "A3", "B0"]

    def statuses() -> list[str]:
        return list(Turn.objects.filter(owner=user).values_list("status", flat=True))

    now = await sync_to_async(statuses)()
    assert now.count(TurnStatus.RUNNING) == 4 and now.count(TurnStatus.QUEUED) == 6

    # Each answer that ends frees one slot, and the oldest waiting dialog takes it.
    for k in range(6):
        gates[f"A{k}"].set()
        await fake_model.requests_made(6 + k)
        assert last_user(fake_model.requests[-1].body) == f"A{k + 4}"
    for gate in gates.values():
        gate.set()
    done = await terminals(rec, [a.turn_id for a in acks])
    assert all(f["status"] == "completed" for f in done.values())
    assert fake_model.max_active_by_key["A"] == 4
    assert len(fake_model.requests) == 11


async def test_a_slow_history_read_in_one_dialog_does_not_hold_up_a_stop_in_another(
    make_engine: Any, fake_model: Any, user: Any, other_user: Any, monkeypatch: Any
) -> None:
    # covers: F7, G6, C6 (database calls of independent dialogs run on separate threads)
    from sessions_app import ws_events

    model_gate = threading.Event()
    fake_model.default = lambda body: Reply(text="a long answer", chunk=2, gate=model_gate)
    engine = await make_engine()
    runtime.set_engine(engine)
    entered, release = threading.Event(), threading.Event()
    real_history = ws_events.session_history_frame
    slow_dialog: list[str] = []

    def slow_history(**kwargs: Any) -> dict[str, Any]:
        if kwargs["session"].pk in slow_dialog:
            entered.set()
            release.wait(60)  # the read hangs until the test lets it go
        return real_history(**kwargs)

    try:
        alice = await ws_connect(user)
        bob = await ws_connect(other_user)
        await bob.send({"type": "send", "content": "talk for a while", "client_msg_id": "b1"})
        await bob.until(lambda f: f["type"] == "turn_snapshot", timeout=30)

        slow_dialog.append((await make_dialog(user, "slow")).pk)
        monkeypatch.setattr(ws_events, "session_history_frame", slow_history)
        await alice.send({"type": "history", "dialog_id": "slow", "client_msg_id": "h1"})
        assert await asyncio.to_thread(entered.wait, 10), "the history read did not start"

        # Bob's stop goes through while Alice's read still holds its database thread.
        await bob.send({"type": "stop", "client_msg_id": "stop-1"})
        frames = await bob.until(lambda f: f["type"] == "turn_updated", timeout=30)
        assert frames[-1]["status"] == "cancelled" and frames[-1]["reason"] == "stopped"
        assert not release.is_set()

        release.set()
        page = await alice.until(lambda f: f.get("client_msg_id") == "h1", timeout=30)
        assert page[-1]["type"] == "session_history"
        await alice.close()
        await bob.close()
    finally:
        release.set()
        model_gate.set()
        runtime.set_engine(None)


async def test_the_running_turn_cap_holds_across_processes(
    make_engine: Any, fake_model: Any, recorder: Any, user: Any
) -> None:
    # covers: F7, G1 (the cap is counted in the database; waiting dialogs are started by
    # whichever process ends a turn)
    gate = threading.Event()
    fake_model.default = _gated_for("A", gate)
    fake_model.key_of = lambda body: last_user(body)[:1]
    with chat_cfg(USER_RUNNING_TURNS=2):
        first = await make_engine(name="proc-1")
        second = await make_engine(name="proc-2")
    dialogs = [await make_dialog(user, f"x{i}") for i in range(6)]
    rec = await recorder(chat_group_of(dialogs[0]))
    acks = []
    for i, d in enumerate(dialogs):
        acks.append(await send(first if i % 2 == 0 else second, d, f"A{i}"))
    await fake_model.requests_made(2)
    await asyncio.sleep(0.5)  # room for a third call, if the cap leaked
    assert len(fake_model.requests) == 2
    gate.set()
    done = await terminals(rec, [a.turn_id for a in acks])
    assert all(f["status"] == "completed" for f in done.values())
    assert fake_model.max_active_by_key["A"] == 2
    assert len(fake_model.requests) == 6


async def test_a_held_back_dialog_starts_as_soon_as_its_owners_turn_ends(
    make_engine: Any, fake_model: Any, recorder: Any, user: Any
) -> None:
    # covers: F7 (the end of a turn starts the party's dialog waiting for a slot; the sweep,
    # minutes away here, plays no part)
    gate = threading.Event()
    fake_model.default = _gated_for("first", gate)
    with chat_cfg(USER_RUNNING_TURNS=1, LEASE_SECONDS=600, CHECKPOINT_SECONDS=600):
        engine = await make_engine()
    one, two = await make_dialog(user, "one"), await make_dialog(user, "two")
    await asyncio.sleep(0.5)  # the engine's first sweep runs at start; let it pass
    rec = await recorder(chat_group_of(one))
    first = await send(engine, one, "first")
    await fake_model.requests_made(1)
    second = await send(engine, two, "second")
    await asyncio.sleep(0.3)  # room for its turn to start, if the cap leaked
    held = await sync_to_async(Turn.objects.get)(pk=second.turn_id)
    assert held.status == TurnStatus.QUEUED and len(fake_model.requests) == 1
    gate.set()
    done = await terminals(rec, [first.turn_id, second.turn_id], timeout=20)
    assert [done[t]["status"] for t in (first.turn_id, second.turn_id)] == ["completed"] * 2


async def test_on_an_external_platform_each_chat_has_its_own_slots(
    make_engine: Any, fake_model: Any, recorder: Any, user: Any
) -> None:
    # covers: F7, A1 (a platform account owns every chat of its bot: the cap is per chat)
    gate = threading.Event()
    fake_model.default = lambda body: Reply(text="ok", gate=gate)
    with chat_cfg(USER_RUNNING_TURNS=1):
        engine = await make_engine()

    def external(chat_id: str, dialog_id: str) -> Session:
        return services.session_create(
            owner=user, channel="telegram", chat_id=chat_id, dialog_id=dialog_id
        )

    one = await sync_to_async(external)("1001", "default")
    two = await sync_to_async(external)("1002", "default")
    one_more = await sync_to_async(external)("1001", "other")
    recs = [await recorder(chat_group_of(s)) for s in (one, two)]
    acks = [await send(engine, s, f"hi {i}") for i, s in enumerate((one, two, one_more))]
    await fake_model.requests_made(2)  # both chats run at once
    await asyncio.sleep(0.3)  # room for a third call, if chat 1001's cap leaked
    assert len(fake_model.requests) == 2
    held = await sync_to_async(Turn.objects.get)(pk=acks[2].turn_id)
    assert held.status == TurnStatus.QUEUED
    gate.set()
    done = await terminals(recs[0], [acks[0].turn_id, acks[2].turn_id])
    done.update(await terminals(recs[1], [acks[1].turn_id]))
    assert all(f["status"] == "completed" for f in done.values())


async def test_a_held_back_dialog_is_started_by_the_sweep(
    make_engine: Any, fake_model: Any, recorder: Any, user: Any
) -> None:
    # covers: F7, C11 (the process whose turn ended cannot start the waiting dialog: it is
    # shutting down; another process's sweep does)
    gate = threading.Event()
    fake_model.default = _gated_for("A0", gate)
    with chat_cfg(USER_RUNNING_TURNS=1, LEASE_SECONDS=3):
        first = await make_engine(name="proc-1")
        second = await make_engine(name="proc-2")
    d0, d1 = [await make_dialog(user, f"s{i}") for i in range(2)]
    rec = await recorder(chat_group_of(d0))
    a0 = await send(first, d0, "A0")
    await fake_model.requests_made(1)
    a1 = await send(second, d1, "A1")
    await asyncio.sleep(0.3)  # room for a second call, if the cap leaked
    assert len(fake_model.requests) == 1
    queued = await sync_to_async(Turn.objects.get)(pk=a1.turn_id)
    assert queued.status == TurnStatus.QUEUED
    await first.shutdown(grace=2)
    done = await terminals(rec, [a0.turn_id, a1.turn_id], timeout=30)
    assert done[a0.turn_id]["status"] == "failed"
    assert done[a1.turn_id]["status"] == "completed"


async def test_model_calls_of_a_process_are_bounded(
    make_engine: Any, fake_model: Any, recorder: Any, make_user: Any
) -> None:
    # covers: F7 (above the bound a turn waits for a slot, never on the HTTP pool)
    gate = threading.Event()
    fake_model.default = lambda body: Reply(text="ok", gate=gate)
    with chat_cfg(MODEL_CALLS_MAX=2):
        engine = await make_engine()
    users = [await sync_to_async(make_user)() for _ in range(3)]
    dialogs = [await make_dialog(u) for u in users]
    recs = [await recorder(chat_group_of(d)) for d in dialogs]
    acks = [await send(engine, d, f"hello {i}") for i, d in enumerate(dialogs)]
    await fake_model.requests_made(2)
    await asyncio.sleep(0.5)  # room for a third call, if the bound leaked
    seen = [
        (r.messages[-1]["content"], r.aborted.is_set(), r.finished.is_set())
        for r in fake_model.requests
    ]
    assert len(seen) == 2, seen  # (what it asked, whether the client left, whether it ended)
    gate.set()
    for rec, ack in zip(recs, acks, strict=True):
        done = await terminals(rec, [ack.turn_id])
        assert done[ack.turn_id]["status"] == "completed"
    assert fake_model.max_active == 2


def test_the_provider_client_does_not_cap_connections() -> None:
    # covers: F7, STYLE 6 (no max_connections; a small keep-alive pool; a short pool wait)
    from chatcore.engine.provider import OpenAIProvider
    from chatcore.engine.provider_net import ModelTransport

    provider = OpenAIProvider(
        base_url="http://127.0.0.1:9/v1",
        model="m",
        max_keepalive_connections=settings.LLM["MAX_KEEPALIVE_CONNECTIONS"],
    )
    transport = provider._transport
    # The transport has no connection cap at all; only its keep-alive pool is bounded.
    assert isinstance(transport, ModelTransport)
    assert transport._max_idle == settings.LLM["MAX_KEEPALIVE_CONNECTIONS"]
    assert provider._client.timeout.pool == settings.LLM["POOL_TIMEOUT"]
