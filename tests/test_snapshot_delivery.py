"""Every answer arrives whole through its snapshots, also when the channel layer is slow at
the moment the turn ends (SPEC D1): a snapshot publish still in flight when the turn ends must
not count as sent, or the last tokens never reach the clients."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from channels.layers import InMemoryChannelLayer
from django.test import override_settings

from chatcore.common import publish
from chatcore.common.redislayer import RedisPubSubLayer
from tests.engine_helpers import chat_group_of, history, make_dialog, send, turn
from tests.fakemodel import Reply

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]

SLOW_SECONDS = 0.5
# Snapshot frames whose publish has started (the test waits for the last tail to be in flight).
in_flight: list[dict[str, Any]] = []


# When set, snapshot publishes wait for this event instead of SLOW_SECONDS (a layer stuck
# until the test lets it go: the answer's commit must not wait for it).
held: list[asyncio.Event] = []


async def _slowly(message: dict[str, Any]) -> None:
    """Snapshot publishes take a while (a busy Redis, a held connection lock)."""
    frame = message.get("frame", {})
    if frame.get("type") == "turn_snapshot":
        in_flight.append(frame)
        if held:
            await held[0].wait()
        else:
            await asyncio.sleep(SLOW_SECONDS)


class SlowInMemoryLayer(InMemoryChannelLayer):
    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        await _slowly(message)
        await super().group_send(group, message)


class SlowRedisLayer(RedisPubSubLayer):
    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        await _slowly(message)
        await super().group_send(group, message)


def _layers(kind: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    if kind == "memory":
        return {"default": {"BACKEND": f"{__name__}.SlowInMemoryLayer"}}
    redis_url = request.getfixturevalue("redis_url")
    return {
        "default": {
            "BACKEND": f"{__name__}.SlowRedisLayer",
            "CONFIG": {"hosts": [redis_url], "prefix": f"snapdel{id(request)}"},
        }
    }


async def _rebuilt(rec: Any, turn_id: str) -> tuple[str, list[dict[str, Any]]]:
    """The turn's answer as a client rebuilds it from the snapshot tails it got before the
    turn's terminal, and the frames up to that terminal; a tail that skips text fails."""
    text = ""

    def apply(frame: dict[str, Any]) -> bool:
        nonlocal text
        if frame["type"] == "turn_snapshot" and frame["turn_id"] == turn_id:
            assert frame["text_offset"] <= len(text), "a snapshot tail went missing"
            text = text[: frame["text_offset"]] + frame["text"]
        return frame["type"] == "turn_updated" and frame["turn_id"] == turn_id

    frames = await rec.until(apply, timeout=20)
    return text, frames


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_last_snapshot_reaches_clients_before_the_terminal(
    kind, request, make_engine, fake_model, recorder, user
):
    # covers: D1, D2
    in_flight.clear()
    with override_settings(CHANNEL_LAYERS=_layers(kind, request)):
        engine = await make_engine()
        session = await make_dialog(user)
        # One listener on both groups, as a connection whose current dialog this is: the
        # order of snapshots and the terminal is what a client sees.
        rec = await recorder(chat_group_of(session), publish.session_group(session.pk))
        answer = "".join(f"t{i} " for i in range(60))
        gate = threading.Event()
        fake_model.script(Reply(text=answer, chunk=3, gate=gate))
        ack = await send(engine, session, "question")

        # The stream holds after its text; end it while the last tail is being published.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while not any(f["text_offset"] + len(f["text"]) == len(answer) for f in in_flight):
            assert loop.time() < deadline, "the last tail was never published"
            await asyncio.sleep(0.005)
        gate.set()

        text, frames = await _rebuilt(rec, ack.turn_id)
        assert frames[-1]["status"] == "completed"
        # The answer rebuilt from snapshots before `turn_updated` is the whole answer.
        assert text == answer
        stored = [m.content for m in await history(session) if m.role == "assistant"]
        assert stored == [answer]


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_the_answer_is_committed_while_its_last_snapshot_is_still_on_its_way(
    kind, request, make_engine, fake_model, recorder, user
):
    # covers: D1, C9 (the turn's end does not wait for a slow layer before its commit; its
    # terminal still comes after its last snapshot)
    in_flight.clear()
    held[:] = [asyncio.Event()]
    try:
        with override_settings(CHANNEL_LAYERS=_layers(kind, request)):
            engine = await make_engine()
            session = await make_dialog(user)
            rec = await recorder(chat_group_of(session), publish.session_group(session.pk))
            answer = "".join(f"a{i} " for i in range(40))
            gate = threading.Event()
            fake_model.script(Reply(text=answer, chunk=5, gate=gate))
            ack = await send(engine, session, "question")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 15
            while not in_flight:
                assert loop.time() < deadline, "no snapshot publish started"
                await asyncio.sleep(0.005)
            gate.set()  # the answer ends while its snapshot publish is held in the layer

            deadline = loop.time() + 3
            while (await turn(ack.turn_id)).status != "completed":
                assert loop.time() < deadline, "the commit waited for the snapshot publish"
                await asyncio.sleep(0.02)
            stored = [m.content for m in await history(session) if m.role == "assistant"]
            assert stored == [answer]

            held[0].set()
            text, frames = await _rebuilt(rec, ack.turn_id)
            assert frames[-1]["status"] == "completed"
            assert text == answer  # the whole answer arrived before its terminal
    finally:
        for event in held:
            event.set()
        held.clear()


