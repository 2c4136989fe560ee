"""Slash commands as every channel runs them (SPEC B3): results, errors, state changes, the
frames other connections of the chat hear, and that commands never write to history."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from chatcore.common import publish
from chatcore.common.errors import BadRequest, NotFound, UnknownCommand
from chatcore.engine.commands import REGISTRY, CommandContext, CommandResult, run_command
from sessions_app import selectors, services
from sessions_app.models import Message, MessageKind, Session, TitleSource

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]

B3_COMMANDS = ["new", "sessions", "switch", "rename", "delete", "compact", "info", "stop", "help"]


# --- helpers ------------------------------------------------------------------------------


def chat(user: Any) -> str:
    return f"u{user.pk}"


async def make(user: Any, dialog_id: str | None = "default", **kw: Any) -> Session:
    return await sync_to_async(services.session_create)(
        owner=user, channel="web", chat_id=chat(user), dialog_id=dialog_id, **kw
    )


async def run(user: Any, current: Session | None, text: str) -> CommandResult:
    ctx = CommandContext(owner=user, channel="web", chat_id=chat(user), current=current)
    return await run_command(ctx, text)


async def reload(session: Session) -> Session:
    return await Session.objects.aget(pk=session.pk)


async def history_state(session: Session) -> tuple[list[int], int, int, int]:
    """What history looks like: stored seqs and the dialog's counters."""
    seqs = [
        seq
        async for seq in Message.objects.filter(session_id=session.pk)
        .order_by("seq")
        .values_list("seq", flat=True)
    ]
    fresh = await reload(session)
    return seqs, fresh.message_count, fresh.total_message_count, fresh.last_seq


async def add_exchange(session: Session, question: str = "q", answer: str = "a") -> None:
    await sync_to_async(services.messages_append)(
        session_pk=session.pk,
        messages=[
            services.NewMessage(role="user", content=question, kind=MessageKind.USER_INPUT),
            services.NewMessage(role="assistant", content=answer, kind=MessageKind.ASSISTANT),
        ],
    )


async def set_active(session: Session, ago: timedelta) -> None:
    await Session.objects.filter(pk=session.pk).aupdate(last_active_at=timezone.now() - ago)


async def live_dialog_ids(user: Any) -> set[str]:
    return {
        d
        async for d in Session.objects.filter(owner=user, deleted_at__isnull=True).values_list(
            "dialog_id", flat=True
        )
    }


def dialog_lines(content: str) -> list[tuple[str, str]]:
    """(marker, dialog_id) of each dialog line of a /sessions reply."""
    out = []
    for line in content.splitlines()[1:]:
        marker, dialog_id = line.split()[:2]
        out.append((marker, dialog_id))
    return out


def round_trip(frame: dict[str, Any]) -> dict[str, Any]:
    # STYLE 4: every event survives JSON, as it does on the wire.
    assert json.loads(json.dumps(frame)) == frame
    return frame


# --- /new ---------------------------------------------------------------------------------


async def test_new_creates_a_dialog_that_becomes_current(user: Any) -> None:
    # covers: B3, B2, B4
    current = await make(user)
    result = await run(user, current, "/new")
    assert result.ok and result.command == "new"
    new = result.current
    assert new is not None and new.pk != current.pk
    assert new.dialog_id in result.content
    assert {"sessions", "history"} <= result.effects
    new = await reload(new)
    assert new.deleted_at is None and new.owner_id == user.pk
    assert new.title == f"Dialog {new.dialog_id}"
    assert new.title_source == TitleSource.DEFAULT
    welcome = [m async for m in Message.objects.filter(session_id=new.pk)]
    assert [(m.seq, m.role, m.source["kind"]) for m in welcome] == [(1, "system", "welcome")]
    # The web chat's welcome speaks of the web chat (issue 54); chat apps name the id.
    assert welcome[0].content.startswith("New dialog started.")
    assert (new.message_count, new.total_message_count) == (0, 1)
    # The old dialog is kept, and /sessions now marks the new one as current.
    assert await live_dialog_ids(user) == {"default", new.dialog_id}
    listing = await run(user, result.current, "/sessions")
    assert ("*", new.dialog_id) in dialog_lines(listing.content)
    assert ("-", "default") in dialog_lines(listing.content)


