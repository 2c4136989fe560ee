"""A scripted model behind the LiteLLM proxy (loaded by the proxy from config.yaml).

The last user message (without the runtime block) picks the behaviour:
`[tool]` calls `current_time` (arguments split over chunks) until a tool result is present;
`[length]` and `[filter]` stop with those finish reasons; `[error]` fails mid-stream with a
rate limit; `[max]` says which answer token limit it was given; the continue instruction gets
the rest of the cut answer; anything else is echoed. Everything streams through LiteLLM's own
wrapper, as a real provider's chunks would.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import litellm
from litellm import CustomLLM
from litellm.types.utils import GenericStreamingChunk

RUNTIME = "\n\n[runtime context]"


def _chunk(
    text: str = "",
    *,
    finish: str = "",
    tool: dict[str, Any] | None = None,
    usage: dict[str, int] | None = None,
) -> GenericStreamingChunk:
    return GenericStreamingChunk(
        text=text,
        tool_use=tool,  # type: ignore[typeddict-item]
        is_finished=bool(finish),
        finish_reason=finish,
        usage=usage,  # type: ignore[typeddict-item]
        index=0,
    )


def _script(messages: list[dict[str, Any]], optional_params: dict[str, Any]) -> Iterator[Any]:
    users = [m for m in messages if m.get("role") == "user"]
    last = str(users[-1]["content"]).split(RUNTIME, 1)[0] if users else ""
    usage = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
    if "[tool]" in last and not any(m.get("role") == "tool" for m in messages):
        args = json.dumps({})
        for i, part in enumerate(("", args[:1], args[1:])):
            fn = {"name": "current_time" if i == 0 else None, "arguments": part}
            yield _chunk(
                tool={
                    "id": "call_lite_1" if i == 0 else None,
                    "type": "function",
                    "function": fn,
                    "index": 0,
                }
            )
        yield _chunk(finish="tool_calls", usage=usage)
        return
    if "[tool]" in last:
        result = next(m["content"] for m in reversed(messages) if m.get("role") == "tool")
        yield _chunk("The tool said: ")
        yield _chunk(str(result)[:40], finish="stop", usage=usage)
        return
    if "previous answer was cut off" in last:
        yield _chunk(" and this is the rest.", finish="stop", usage=usage)
        return
    if "[length]" in last:
        for word in ("This ", "answer ", "runs ", "until ", "the "):
            yield _chunk(word)
        yield _chunk("limit", finish="length", usage=usage)
        return
    if "[filter]" in last:
        yield _chunk("", finish="content_filter", usage=usage)
        return
    if "[error]" in last:
        yield _chunk("Half an ")
        yield _chunk("answer")
        raise litellm.RateLimitError(
            message="upstream rate limit for key sk-upstream-secret-0123456789",
            llm_provider="chatcore-fake",
            model="scripted",
        )
    if "[max]" in last:
        limit = optional_params.get("max_tokens") or optional_params.get("max_completion_tokens")
        yield _chunk(f"limit={limit}", finish="stop", usage=usage)
        return
    yield _chunk("echo: ")
    yield _chunk(last, finish="stop", usage=usage)


class ScriptedModel(CustomLLM):
    async def astreaming(self, *args: Any, **kwargs: Any) -> AsyncIterator[GenericStreamingChunk]:
        for item in _script(kwargs["messages"], kwargs.get("optional_params") or {}):
            yield item

    def streaming(self, *args: Any, **kwargs: Any) -> Iterator[GenericStreamingChunk]:
        yield from _script(kwargs["messages"], kwargs.get("optional_params") or {})


handler = ScriptedModel()
