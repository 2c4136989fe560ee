"""The demo provider: answers without a model server, so a newcomer sees the whole flow
(a tool call, a streamed reply) before configuring `LLM_BASE_URL`."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from .provider_types import Completion, ProviderEvent, TextDelta, ToolCall
from .turns.attachments import text_of


class DemoProvider:
    """Answers without a model server so a newcomer sees the whole flow: it calls the
    `current_time` tool once per turn, then streams a reply that says it is a demo."""

    name = "demo"

    def __init__(self, *, word_delay: float = 0.03) -> None:
        self.word_delay = word_delay

    async def aclose(self) -> None:
        return None

    async def stream(
        self,
        *,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        purpose: str = "turn",
        max_tokens: int | None = None,
        model: str | None = None,
    ) -> AsyncIterator[ProviderEvent]:
        users = [m for m in messages if m.get("role") == "user"]
        last_user = _strip_runtime(text_of(users[-1]["content"])) if users else ""
        if purpose == "title":
            words = _strip_runtime(_transcript_first_user(messages)).split()
            yield Completion(text=" ".join(words[:5]) or "Demo dialog")
            return
        if purpose == "summary":
            yield Completion(text="[demo summary] " + last_user[:400])
            return
        tool_names = {t["function"]["name"] for t in tools or []}
        last = messages[-1] if messages else {}
        if "current_time" in tool_names and last.get("role") == "user":
            yield Completion(
                text="",
                tool_calls=[ToolCall("demo_call_1", "current_time", "{}")],
                finish_reason="tool_calls",
            )
            return
        now = next((m["content"] for m in reversed(messages) if m.get("role") == "tool"), "")
        reply = (
            "[demo provider] No model server is configured (set LLM_BASE_URL to use a real model). "
            f"You said: \u201c{last_user[:500]}\u201d. "
            + (
                f"I asked the current_time tool: {now}."
                if now
                else f"It is {datetime.now(UTC):%H:%M} UTC."
            )
        )
        parts = re.findall(r"\S+\s*", reply)
        for part in parts:
            await asyncio.sleep(self.word_delay)
            yield TextDelta(part)
        yield Completion(text=reply, finish_reason="stop")


def _strip_runtime(text: str) -> str:
    return text.split("\n\n[runtime context]", 1)[0]


def _transcript_first_user(messages: list[dict[str, Any]]) -> str:
    for m in messages:
        if m.get("role") == "user":
            content = text_of(m["content"])
            for line in content.splitlines():
                if line.lower().startswith("user:"):
                    return line[5:].strip()
            return content
    return ""