async def test_new_with_a_title_uses_it(user: Any) -> None:
    # covers: B3, B4
    current = await make(user)
    result = await run(user, current, "/new   Trip  to Kyoto ")
    assert result.current is not None
    new = await reload(result.current)
    assert new.title == "Trip to Kyoto"
    assert new.title_source == TitleSource.USER
    assert "Trip to Kyoto" in result.content


async def test_new_tells_every_connection_of_the_chat(user: Any, recorder: Any) -> None:
    # covers: B3, B2, D2
    current = await make(user)
    rec = await recorder(publish.chat_group("web", chat(user)))
    result = await run(user, current, "/new")
    assert result.current is not None
    changed = round_trip(await rec.next(timeout=5))
    delta = round_trip(await rec.next(timeout=5))
    assert changed == {
        "type": "sessions_changed",
        "session_id": result.current.session_id,
        "change": "created",
    }
    assert delta["type"] == "history_delta"
    assert delta["session_id"] == result.current.session_id
    assert (delta["base_revision"], delta["history_revision"]) == (0, 1)
    assert len(delta["messages"]) == 1
    welcome = delta["messages"][0]
    assert welcome["seq"] == 1 and welcome["role"] == "system"
    assert welcome["source"]["kind"] == "welcome"
    assert welcome["content"].startswith("New dialog started.")


# --- /sessions ------------------------------------------------------------------------------


async def test_sessions_lists_the_ten_most_recent_and_marks_the_current(user: Any) -> None:
    # covers: B3
    dialogs = [await make(user, f"d{i:02d}") for i in range(12)]
    for i, session in enumerate(dialogs):
        await set_active(session, timedelta(minutes=i))  # d00 most recent, d11 oldest
    current = dialogs[4]
    result = await run(user, current, "/sessions")
    assert result.command == "sessions" and result.ok
    lines = dialog_lines(result.content)
    assert [d for _, d in lines] == [f"d{i:02d}" for i in range(10)]
    assert [m for m, _ in lines].count("*") == 1
    assert ("*", "d04") in lines
    assert "d10" not in result.content and "d11" not in result.content
    # Titles and user message counts are shown.
    await add_exchange(dialogs[0])
    listing = (await run(user, current, "/sessions")).content
    first = listing.splitlines()[1]
    assert "d00" in first and "Dialog d00" in first and "(1 message)" in first


async def test_sessions_never_lists_deleted_or_other_chats_dialogs(
    user: Any, other_user: Any
) -> None:
    # covers: B3, A7, F2
    current = await make(user, "keep")
    gone = await make(user, "gone")
    await sync_to_async(services.session_soft_delete)(session=gone)
    await sync_to_async(services.session_create)(
        owner=user, channel="web", chat_id=f"{chat(user)}.work", dialog_id="elsewhere"
    )
    await make(other_user, "theirs")
    result = await run(user, current, "/sessions")
    assert [d for _, d in dialog_lines(result.content)] == ["keep"]


async def test_sessions_in_an_empty_chat_says_so(user: Any) -> None:
    # covers: B3
    result = await run(user, None, "/sessions")
    assert result.ok and result.content == "No dialogs yet."


# --- /switch --------------------------------------------------------------------------------


async def test_switch_to_an_existing_dialog_makes_it_current(user: Any) -> None:
    # covers: B3, B1
    work = await make(user, "work")
    current = await make(user, "play")
    result = await run(user, current, "/switch work")
    assert result.command == "switch"
    assert result.current is not None and result.current.pk == work.pk
    assert "work" in result.content and "Dialog work" in result.content
    assert {"sessions", "history"} <= result.effects


