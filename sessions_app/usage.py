"""What the model reported it used (SPEC H4): per turn (`Turn.usage`, kept by the committer
as the model server sent it, nested details included) and summed per dialog, per user and per
day for `/info`, the REST API and the admin."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from .models import Turn, TurnStatus

FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens")


def _number(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def usage_of(raw: dict[str, Any] | None) -> dict[str, int]:
    """A turn's usage as clients see it: prompt, completion and cached prompt tokens
    (OpenAI's `prompt_tokens_details.cached_tokens`; 0 where the server gave none)."""
    raw = raw or {}
    details = raw.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {
        "prompt_tokens": _number(raw.get("prompt_tokens")),
        "completion_tokens": _number(raw.get("completion_tokens")),
        "cached_tokens": _number(cached),
    }


def usage_sum(usages: Iterable[dict[str, Any] | None]) -> dict[str, int]:
    """The totals of several turns' usage, with how many turns reported any (`turns`)."""
    total = dict.fromkeys(FIELDS, 0)
    turns = 0
    for raw in usages:
        if not raw:
            continue
        turns += 1
        for key, value in usage_of(raw).items():
            total[key] += value
    return {**total, "turns": turns}


def session_usage(*, session_pk: str) -> dict[str, int]:
    """A dialog's totals over its turns."""
    return usage_sum(
        Turn.objects.filter(session_id=session_pk, status=TurnStatus.COMPLETED).values_list(
            "usage", flat=True
        )
    )


def usage_rows(*, group: str, since: datetime | None = None) -> list[dict[str, Any]]:
    """Totals per `group` ("dialog", "user" or "day"), for the admin's table: each row has
    `key` (the session id, the username or the ISO date), `label` and the sums."""
    turns = Turn.objects.filter(status=TurnStatus.COMPLETED).exclude(finished_at=None)
    if since is not None:
        turns = turns.filter(finished_at__gte=since)
    values = turns.values_list(
        "usage",
        "finished_at",
        "owner__username",
        "session__channel",
        "session__chat_id",
        "session__dialog_id",
        "session__title",
    )
    groups: dict[str, tuple[str, list[dict[str, Any]]]] = {}
    for usage, finished, username, channel, chat_id, dialog_id, title in values.iterator():
        if not usage or finished is None:
            continue
        if group == "dialog":
            key, label = f"{channel}:{chat_id}:{dialog_id}", title
        elif group == "user":
            key, label = username, username
        else:
            key = label = finished.date().isoformat()
        groups.setdefault(key, (label, []))[1].append(usage)
    return [
        {"key": key, "label": label, **usage_sum(rows)} for key, (label, rows) in groups.items()
    ]


def usage_sum_rows(rows: Iterable[dict[str, Any]]) -> dict[str, int]:
    """The totals of a table of `usage_rows` (with `total_tokens` where the rows have it)."""
    names = (*FIELDS, "turns", "total_tokens")
    total = dict.fromkeys(names, 0)
    for row in rows:
        for name in names:
            total[name] += int(row.get(name, 0))
    return total