def test_a_missing_tail_is_logged_counted_and_answered_with_a_full_snapshot(caplog):
    # covers: D1
    from chatcore.engine.clientstate import SnapshotRelay, snapshot_gaps

    relay = SnapshotRelay()
    base = {"type": "turn_snapshot", "turn_id": "t1", "tools": [], "status": "running"}
    out, ask = relay.relay({**base, "text_offset": 0, "text": "Hello", "frame": 1})
    assert out is not None and not ask
    before = snapshot_gaps()
    # The frame with " wor" was dropped by the layer; the next one starts past the client.
    out, ask = relay.relay({**base, "text_offset": 9, "text": "ld", "frame": 3})
    assert out is None and ask, "a gap asks the turn's process for a full snapshot"
    assert snapshot_gaps() == before + 1
    assert "snapshot tail missing" in caplog.text
    # Asked once per turn, however many frames arrive before the full snapshot.
    out, ask = relay.relay({**base, "text_offset": 11, "text": "!", "frame": 4})
    assert out is None and not ask
    out, ask = relay.relay({**base, "text_offset": 0, "text": "Hello world!", "frame": 5})
    assert out is not None and out["text"] == "Hello world!"


async def test_the_first_snapshot_of_a_burst_is_its_first_delta(
    make_engine, fake_model, recorder, user
):
    # covers: D1 (the first token is not held back: a model that sends its whole answer in one
    # burst gets its first delta to the clients before the rest is parsed)
    engine = await make_engine()
    session = await make_dialog(user)
    rec = await recorder(chat_group_of(session), publish.session_group(session.pk))
    answer = "".join(f"w{i} " for i in range(400))
    fake_model.script(Reply(text=answer, chunk=4))
    ack = await send(engine, session, "question")
    snapshots: list[dict[str, Any]] = []

    def seen(frame: dict[str, Any]) -> bool:
        if frame["type"] == "turn_snapshot" and frame["turn_id"] == ack.turn_id:
            snapshots.append(frame)
        return frame["type"] == "turn_updated" and frame["turn_id"] == ack.turn_id

    frames = await rec.until(seen, timeout=20)
    assert frames[-1]["status"] == "completed"
    first = snapshots[0]
    assert (first["frame"], first["text_offset"], first["text"]) == (1, 0, answer[:4])
    # Coalesced after that (D1): far fewer frames than deltas, and the tails rebuild it whole.
    assert len(snapshots) < len(answer) // 4 // 10
    text = ""
    for frame in snapshots:
        assert frame["text_offset"] <= len(text)
        text = text[: frame["text_offset"]] + frame["text"]
    assert text == answer


# How much of the answer the turn had when its first frame was taken by the layer.
parsed_at_first_frame: list[int] = []


class TakesAWhileLayer(InMemoryChannelLayer):
    """A layer that takes its time with each publish, as Redis takes a round trip; the first
    snapshot's publish notes how much of the answer the running turn had parsed by then."""

    engine: Any = None

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        frame = message.get("frame", {})
        await asyncio.sleep(0.02)
        if frame.get("type") == "turn_snapshot" and frame.get("frame") == 1:
            local = TakesAWhileLayer.engine.local.get(frame["turn_id"])
            parsed_at_first_frame.append(len(local.snapshot.text))
        await super().group_send(group, message)


async def test_the_rest_of_a_burst_waits_until_the_layer_took_the_first_frame(
    make_engine, fake_model, recorder, user, monkeypatch
):
    # covers: D1 (on a layer with a round trip, such as Redis, the first token is not held
    # back by the parsing of an answer that arrived whole)
    from chatcore.engine import turn_run
    from chatcore.engine.turns import runner

    # The runner's wait is capped (for a layer that never answers); this layer always does,
    # within 40 ms, and a busy machine must not turn the cap into what is tested here.
    monkeypatch.setattr(runner, "FIRST_FRAME_WAIT_SECONDS", 10.0)
    real_run_turn = turn_run.TurnRuns.run

    async def run_turn(self: Any, started: Any) -> None:
        if started.opened is not None:
            # A request opened at the admission (PostgreSQL): the whole answer is in, and
            # its first token read, before the worker starts the turn.
            request = (await fake_model.requests_made(1))[-1]
            assert await asyncio.to_thread(request.finished.wait, 10)
            await asyncio.sleep(0.05)
        await real_run_turn(self, started)

    monkeypatch.setattr(turn_run.TurnRuns, "run", run_turn)
    parsed_at_first_frame.clear()
    with override_settings(CHANNEL_LAYERS={"default": {"BACKEND": f"{__name__}.TakesAWhileLayer"}}):
        engine = TakesAWhileLayer.engine = await make_engine()
        session = await make_dialog(user)
        rec = await recorder(chat_group_of(session), publish.session_group(session.pk))
        answer = "".join(f"w{i} " for i in range(400))
        fake_model.script(Reply(text=answer, chunk=4))
        ack = await send(engine, session, "question")
        text, frames = await _rebuilt(rec, ack.turn_id)
    assert frames[-1]["status"] == "completed"
    assert text == answer
    # While the first frame was on its way, the rest of the answer waited unparsed.
    assert parsed_at_first_frame == [4]
