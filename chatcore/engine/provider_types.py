"""What a model provider yields and raises (E5): `TextDelta`s as tokens arrive, one
`Completion` at the end (assembled tool calls, usage, finish reason), `ProviderError`s with a
typed kind and a safe message; and the `ChatProvider` protocol every provider implements."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol


def dumps(value: Any) -> bytes:
    """JSON as the request body carries it: UTF-8, compact, no NaN."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


class EncodedMessage(dict[str, Any]):
    """A model-input message whose JSON is worked out once, where the turn's input is built
    (a worker thread, F7), and joined into the request body as it is (`encode_body`): the
    event loop never serialises a dialog's history, only what a turn adds to it. Never
    changed once built: a change is a copy (`{**m, ...}`, a plain dict)."""

    __slots__ = ("_json",)

    def encoded(self) -> bytes:
        try:
            return self._json
        except AttributeError:
            self._json: bytes = dumps(self)
            return self._json


class EncodedMessages(list[dict[str, Any]]):
    """A model input whose messages' JSON is joined once, where the input is built (a
    database thread, F7): `encode_body` sends that join as it is and encodes only what was
    appended since (a tool step's call and result). Without it the event loop joined every
    message of the window again for each request, work that grows with the dialog. Anything
    but an append (a message replaced, removed, reordered) drops the join; `copy` keeps it.
    """

    __slots__ = ("_count", "_joined")

    def __init__(self, messages: Iterable[EncodedMessage] = ()) -> None:
        super().__init__(messages)
        self._joined = b",".join(m.encoded() for m in self)  # type: ignore[attr-defined]
        self._count = len(self)

    @classmethod
    def joined_from(
        cls, messages: Iterable[dict[str, Any]], count: int, joined: bytes
    ) -> EncodedMessages:
        """`messages` whose first `count` have `joined` as their JSON joined with commas,
        worked out by the caller (the build, from its last one's join)."""
        out = cls.__new__(cls)
        list.extend(out, messages)
        out._count, out._joined = count, joined
        return out

    def joined(self) -> tuple[int, bytes]:
        """How many of the first messages `encode_body` may take from the join, and it."""
        return self._count, self._joined

    def copy(self) -> EncodedMessages:
        out = EncodedMessages.__new__(EncodedMessages)
        list.extend(out, self)
        out._count, out._joined = self._count, self._joined
        return out


def _dropping_join(name: str) -> Any:
    change = getattr(list, name)

    def method(self: EncodedMessages, *args: Any, **kwargs: Any) -> Any:
        self._count = 0
        return change(self, *args, **kwargs)

    method.__name__ = name
    return method


for _name in (
    "__setitem__",
    "__delitem__",
    "__imul__",
    "insert",
    "pop",
    "remove",
    "clear",
    "sort",
    "reverse",
):
    setattr(EncodedMessages, _name, _dropping_join(_name))


def encode_body(payload: dict[str, Any]) -> bytes:
    """A chat completion request's body: its messages joined from their kept JSON where
    they have it (`EncodedMessages`, `EncodedMessage`), each other field as `dumps` gives
    it."""
    messages = payload.get("messages")
    if not messages:
        return dumps(payload)
    head = dumps({k: v for k, v in payload.items() if k != "messages"})
    count, joined = messages.joined() if isinstance(messages, EncodedMessages) else (0, b"")
    parts = [joined] if count else []
    parts += [m.encoded() if isinstance(m, EncodedMessage) else dumps(m) for m in messages[count:]]
    comma = b"," if len(head) > 2 else b""
    return b"".join((head[:-1], comma, b'"messages":[', b",".join(parts), b"]}"))


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class TextDelta:
    text: str


@dataclass(slots=True)
class Completion:
    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    finish_reason: str = ""


ProviderEvent = TextDelta | Completion


class ProviderError(Exception):
    """A typed provider failure. `kind` is one of: context_overflow, auth, rate_limited,
    server, timeout, connection, bad_request, bad_response, content_filter."""

    def __init__(self, kind: str, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status

    @property
    def retryable(self) -> bool:
        return self.kind in {"rate_limited", "server", "timeout", "connection"}


class ChatProvider(Protocol):
    name: str

    def stream(
        self,
        *,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        purpose: str = "turn",
        max_tokens: int | None = None,
        model: str | None = None,
    ) -> AsyncIterator[ProviderEvent]: ...

    async def aclose(self) -> None: ...


async def complete_text(
    provider: ChatProvider, messages: list[dict[str, Any]], *, purpose: str
) -> str:
    """Run a tool-less request to its end and return the text (titles, summaries)."""
    text = ""
    async for event in provider.stream(messages=messages, tools=None, purpose=purpose):
        if isinstance(event, Completion):
            text = event.text
    return text