async def test_switch_to_a_missing_dialog_is_an_error_not_a_creation(user: Any) -> None:
    # covers: B3, B1
    current = await make(user)
    with pytest.raises(NotFound) as info:
        await run(user, current, "/switch nowhere")
    assert "nowhere" in info.value.message
    assert info.value.code == "not_found"
    assert await Session.objects.acount() == 1


async def test_switch_cannot_reach_a_deleted_dialog(user: Any) -> None:
    # covers: B3, A7
    current = await make(user)
    gone = await make(user, "gone")
    await sync_to_async(services.session_soft_delete)(session=gone)
    with pytest.raises(NotFound):
        await run(user, current, "/switch gone")


@pytest.mark.parametrize(
    "text",
    [
        "/switch",
        "/switch   ",
        "/switch a b",
        "/switch bad/id",
        "/switch a:b",
        "/switch \u00e9t\u00e9",
        "/switch " + "x" * 65,
    ],
)
async def test_switch_with_a_bad_or_missing_id_is_a_bad_request(user: Any, text: str) -> None:
    # covers: B3, A1
    current = await make(user)
    with pytest.raises(BadRequest) as info:
        await run(user, current, text)
    assert info.value.message
    assert await Session.objects.acount() == 1


# --- /rename --------------------------------------------------------------------------------


async def test_rename_changes_the_title_and_tells_the_chat(user: Any, recorder: Any) -> None:
    # covers: B3, B4, D2
    current = await make(user)
    rec = await recorder(publish.chat_group("web", chat(user)))
    result = await run(user, current, "/rename  Taxes   2025 ")
    assert result.command == "rename" and "Taxes 2025" in result.content
    assert result.current is not None and result.current.title == "Taxes 2025"
    fresh = await reload(current)
    assert fresh.title == "Taxes 2025"
    assert fresh.title_source == TitleSource.USER
    frame = round_trip(await rec.next(timeout=5))
    assert frame["type"] == "session_updated"
    assert frame["session_id"] == current.session_id
    assert frame["title"] == "Taxes 2025"


@pytest.mark.parametrize("text", ["/rename", "/rename    ", "/rename " + "x" * 201])
async def test_rename_with_an_empty_or_oversized_title_is_a_bad_request(
    user: Any, text: str
) -> None:
    # covers: B3, B4
    current = await make(user)
    with pytest.raises(BadRequest):
        await run(user, current, text)
    fresh = await reload(current)
    assert fresh.title == "Dialog default"
    assert fresh.title_source == TitleSource.DEFAULT


async def test_rename_without_a_current_dialog_is_a_bad_request(user: Any) -> None:
    # covers: B3
    with pytest.raises(BadRequest):
        await run(user, None, "/rename Anything")


# --- /delete --------------------------------------------------------------------------------


async def test_delete_hides_the_dialog_and_the_most_recent_other_becomes_current(
    user: Any, recorder: Any
) -> None:
    # covers: B3, A7, B1
    older = await make(user, "older")
    recent = await make(user, "recent")
    current = await make(user, "current")
    await set_active(older, timedelta(minutes=20))
    await set_active(recent, timedelta(minutes=10))
    rec = await recorder(publish.chat_group("web", chat(user)))
    result = await run(user, current, "/delete")
    assert result.command == "delete"
    assert result.current is not None and result.current.pk == recent.pk
    assert "current" in result.content and "recent" in result.content
    assert await live_dialog_ids(user) == {"older", "recent"}
    with pytest.raises(NotFound):
        await sync_to_async(selectors.session_get_for_owner)(
            owner_id=user.pk, session_id=current.session_id
        )
    frame = round_trip(await rec.next(timeout=5))
    assert frame == {
        "type": "sessions_changed",
        "session_id": current.session_id,
        "change": "deleted",
    }
    # Deleted dialogs are gone from /switch as well.
    with pytest.raises(NotFound):
        await run(user, result.current, "/switch current")


