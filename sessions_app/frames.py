"""Parsing a client's WebSocket frame (PROTOCOL "WebSocket: /ws/chat/"; SPEC F3, F6, F8).

A frame is a JSON object within the frame limit. Anything else is the client's fault and is
answered `too_large` or `bad_request`, never `internal_error`: deep nesting (thousands of
`[`) is refused before the decoder recurses, and a decoder that still runs out of stack is
a bad frame too.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

from django.conf import settings
from django.utils.translation import gettext as _

from chatcore.common.errors import BadRequest, TooLarge

# Client frames are flat objects; this leaves room for any future field shape.
MAX_NESTING = 32
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def too_deep(text: str) -> bool:
    """Whether a JSON text nests brackets deeper than MAX_NESTING (brackets inside strings do
    not count). Linear; a text with few brackets (every ordinary frame) is not even scanned."""
    if text.count("[") + text.count("{") <= MAX_NESTING:
        return False
    depth = accumulate(1 if b in "[{" else -1 for b in _BRACKET.findall(_STRING.sub("", text)))
    return any(level > MAX_NESTING for level in depth)


def loads_bounded(text: str) -> Any:
    """`json.loads` that refuses nesting deeper than MAX_NESTING with BadRequest."""
    if too_deep(text):
        raise BadRequest(
            _("The frame is nested too deeply (at most %(n)d levels).") % {"n": MAX_NESTING}
        )
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise BadRequest(
            _("The frame is nested too deeply (at most %(n)d levels).") % {"n": MAX_NESTING}
        ) from exc
    except ValueError as exc:
        raise BadRequest(_("The frame is not valid JSON.")) from exc


def parse_client_frame(text_data: str | None, bytes_data: bytes | None) -> dict[str, Any]:
    """F3, F6: a JSON object within the frame limit, else TooLarge/BadRequest."""
    limit = settings.CHAT["FRAME_LIMIT_BYTES"]
    if text_data is None:
        if bytes_data is not None and len(bytes_data) > limit:
            raise TooLarge(_("The frame is too large (at most %(n)d bytes).") % {"n": limit})
        raise BadRequest(_("Frames must be JSON text."))
    if len(text_data) > limit or len(text_data.encode("utf-8")) > limit:
        raise TooLarge(_("The frame is too large (at most %(n)d bytes).") % {"n": limit})
    data = loads_bounded(text_data)
    if not isinstance(data, dict):
        raise BadRequest(_("A frame must be a JSON object with a type."))
    return data


def optional_int(data: dict[str, Any], name: str, *, low: int, high: int | None) -> int | None:
    """An optional integer field of a frame within bounds, else `bad_request`."""
    value = data.get(name)
    if value is None:
        return None
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        bounds = f"{low}..{high}" if high is not None else f">= {low}"
        raise BadRequest(
            _("%(name)s must be an integer (%(bounds)s).") % {"name": name, "bounds": bounds}
        )
    return value
