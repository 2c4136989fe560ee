"""Helpers and fixtures shared by the storage test files."""

from __future__ import annotations

from typing import Any

from django.db import OperationalError

from sessions_app import services
from sessions_app.models import Message, MessageKind, Role, Session

MESSAGE_TABLE = "sessions_app_message"
SESSION_TABLE = "sessions_app_session"


# --- helpers ------------------------------------------------------------------------------


def create(user: Any, dialog_id: str | None = "default", **kw: Any) -> Session:
    return services.session_create(
        owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id=dialog_id, **kw
    )


def user_msg(text: str) -> services.NewMessage:
    return services.NewMessage(role=Role.USER, content=text, kind=MessageKind.USER_INPUT)


def assistant_msg(text: str) -> services.NewMessage:
    return services.NewMessage(role=Role.ASSISTANT, content=text, kind=MessageKind.ASSISTANT)


def stored_seqs(session: Session) -> list[int]:
    return list(
        Message.objects.filter(session_id=session.pk).order_by("seq").values_list("seq", flat=True)
    )


def fresh(session: Session) -> Session:
    return Session.objects.get(pk=session.pk)


def writes(sql: str, verb: str, table: str) -> bool:
    """Whether `sql` is, or holds, a `verb` ("INSERT", "UPDATE") on `table` (quoted or not):
    alone, or merged with other writes into one statement (`rows.merged` on PostgreSQL:
    `WITH w0 AS (INSERT INTO ...) UPDATE ...`)."""
    quoted = table if table.startswith('"') else f'"{table}"'
    if quoted in sql and sql.lstrip().upper().startswith(verb):
        return True
    into = " INTO " if verb == "INSERT" else " "
    return f"{verb}{into}{quoted}" in sql


class FailStatements:
    """An execute wrapper that makes the first `failures` matching statements raise, like a
    database that is briefly unavailable; it counts every matching attempt."""

    def __init__(self, table: str, verb: str, failures: int) -> None:
        self.table = f'"{table}"'
        self.verb = verb
        self.remaining = failures
        self.attempts = 0

    def matches(self, sql: str) -> bool:
        return writes(sql, self.verb, self.table)

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if self.matches(sql):
            self.attempts += 1
            if self.remaining > 0:
                self.remaining -= 1
                raise OperationalError("injected: disk I/O error at /secret/path")
        return execute(sql, params, many, context)
