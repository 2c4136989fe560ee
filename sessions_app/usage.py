"""What the model reported it used (SPEC H4): per turn (`Turn.usage`, kept by the committer
as the model server sent it, nested details included) and summed per dialog, per user and per
day for `/info`, the REST API and the admin.

Sums are made by the database (the JSON keys cast to numbers; the committer keeps only
numbers there, `provider_errors.merge_usage`), so a table over months of turns reads one row
per group, not one per turn.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, cast

from django.db.models import Count, F, FloatField, Q, QuerySet, Sum
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Coalesce, TruncDate

from .models import Turn, TurnStatus

FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens")
_PATHS = {
    "prompt_tokens": "usage__prompt_tokens",
    "completion_tokens": "usage__completion_tokens",
    "cached_tokens": "usage__prompt_tokens_details__cached_tokens",
}


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


def _sums() -> dict[str, Any]:
    sums: dict[str, Any] = {
        name: Coalesce(Sum(Cast(KT(path), FloatField())), 0.0) for name, path in _PATHS.items()
    }
    reported = Q(usage__has_key="prompt_tokens") | Q(usage__has_key="completion_tokens")
    sums["turns"] = Count("id", filter=reported)
    return sums


def _ints(row: dict[str, Any]) -> dict[str, int]:
    return {name: int(row[name] or 0) for name in (*FIELDS, "turns")}


def _completed() -> QuerySet[Turn]:
    return Turn.objects.filter(status=TurnStatus.COMPLETED)


def session_usage(*, session_pk: str) -> dict[str, int]:
    """A dialog's totals over its completed turns, with how many reported usage (`turns`)."""
    return _ints(_completed().filter(session_id=session_pk).aggregate(**_sums()))


def sessions_usage(*, session_pks: list[str]) -> dict[str, dict[str, int]]:
    """`session_usage` of several dialogs in one query (a page of the REST list)."""
    found = cast(
        Iterable[dict[str, Any]],
        _completed()
        .filter(session_id__in=session_pks)
        .values("session_id")
        .annotate(**_sums())
        .order_by(),
    )
    totals = {pk: _ints(dict.fromkeys((*FIELDS, "turns"), 0)) for pk in session_pks}
    totals.update({row["session_id"]: _ints(row) for row in found})
    return totals


def usage_rows(*, group: str, since: datetime | None = None) -> list[dict[str, Any]]:
    """Totals per `group` ("dialog", "user", "model" or "day"), for the admin's table: each row has
    `key` (the session id, the username or the ISO date), `label` and the sums. "model":
    per model the turns asked."""
    turns = _completed().exclude(finished_at=None)
    if since is not None:
        turns = turns.filter(finished_at__gte=since)
    if group == "dialog":
        by: dict[str, Any] = {
            "channel": F("session__channel"),
            "chat_id": F("session__chat_id"),
            "dialog_id": F("session__dialog_id"),
            "title": F("session__title"),
            "session_pk": F("session_id"),
        }
    elif group == "user":
        by = {"username": F("owner__username")}
    elif group == "model":
        by = {"asked": F("model")}
    else:
        by = {"day": TruncDate("finished_at")}
    rows = []
    found = cast(Iterable[dict[str, Any]], turns.values(**by).annotate(**_sums()).order_by())
    for row in found:
        if not row["turns"]:
            continue
        if group == "dialog":
            key, label = f"{row['channel']}:{row['chat_id']}:{row['dialog_id']}", row["title"]
        elif group == "user":
            key = label = row["username"]
        elif group == "model":
            key = label = row["asked"] or "-"
        else:
            key = label = row["day"].isoformat()
        rows.append({"key": key, "label": label, **_ints(row)})
    return rows


def usage_sum_rows(rows: Iterable[dict[str, Any]]) -> dict[str, int]:
    """The totals of a table of `usage_rows` (with `total_tokens` where the rows have it)."""
    names = (*FIELDS, "turns", "total_tokens")
    total = dict.fromkeys(names, 0)
    for row in rows:
        for name in names:
            total[name] += int(row.get(name, 0))
    return total
