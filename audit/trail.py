"""Writing the audit trail (SPEC H5): `audit_record`, the one function every path calls.

How to record an action (also for features of other modules: shares, imports, files):

    with transaction.atomic():
        ...the change...
        audit_record(actor=actor, action=Action.SHARE_CREATE,
                     target_type=TargetType.SHARE, target_id=str(share.pk),
                     details={"dialog": session.session_id, "owner": owner.username})

- Call it inside the transaction that makes the change: the record commits with the change
  or not at all (a refused or failed action leaves none). It refuses to run outside one.
- `actor` says who: `Actor.of_user(user, ip=..., via=...)` for a person (an owner or an
  operator), `Actor.of_request(request, via="admin")` in a view (its address honours the
  trusted-proxy switch), `Actor.system(via=...)` for sweeps and management commands.
  `via` names the door (`rest`, `websocket`, `telegram`, `admin`, `manage.py issue_token`,
  `sweep`) and is kept in the details.
- `details` is JSON: what an operator needs to read the record later (old and new title,
  counts, the username a token or chat account belongs to). Never secrets or message text.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.http import HttpRequest
from django.utils import timezone

from .models import SYSTEM, Action, AuditEvent, TargetType

__all__ = [
    "USER_FLAGS",
    "Action",
    "Actor",
    "TargetType",
    "audit_purge_expired",
    "audit_account_link",
    "audit_dialog",
    "audit_record",
    "audit_token",
    "audit_user_change",
    "client_ip",
    "dialog_details",
    "scope_ip",
]


@dataclass(frozen=True, slots=True)
class Actor:
    """Who makes a change, and from where."""

    name: str
    user_id: int | None = None
    ip: str | None = None
    via: str = ""

    @classmethod
    def of_user(cls, user: Any, *, ip: str | None = None, via: str = "") -> Actor:
        return cls(name=user.get_username(), user_id=user.pk, ip=ip, via=via)

    @classmethod
    def system(cls, *, via: str = "") -> Actor:
        return cls(name=SYSTEM, via=via)

    @classmethod
    def of_request(cls, request: HttpRequest, *, via: str) -> Actor:
        return cls.of_user(request.user, ip=client_ip(request.META), via=via)


@functools.lru_cache(maxsize=4096)
def _valid_ip(value: str | None) -> str | None:
    """The address in its normal form, or None; a socket storm's addresses repeat (a proxy,
    a NAT), each parsed once."""
    if not value:
        return None
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError:
        return None


def _forwarded(header: str | None) -> str | None:
    # The trusted proxy appends the address it saw: the last entry is the one nobody forged.
    if not header or not settings.TRUST_X_FORWARDED_FOR:
        return None
    return _valid_ip(header.split(",")[-1])


def client_ip(meta: Mapping[str, Any]) -> str | None:
    """An HTTP request's client address (Django's `request.META`)."""
    return _forwarded(meta.get("HTTP_X_FORWARDED_FOR")) or _valid_ip(meta.get("REMOTE_ADDR"))


def scope_ip(scope: Mapping[str, Any]) -> str | None:
    """An ASGI connection's client address (a WebSocket's scope)."""
    headers: Iterable[tuple[bytes, bytes]] = scope.get("headers") or ()
    forwarded = next((v for k, v in headers if k.lower() == b"x-forwarded-for"), None)
    client = scope.get("client")
    peer = str(client[0]) if client else None
    return _forwarded(forwarded.decode("latin-1") if forwarded else None) or _valid_ip(peer)


def audit_record(
    *,
    actor: Actor,
    action: Action,
    target_type: TargetType,
    target_id: str,
    details: Mapping[str, Any] | None = None,
) -> AuditEvent:
    """Record one action, in the caller's transaction (see the module docstring)."""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("audit_record runs inside the transaction of the change it records")
    payload = dict(details or {})
    if actor.via:
        payload["via"] = actor.via
    return AuditEvent.objects.create(
        actor=actor.name[:150],
        actor_user_id=actor.user_id,
        action=action,
        target_type=target_type,
        target_id=str(target_id)[:64],
        details=payload,
        ip=actor.ip,
    )


def dialog_details(session: Any, **extra: Any) -> dict[str, Any]:
    """What identifies a dialog in its records, also after it is purged."""
    return {"session_id": session.session_id, "owner_id": session.owner_id, **extra}


def audit_token(*, actor: Actor | None, action: Action, token: Any) -> AuditEvent:
    """A token's record names the user it acts for (PROTOCOL "Audit"), never its key."""
    return audit_record(
        actor=actor or Actor.system(),
        action=action,
        target_type=TargetType.TOKEN,
        target_id=str(token.pk),
        details={"user": token.user.get_username(), "name": token.name, "prefix": token.prefix},
    )


def audit_dialog(*, actor: Actor | None, action: Action, session: Any, **extra: Any) -> AuditEvent:
    """A dialog's record; `extra` goes into the details (old and new title, a page, ...)."""
    return audit_record(
        actor=actor or Actor.system(),
        action=action,
        target_type=TargetType.DIALOG,
        target_id=str(session.pk),
        details=dialog_details(session, **extra),
    )


def audit_account_link(
    *, actor: Actor | None, account: Any, old_user: Any, user: Any, writable: bool
) -> AuditEvent | None:
    """A chat account linked to a web user (or to another one, or its write right changed),
    or unlinked; nothing when nothing changes. The details name both users."""
    if user is None and old_user is None:
        return None
    if user is not None and user == old_user and writable == account.writable:
        return None
    return audit_record(
        actor=actor or Actor.system(),
        action=Action.CHAT_ACCOUNT_UNLINK if user is None else Action.CHAT_ACCOUNT_LINK,
        target_type=TargetType.CHAT_ACCOUNT,
        target_id=str(account.pk),
        details={
            "account": f"{account.channel}:{account.external_id}",
            "user": user.get_username() if user is not None else None,
            "previous_user": old_user.get_username() if old_user is not None else None,
            "writable": writable if user is not None else False,
        },
    )


# H5: the account flags whose change is recorded.
USER_FLAGS = ("is_active", "is_staff", "is_superuser")


def audit_user_change(*, actor: Actor, user: Any, before: Mapping[str, Any]) -> AuditEvent | None:
    """A user's active, staff or superuser flag changed: one record with each flag's old and
    new value; nothing when none of them changed."""
    changed = {
        name: [before[name], getattr(user, name)]
        for name in USER_FLAGS
        if name in before and before[name] != getattr(user, name)
    }
    if not changed:
        return None
    return audit_record(
        actor=actor,
        action=Action.USER_CHANGE,
        target_type=TargetType.USER,
        target_id=str(user.pk),
        details={"user": user.get_username(), **changed},
    )


def audit_purge_expired(*, now: datetime | None = None) -> int:
    """H5: drop records older than `CHAT_AUDIT_RETENTION_DAYS` (0 keeps them forever)."""
    days = settings.CHAT["AUDIT_RETENTION_DAYS"]
    if days <= 0:
        return 0
    cutoff = (now or timezone.now()) - timedelta(days=days)
    with transaction.atomic():
        return AuditEvent.objects.all().purge_older_than(cutoff)
