"""How the admin shows a message in a list (E2): its text, and the tool calls of an answer
that only calls tools (name and arguments, shortened), so no row reads as empty."""

from __future__ import annotations

import json
from typing import Any

from django.template.defaultfilters import linebreaksbr
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import gettext as _

ARGUMENT_CHARS = 120


def _arguments(raw: Any) -> str:
    # Arguments arrive as the model wrote them, usually a JSON object in a string; shown
    # compact, without the spaces and escapes a model may add.
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return Truncator(raw).chars(ARGUMENT_CHARS)
    text = json.dumps(raw, ensure_ascii=False, separators=(", ", ": "))
    return Truncator(text).chars(ARGUMENT_CHARS)


def tool_calls_of(message: Any) -> list[tuple[str, str]]:
    """(name, shortened arguments) of each tool call the message makes."""
    calls = message.tool_calls if isinstance(message.tool_calls, list) else []
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            out.append((str(function.get("name") or "?"), _arguments(function.get("arguments"))))
    return out


def message_preview(message: Any, chars: int) -> SafeString:
    """The message's text cut to `chars`, then one line per tool call it makes."""
    text = linebreaksbr(Truncator(message.content).chars(chars), autoescape=True)
    calls = tool_calls_of(message)
    if not calls:
        return format_html("{}", text)
    label = _("Tool call")
    lines = format_html_join(
        "",
        '<div class="tool-call">{}: <code>{}({})</code></div>',
        ((label, n, a) for n, a in calls),
    )
    return format_html("{}{}", text, lines) if message.content else lines
