"""API tokens (SPEC F2, F8, H5): issue and revoke, each recorded in its own transaction.
`services` re-exports both."""

from __future__ import annotations

import secrets

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from audit.trail import Action, Actor, audit_token

from .models import ApiToken


def api_token_issue(
    *, user: User, name: str = "", actor: Actor | None = None
) -> tuple[ApiToken, str]:
    """Create a token; the plain key is returned once and only its hash is stored (F2)."""
    from .auth import hash_token

    raw = "cc_" + secrets.token_urlsafe(32)
    with transaction.atomic():
        token = ApiToken.objects.create(
            user=user, name=name, prefix=raw[:10], key_hash=hash_token(raw)
        )
        audit_token(actor=actor, action=Action.TOKEN_ISSUE, token=token)
    return token, raw


def api_token_revoke(*, token: ApiToken, actor: Actor | None = None) -> None:
    """F2, F8: the token stops working, and its open sockets and streams end (on commit)."""
    from .logins import end_logins

    with transaction.atomic():
        now = timezone.now()
        if ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=now):
            audit_token(actor=actor, action=Action.TOKEN_REVOKE, token=token)
        end_logins(token_ids=[token.pk])
