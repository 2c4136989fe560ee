"""The model input's items (C7, E5): a stored message's OpenAI form, converted, encoded and
counted once and kept on the message the history cache holds (`Replayed`), a continuation joined
to the answer it continues, tool calls and results kept in pairs, and the request body's JSON
joined from the items' own."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from sessions_app.models import Message, MessageKind

from ..provider_types import EncodedMessage, EncodedMessages, dumps
from . import attachments
from .outcome import PendingMessage


def message_to_openai(m: Message | PendingMessage) -> dict[str, Any]:
    data: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    refs = getattr(m, "media_refs", None)
    if refs and m.role == "user":
        # H3: a user message with attachments is sent as content parts.
        data["content"] = attachments.content_parts(m.content or "", refs)
    if m.tool_calls:
        data["tool_calls"] = m.tool_calls
        if m.role == "assistant" and not m.content:
            # E5: no empty assistant text beside tool calls; some backends reject "".
            data["content"] = None
    if m.role == "tool":
        data["tool_call_id"] = m.tool_call_id
    return data


@dataclass(slots=True)
class Item:
    """One message of the model input: its OpenAI form, the key its token count is cached
    under (None: count it afresh), whether it belongs to the turn being built, on a stored
    message's own item its token counts by counter name (`TokenCounter.name`), and the seq
    of the stored message it starts with (0 for this turn's own)."""

    data: dict[str, Any]
    key: Hashable | None
    in_turn: bool = False
    tokens: dict[str, int] | None = None
    seq: int = 0


@dataclass(slots=True)
class Replayed:
    """What a stored message gives the model input, worked out once per loaded message and
    kept on it: the history cache holds a dialog's loaded messages from turn to turn (A5),
    so a build converts and counts only the messages new since its last one, and walks the
    rest at the cost of a lookup (STYLE 18). A stored message never changes (B5); its item
    is never changed in place (a join or a trim makes a new one)."""

    item: Item
    id: str
    # Left out of every model input: the welcome message and system rows.
    skipped: bool
    answer: bool
    # E5: an empty assistant text is never replayed.
    empty: bool
    # E5: the id of the cut answer this continuation goes on with, else "".
    continues: str
    # A tool call or a tool's result: the input is checked for pairs only when it has one.
    tool: bool
    # Neither empty, a continuation nor a tool's: its item goes in as it is
    # (`TurnInputBuilder._walk`).
    plain: bool


REPLAYED = "_replayed"


def replayed(m: Message) -> Replayed:
    memo: Replayed | None = m.__dict__.get(REPLAYED)
    if memo is None:
        answer = m.role == "assistant" and not m.tool_calls
        empty = answer and not (m.content or "").strip()
        continues = str((m.source or {}).get("continues") or "")
        tool = m.role == "tool" or bool(m.tool_calls)
        # Its JSON worked out here, once, on the thread that builds (F7).
        data = encoded(message_to_openai(m))
        memo = Replayed(
            item=Item(data, m.pk, tokens={}, seq=m.seq),
            id=str(m.id),
            skipped=m.kind == MessageKind.WELCOME or m.role == "system",
            answer=answer,
            empty=empty,
            continues=continues,
            tool=tool,
            plain=not (empty or continues or tool),
        )
        m.__dict__[REPLAYED] = memo
    return memo


def replay(items: list[Item], answers: dict[str, int], m: Message, r: Replayed) -> None:
    """Add a stored message to the model input (E5): an empty assistant text is never
    replayed, and a continuation is joined to the answer it continues, so the model sees
    one answer, as the user does. `answers` maps answer message ids to their index."""
    if r.empty:
        return
    if r.answer and r.continues in answers:
        index = answers[r.continues]
        joined = items[index]
        data = {**joined.data, "content": (joined.data["content"] or "") + m.content}
        # The joined text is counted under the ids of all its parts.
        key = (joined.key, m.pk) if joined.key is not None else None
        items[index] = Item(data, key, seq=joined.seq)
        answers[r.id] = index
        return
    items.append(r.item)
    if r.answer:
        answers[r.id] = len(items) - 1


def encoded(m: dict[str, Any]) -> EncodedMessage:
    out = m if isinstance(m, EncodedMessage) else EncodedMessage(m)
    out.encoded()
    return out


def sanitize_tool_pairs(items: list[Item]) -> list[Item]:
    """Keep the model input well formed: tool results need their call and the reverse (a
    cancelled turn may have stored one without the other)."""
    answered = {it.data.get("tool_call_id") for it in items if it.data["role"] == "tool"}
    called: set[str] = set()
    out: list[Item] = []
    for it in items:
        m = it.data
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [c for c in m["tool_calls"] if c.get("id") in answered]
            if len(calls) != len(m["tool_calls"]):
                m = dict(m)
                if calls:
                    m["tool_calls"] = calls
                else:
                    m.pop("tool_calls")
                    if not m["content"]:
                        continue
                it = Item(m, None, it.in_turn, seq=it.seq)
            called.update(c["id"] for c in calls)
        elif m["role"] == "tool" and m.get("tool_call_id") not in called:
            continue
        out.append(it)
    return out


def joined_input(
    head: list[dict[str, Any]], body: list[dict[str, Any]], at: int | None, jsons: list[bytes]
) -> EncodedMessages:
    """The model input `head + body` with all its messages' JSON joined as the request body
    sends it (`EncodedMessages`), in one join: the body's from `jsons`, its items' own, but
    the message `at`, which the runtime block was put on (a copy), encoded anew."""
    parts = [dumps(h) for h in head] + jsons
    if at is not None:
        parts[len(head) + at] = dumps(body[at])
    return EncodedMessages.joined_from(head + body, len(head) + len(body), b",".join(parts))


def json_of(message: dict[str, Any]) -> bytes:
    """A model-input message's JSON as the request body carries it: kept on it where the
    build worked it out once (`EncodedMessage`)."""
    if message.__class__ is EncodedMessage:
        return message.encoded()
    return dumps(message)
