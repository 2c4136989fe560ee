"""Logins and the live connections that ride on them (SPEC F8, PROTOCOL "Other URLs").

A login is what let a connection in: a Django session (the browser's cookie) or an API token,
always of one user. Ending it ends its open WebSockets (closed with 4401) and SSE streams
within seconds, in every server process:

- Events. Logout (`user_logged_out`, or the session row deleted: logout, login as someone
  else, an operator deleting sessions), a token revoked or deleted, a user deactivated or
  deleted, a password changed: `end_logins` sends `login.ended` on commit to the login's
  channel-layer group (one per session key, per token, per user), which every connection of
  that login joined, whichever process it is on.
- A fallback that holds when an event is missed (a bulk `update()`, a session expiring, a
  process that could not reach the layer): each process re-checks the logins of its own live
  connections together, every `CHAT["LOGIN_CHECK_SECONDS"]`, with one query per kind
  (sessions, tokens, users) whatever the number of connections (`LoginWatch`).

This module owns the login group names and the `login.ended` message; the consumer and the
SSE stream only join the groups and end when the message arrives.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.contrib.auth import HASH_SESSION_KEY, get_user_model, user_logged_out
from django.db import transaction
from django.db.models.signals import post_delete, post_save
from django.utils import timezone
from django.utils.crypto import constant_time_compare

from chatcore.common import publish
from chatcore.common.dbthreads import on_db

from . import login_cache

logger = logging.getLogger(__name__)

# The channel-layer message that ends a connection (handled by `ChatConsumer.login_ended`
# and by the SSE stream).
LOGIN_ENDED = "login.ended"
# PROTOCOL: a connection whose login ended is closed with this code.
CLOSE_LOGIN_ENDED = 4401


def user_group(user_id: int) -> str:
    return f"login.u.{user_id}"


def token_group(token_id: int) -> str:
    return f"login.t.{token_id}"


def session_group(session_key: str) -> str:
    # A session key is a credential: only a digest of it goes into group names (Redis).
    digest = hashlib.sha256(session_key.encode()).hexdigest()
    return f"login.s.{digest[:40]}"


@dataclass(frozen=True)
class Login:
    """Who a connection is and through which credential."""

    user_id: int
    session_key: str | None = None
    # The session's auth hash at connect (it changes with the password).
    auth_hash: str | None = None
    token_id: int | None = None

    def groups(self) -> tuple[str, ...]:
        groups = [user_group(self.user_id)]
        if self.session_key:
            groups.append(session_group(self.session_key))
        if self.token_id is not None:
            groups.append(token_group(self.token_id))
        return tuple(groups)


def login_for_session(user: Any, session: Any) -> Login | None:
    """The login of a cookie-authenticated user (`session` is loaded: auth already read it)."""
    key = getattr(session, "session_key", None)
    if user is None or not key:
        return None
    return Login(user_id=user.pk, session_key=key, auth_hash=session.get(HASH_SESSION_KEY))


def login_for_token(user: Any, token_id: int) -> Login:
    return Login(user_id=user.pk, token_id=token_id)


# --- Ending logins --------------------------------------------------------------------------


def end_logins(
    *,
    user_ids: Iterable[int] = (),
    session_keys: Iterable[str] = (),
    token_ids: Iterable[int] = (),
) -> None:
    """F8: close every connection of these logins, in every process, once the change that
    ended them is committed (STYLE 3)."""
    user_ids, session_keys, token_ids = list(user_ids), list(session_keys), list(token_ids)
    groups = [user_group(pk) for pk in user_ids]
    groups += [session_group(key) for key in session_keys if key]
    groups += [token_group(pk) for pk in token_ids]
    if groups:
        # No socket opened from now on reuses a lookup of these logins (`login_cache`); once
        # more at the commit, for a lookup made meanwhile from before the change.
        def forget() -> None:
            login_cache.cache().forget(
                user_ids=user_ids, session_keys=session_keys, token_ids=token_ids
            )

        forget()
        transaction.on_commit(forget)
        transaction.on_commit(lambda: _broadcast(groups))


def _broadcast(groups: list[str]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return

    async def send() -> None:
        for group in groups:
            await layer.group_send(group, {"type": LOGIN_ENDED})

    try:
        # From a view or the admin this runs in the server's loop (asgiref hands the call
        # back to it); elsewhere in a loop of its own.
        async_to_sync(send)()
    except Exception:
        # The periodic re-check still ends these connections (LoginWatch).
        logger.warning("could not announce ended logins %s", groups, exc_info=True)


def _on_logged_out(sender: Any, request: Any, user: Any, **kwargs: Any) -> None:
    session = getattr(request, "session", None)
    key = getattr(session, "session_key", None)
    if key:
        end_logins(session_keys=[key])


def _on_session_deleted(sender: Any, instance: Any, **kwargs: Any) -> None:
    end_logins(session_keys=[instance.session_key])


def _on_user_saved(sender: Any, instance: Any, created: bool, **kwargs: Any) -> None:
    if created:
        return
    if not instance.is_active:
        end_logins(user_ids=[instance.pk])


def _on_user_deleted(sender: Any, instance: Any, **kwargs: Any) -> None:
    end_logins(user_ids=[instance.pk])


def _on_token_saved(sender: Any, instance: Any, created: bool, **kwargs: Any) -> None:
    if instance.revoked_at is not None:
        end_logins(token_ids=[instance.pk])


def _on_token_deleted(sender: Any, instance: Any, **kwargs: Any) -> None:
    end_logins(token_ids=[instance.pk])


def connect_signals() -> None:
    """Called once from the app's `ready()`. A password change needs no receiver: the
    periodic re-check compares the session's auth hash."""
    from .models import ApiToken

    user_model = get_user_model()
    user_logged_out.connect(_on_logged_out, dispatch_uid="f8-logged-out")
    post_save.connect(_on_user_saved, sender=user_model, dispatch_uid="f8-user-saved")
    post_delete.connect(_on_user_deleted, sender=user_model, dispatch_uid="f8-user-deleted")
    post_save.connect(_on_token_saved, sender=ApiToken, dispatch_uid="f8-token-saved")
    post_delete.connect(_on_token_deleted, sender=ApiToken, dispatch_uid="f8-token-deleted")
    model = _session_model()
    if model is not None:
        post_delete.connect(_on_session_deleted, sender=model, dispatch_uid="f8-session-deleted")


