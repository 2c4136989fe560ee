"""What a model provider yields and raises (E5): `TextDelta`s as tokens arrive, one
`Completion` at the end (assembled tool calls, usage, finish reason), `ProviderError`s with a
typed kind and a safe message; and the `ChatProvider` protocol every provider implements."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol


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
