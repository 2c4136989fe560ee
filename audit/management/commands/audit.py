"""`manage.py audit [--since ISO-8601] [--action NAME]`: the audit trail as JSON lines, oldest
first (SPEC H5, PROTOCOL "Audit"), for a log collector (SIEM) to take in."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from audit.models import Action, AuditEvent


def parse_since(value: str) -> datetime:
    try:
        when = datetime.fromisoformat(value)
    except ValueError as exc:
        raise CommandError(
            f"--since {value!r} is not an ISO-8601 date or time (e.g. 2026-01-31T08:00:00Z)."
        ) from exc
    # A time without an offset is read as UTC, the time zone of the stored records.
    return when if timezone.is_aware(when) else when.replace(tzinfo=UTC)


def event_json(event: AuditEvent) -> dict[str, Any]:
    return {
        "id": event.pk,
        "at": event.at.isoformat(),
        "actor": event.actor,
        "actor_id": event.actor_user_id,
        "action": event.action,
        "target": {"type": event.target_type, "id": event.target_id},
        "details": event.details,
        "ip": event.ip,
    }


class Command(BaseCommand):
    help = "Print audit records as JSON lines, oldest first."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--since", help="only records at or after this ISO-8601 time")
        parser.add_argument(
            "--action",
            action="append",
            choices=Action.values,
            metavar="NAME",
            help="only this action (repeat for several): " + ", ".join(Action.values),
        )

    def handle(self, *args: Any, **options: Any) -> None:
        events = AuditEvent.objects.order_by("at", "id")
        if options["since"]:
            events = events.filter(at__gte=parse_since(options["since"]))
        if options["action"]:
            events = events.filter(action__in=options["action"])
        for event in events.iterator(chunk_size=2000):
            self.stdout.write(json.dumps(event_json(event), ensure_ascii=False, sort_keys=True))