def session_store() -> Any:
    return import_module(settings.SESSION_ENGINE).SessionStore


def _session_model() -> Any:
    store = session_store()
    get_model = getattr(store, "get_model_class", None)
    return get_model() if get_model is not None else None


# --- The periodic re-check ------------------------------------------------------------------


def ended_logins(logins: Iterable[Login]) -> set[Login]:
    """Which of these logins no longer hold: a user gone or inactive, a token revoked or
    deleted, a session deleted or expired, or a session whose password hash is stale. One
    query per kind, whatever the number of logins."""
    logins = set(logins)
    if not logins:
        return set()
    users = {
        user.pk: user
        for user in get_user_model().objects.filter(
            pk__in={login.user_id for login in logins}, is_active=True
        )
    }
    token_ids = {login.token_id for login in logins if login.token_id is not None}
    live_tokens: set[int] = set()
    if token_ids:
        from .models import ApiToken

        live_tokens = set(
            ApiToken.objects.filter(pk__in=token_ids, revoked_at__isnull=True).values_list(
                "pk", flat=True
            )
        )
    keys = {login.session_key for login in logins if login.session_key}
    live_keys = _live_session_keys(keys) if keys else set()
    ended: set[Login] = set()
    for login in logins:
        user = users.get(login.user_id)
        if user is None:
            ended.add(login)
        elif login.token_id is not None and login.token_id not in live_tokens:
            ended.add(login)
        elif login.session_key and (
            login.session_key not in live_keys or not _hash_holds(user, login.auth_hash)
        ):
            ended.add(login)
    return ended


def _live_session_keys(keys: set[str]) -> set[str]:
    model = _session_model()
    if model is not None:
        return set(
            model.objects.filter(session_key__in=keys, expire_date__gt=timezone.now()).values_list(
                "session_key", flat=True
            )
        )
    store = session_store()
    if settings.SESSION_ENGINE.endswith("signed_cookies"):
        return keys  # nothing is stored server-side: the other checks still apply
    return {key for key in keys if store().exists(key)}


def _hash_holds(user: Any, auth_hash: str | None) -> bool:
    """Django's own session verification (`django.contrib.auth.get_user`): the hash of the
    current password, under the secret key or one of its fallbacks."""
    if not hasattr(user, "get_session_auth_hash"):
        return True
    if not auth_hash:
        return False
    if constant_time_compare(auth_hash, user.get_session_auth_hash()):
        return True
    return any(constant_time_compare(auth_hash, h) for h in user.get_session_auth_fallback_hash())


class LoginWatch:
    """The logins of this process's live connections (per event loop), re-checked together.
    A connection whose login ended gets `login.ended` on its own channel, so it ends in order
    with everything else it handles."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.entries: dict[str, Login] = {}
        self.task: asyncio.Task[None] | None = None

    def add(self, channel: str, login: Login) -> None:
        self.entries[channel] = login
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())

    def discard(self, channel: str) -> None:
        self.entries.pop(channel, None)
        if not self.entries and self.task is not None:
            # Nothing left to watch: no task outlives the connections (F1).
            self.task.cancel()
            self.task = None

    async def _run(self) -> None:
        while self.entries:
            await asyncio.sleep(self.interval)
            await self.check()

    async def check(self) -> None:
        current = dict(self.entries)
        if not current:
            return
        try:
            ended = await on_db(ended_logins)(current.values())
        except Exception:
            logger.warning("login re-check failed", exc_info=True)
            return
        layer = get_channel_layer()
        for channel, login in current.items():
            if login not in ended or self.entries.get(channel) != login:
                continue
            del self.entries[channel]
            try:
                await layer.send(channel, {"type": LOGIN_ENDED})
            except Exception:
                logger.warning("could not end a connection of an ended login", exc_info=True)


_watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoginWatch] = (
    weakref.WeakKeyDictionary()
)


def watch() -> LoginWatch:
    """The `LoginWatch` of the running loop (one per server process)."""
    loop = asyncio.get_running_loop()
    found = _watches.get(loop)
    if found is None:
        found = _watches[loop] = LoginWatch(float(settings.CHAT["LOGIN_CHECK_SECONDS"]))
    return found


async def join(channel: str, login: Login) -> None:
    """A connection of `login` starts: it joins the login's groups and the re-check."""
    await publish.join(get_channel_layer(), login.groups(), channel)
    watch().add(channel, login)


async def leave(channel: str, login: Login) -> None:
    watch().discard(channel)
    try:
        await publish.leave(get_channel_layer(), login.groups(), channel)
    except Exception:
        logger.warning("leaving the login's groups failed")