async def test_deleting_the_last_dialog_starts_a_fresh_one(user: Any) -> None:
    # covers: B3, A7, B2
    only = await make(user)
    result = await run(user, only, "/delete")
    new = result.current
    assert new is not None and new.pk != only.pk
    assert (await reload(only)).deleted_at is not None
    assert await live_dialog_ids(user) == {new.dialog_id}
    kinds = [m.source["kind"] async for m in Message.objects.filter(session_id=new.pk)]
    assert kinds == ["welcome"]


# --- /info, /help ---------------------------------------------------------------------------


async def test_info_shows_the_dialog_and_its_counts(user: Any) -> None:
    # covers: B3, A2
    current = await make(user, "work", title="Work notes")
    await add_exchange(current)
    await add_exchange(current)
    result = await run(user, current, "/info")
    assert result.command == "info"
    text = result.content
    assert "Dialog: work" in text
    assert current.session_id in text
    assert "Title: Work notes" in text
    assert "2 from you, 5 in total" in text
    assert "idle" in text and "0 queued" in text


async def test_help_lists_every_command(user: Any) -> None:
    # covers: B3
    result = await run(user, None, "/help")
    assert result.command == "help"
    for name in B3_COMMANDS:
        assert f"/{name}" in result.content, name
    assert "/switch <dialog_id>" in result.content
    assert "/new [title]" in result.content
    # Every registered command has a help line, and every B3 command is registered.
    assert set(B3_COMMANDS) <= set(REGISTRY)
    help_lines = result.content.splitlines()[1:]
    assert len(help_lines) == len(REGISTRY)


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["/frobnicate", "/", "/sessionz now"])
async def test_an_unknown_command_gets_a_clear_error(user: Any, text: str) -> None:
    # covers: B3
    current = await make(user)
    with pytest.raises(UnknownCommand) as info:
        await run(user, current, text)
    name = text[1:].split(" ")[0]
    assert info.value.code == "unknown_command"
    assert f"/{name}" in info.value.message
    assert "/help" in info.value.message
    assert await history_state(current) == ([1], 0, 1, 1)


@pytest.mark.parametrize("name", ["info", "sessions", "help", "delete", "stop", "compact"])
async def test_commands_without_arguments_refuse_them(user: Any, name: str) -> None:
    # covers: B3
    current = await make(user)
    with pytest.raises(BadRequest) as info:
        await run(user, current, f"/{name} extra")
    assert f"/{name}" in info.value.message
    assert "takes no arguments" in info.value.message
    # A refused /delete deletes nothing.
    assert (await reload(current)).deleted_at is None
    assert await Session.objects.acount() == 1


# --- commands are not history -----------------------------------------------------------------


async def test_commands_never_write_to_history(user: Any) -> None:
    # covers: B3, A2
    other = await make(user, "other")
    current = await make(user, "main")
    await add_exchange(current)
    before_current = await history_state(current)
    before_other = await history_state(other)
    assert before_current == ([1, 2, 3], 1, 3, 3)
    for text in ("/sessions", "/info", "/help", "/rename Still me", "/switch other"):
        result = await run(user, current, text)
        assert result.ok, text
        assert await history_state(current) == before_current, text
        assert await history_state(other) == before_other, text
    # Errors write nothing either.
    for text in ("/switch missing", "/nope", "/info x"):
        with pytest.raises((BadRequest, NotFound, UnknownCommand)):
            await run(user, current, text)
    assert await history_state(current) == before_current
    assert await Message.objects.acount() == 4


async def test_read_only_commands_send_no_history_deltas(user: Any, recorder: Any) -> None:
    # covers: B3, D2
    other = await make(user, "other")
    current = await make(user, "main")
    rec = await recorder(
        publish.chat_group("web", chat(user)),
        publish.session_group(current.pk),
        publish.session_group(other.pk),
    )
    for text in ("/sessions", "/info", "/help", "/switch other"):
        await run(user, current, text)
    with pytest.raises(asyncio.TimeoutError):
        frame = await rec.next(timeout=0.3)
        pytest.fail(f"unexpected frame {frame}")
