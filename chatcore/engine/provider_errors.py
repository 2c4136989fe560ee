"""What a model server's answers mean (E5, C7): HTTP errors and in-stream errors mapped to
typed `ProviderError`s, the answer token limit that fits the context window, a refused limit
told apart from an overflow, and usage totals across the requests of a turn."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from chatcore.logging import scrub

from .provider_types import ProviderError

logger = logging.getLogger(__name__)

_OVERFLOW = re.compile(
    r"context[_ ]length|maximum context|context window|too many tokens|prompt is too long"
    r"|reduce the length|exceeds the context",
    re.IGNORECASE,
)

# H3: a model server that cannot take image parts says so in its 400 (OpenAI: "image_url is
# only supported by certain models"; vLLM: "... is not a multimodal model"; others: "does
# not support images", "... required for image input").
_IMAGES = re.compile(
    r"image_url|image input|images? (?:is|are) not supported|not support(?:ed)? (?:for )?images?"
    r"|does not support images?|vision|multi-?modal",
    re.IGNORECASE,
)


def classify_http_error(status: int, body: str) -> ProviderError:
    """Map an HTTP error from the model server to a typed error (E5)."""
    code = ""
    detail = ""
    try:
        data = json.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else {}
        if isinstance(err, dict):
            code = str(err.get("code") or err.get("type") or "")
            detail = str(err.get("message") or "")
        elif isinstance(err, str):
            detail = err
    except (ValueError, AttributeError):
        detail = body[:500]
    if _OVERFLOW.search(code) or _OVERFLOW.search(detail):
        return ProviderError(
            "context_overflow", "the conversation is too long for the model", status=status
        )
    if status in (400, 415, 422) and (_IMAGES.search(code) or _IMAGES.search(detail)):
        return ProviderError(
            "images_unsupported", "the model server refused the image parts", status=status
        )
    if status in (401, 403):
        return ProviderError("auth", "the model server refused the credentials", status=status)
    if status == 429:
        return ProviderError("rate_limited", "the model server is rate limiting", status=status)
    if status >= 500:
        return ProviderError("server", f"the model server failed (HTTP {status})", status=status)
    return ProviderError(
        "bad_request", f"the model server rejected the request (HTTP {status})", status=status
    )


# E5: error codes and types that OpenAI-compatible servers and gateways put in an SSE `error`
# chunk, mapped to the HTTP status they stand for, so both paths classify alike.
_STREAM_ERROR_CODES: dict[str, int] = {
    "rate_limit_exceeded": 429,
    "rate_limit_error": 429,
    "ratelimiterror": 429,
    "insufficient_quota": 429,
    "too_many_requests": 429,
    "throttling_error": 429,
    "invalid_api_key": 401,
    "authentication_error": 401,
    "authenticationerror": 401,
    "permission_denied": 403,
    "permission_error": 403,
    "server_error": 500,
    "internal_server_error": 500,
    "internalservererror": 500,
    "api_error": 500,
    "apierror": 500,
    "service_unavailable": 503,
    "serviceunavailableerror": 503,
    "overloaded_error": 503,
    "overloaded": 503,
    "timeout": 504,
    "timeout_error": 504,
    "invalid_request_error": 400,
    "badrequesterror": 400,
    "not_found_error": 404,
}
_CONTENT_FILTER = re.compile(r"content[_ ]?(filter|policy|management)", re.IGNORECASE)


def classify_stream_error(chunk: dict[str, Any]) -> ProviderError:
    """Map an SSE `error` chunk (an error after the HTTP 200) to a typed error by its own
    code, like an HTTP error (E5). The chunk is logged scrubbed: it may echo credentials."""
    logger.warning("model server sent an error mid-stream: %s", scrub(json.dumps(chunk)[:1000]))
    err = chunk.get("error")
    if not isinstance(err, dict):
        err = {"message": str(err)}
    keys = [str(err.get(k) or "") for k in ("code", "type", "status")]
    if any(_CONTENT_FILTER.search(k) for k in keys):
        return ProviderError("content_filter", "the model server's content filter stopped it")
    status = 0
    for key in keys:
        if key.isdigit() and 400 <= int(key) <= 599:
            status = int(key)
            break
        mapped = _STREAM_ERROR_CODES.get(key.lower().replace(".", "_").replace("-", "_"))
        if mapped:
            status = mapped
            break
    if status == 504:
        return ProviderError("timeout", "the model server timed out", status=status)
    # An error without a known code is the server failing mid-answer.
    return classify_http_error(status or 500, json.dumps({"error": err}))


ANSWER_TOKEN_MARGIN = 16
MIN_ANSWER_TOKENS = 64


def answer_token_limit(*, context_window: int, input_tokens: int, configured: int = 0) -> int:
    """E5: the `max_tokens` of a turn request: what the window leaves after the input, capped
    by the configured limit (0 = the window alone), never below a small floor so an input
    near the window still gets a short answer (a cut one the user can see and continue)."""
    # The input is an estimate: keep a quarter of it spare, so an undercount does not make
    # input + limit exceed the window (servers such as vLLM refuse that).
    room = context_window - input_tokens - max(ANSWER_TOKEN_MARGIN, input_tokens // 4)
    limit = min(room, configured) if configured > 0 else room
    return max(limit, MIN_ANSWER_TOKENS)


LIMIT_PARAMS = ("max_tokens", "max_completion_tokens")
_AT_MOST = re.compile(r"at most (\d+)(?: completion| output)? tokens", re.IGNORECASE)
# vLLM-style: "maximum context length is 4096 tokens. However, you requested 5000 tokens (1000
# in the messages, 4000 in the completion)": the input fits, the limit does not.
_WINDOW_SPLIT = re.compile(
    r"maximum context length is (\d+) tokens.*?(\d+) in the messages, (\d+) in the completion",
    re.IGNORECASE | re.DOTALL,
)


class AnswerLimitRejected(ProviderError):
    """E5: the server refused the answer token limit itself (too large for the model, or the
    other field name wanted); the provider adjusts it once and sends the request again."""

    def __init__(self, body: str, *, status: int, fits: int = 0) -> None:
        super().__init__(
            "bad_request", "the model server rejected the answer token limit", status=status
        )
        # For this request only: the limit that fits the window beside this input.
        self.fits = fits
        # What the error is when adjusting the limit did not help.
        self.plain = classify_http_error(status, body)
        found = _AT_MOST.search(body)
        self.ceiling = int(found.group(1)) if found else 0
        self.wants = next(
            (p for p in LIMIT_PARAMS if f"use '{p}'" in body.lower() or f'use "{p}"' in body),
            "",
        )


def limit_rejection(status: int, body: str, param: str) -> AnswerLimitRejected | None:
    """E5: whether a 400 refuses the answer token limit rather than the input."""
    if status != 400 or not param:
        return None
    split = _WINDOW_SPLIT.search(body)
    if split:
        fits = int(split.group(1)) - int(split.group(2)) - ANSWER_TOKEN_MARGIN
        # A window too small for the input alone is a real overflow (C7).
        return AnswerLimitRejected(body, status=status, fits=fits) if fits > 0 else None
    if param in body and not _OVERFLOW.search(body):
        return AnswerLimitRejected(body, status=status)
    return None


def merge_usage(total: dict[str, Any], usage: dict[str, Any] | None) -> dict[str, Any]:
    """Add one response's usage into a running total, keeping nested details
    (`completion_tokens_details`, `prompt_tokens_details.cached_tokens`)."""
    for key, value in (usage or {}).items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            total[key] = total.get(key, 0) + value
        elif isinstance(value, dict):
            inner = total.get(key)
            total[key] = merge_usage(inner if isinstance(inner, dict) else {}, value)
    return total
