"""Bearer-token authentication shared by the REST API and the WebSocket (F2)."""

from __future__ import annotations

import hashlib

from django.contrib.auth.models import User
from django.utils import timezone

from .models import ApiToken


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def user_for_token(raw: str | None) -> User | None:
    """The active user behind a live token, recording when it was last used."""
    token = token_for_raw(raw)
    return token.user if token is not None else None


def token_for_raw(raw: str | None) -> ApiToken | None:
    """The live token of an active user (its `user` loaded), recording when it was last
    used."""
    if not raw:
        return None
    token = (
        ApiToken.objects.select_related("user")
        .filter(key_hash=hash_token(raw.strip()), revoked_at__isnull=True)
        .first()
    )
    if token is None or not token.user.is_active:
        return None
    now = timezone.now()
    if token.last_used_at is None or (now - token.last_used_at).total_seconds() > 60:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token


def tokens_for_raw(raws: list[str]) -> list[ApiToken | None]:
    """`token_for_raw` of several keys in one statement (the sockets of a reconnect storm,
    `ws_auth`), in order; the last-used stamps that are due in one more."""
    hashes = [hash_token(raw.strip()) for raw in raws]
    found = {
        token.key_hash: token
        for token in ApiToken.objects.select_related("user").filter(
            key_hash__in=set(hashes), revoked_at__isnull=True
        )
        if token.user.is_active
    }
    now = timezone.now()
    due = [
        token.pk
        for token in found.values()
        if token.last_used_at is None or (now - token.last_used_at).total_seconds() > 60
    ]
    if due:
        ApiToken.objects.filter(pk__in=due).update(last_used_at=now)
    return [found.get(digest) for digest in hashes]


def bearer_from_header(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, rest = value.partition(" ")
    if scheme.lower() != "bearer" or not rest.strip():
        return None
    return rest.strip()
