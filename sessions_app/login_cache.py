"""Socket logins looked up once and reused for a few seconds (SPEC F2, F8; issue 57).

A reconnect storm brings every socket of a login back at once (a user's tabs, a program's
connections). Each used to look its login up: a token's row and its user, or a Django
session's row, its user and the session's password hash, through a database thread each.
Here a login found is kept `CHAT["LOGIN_CACHE_SECONDS"]` (2 s by default) for the next
socket of the same token or session key:

- ending a login in this process (logout, a token revoked or deleted, a user deactivated or
  deleted: `logins.end_logins`) drops what is kept of it at once, and again when that change
  commits, so no socket opened after it rides on it;
- a login ended by another process announces it to the login's groups: a socket of that
  login here hears it (`login.ended`) and drops what is kept of it;
- a login ended unannounced (a bulk update, another program's write) is found by the
  periodic re-check of every socket's login (`logins.LoginWatch`, every
  `LOGIN_CHECK_SECONDS`): a socket opened on a kept lookup meanwhile is closed within the sum
  of both, 5 s (F8).

Keys are a digest of the token or the session key itself (the cookie's value); only live
logins are kept, and at most `MAX_ENTRIES`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any, Generic, Protocol, TypeVar

from django.conf import settings


class Credential(Protocol):
    """What the cache reads of a login (`logins.Login`) to forget it."""

    @property
    def user_id(self) -> int: ...

    @property
    def session_key(self) -> str | None: ...

    @property
    def token_id(self) -> int | None: ...


L = TypeVar("L", bound=Credential)

MAX_ENTRIES = 100_000


class LoginCache(Generic[L]):
    """Logins by key (`token_key`, `session_key_of`), each kept `max_age` seconds."""

    def __init__(self, max_age: float | None = None) -> None:
        self._max_age = max_age
        self._entries: dict[str, tuple[float, Any, L]] = {}
        self._lock = threading.Lock()

    @property
    def max_age(self) -> float:
        if self._max_age is not None:
            return self._max_age
        return float(settings.CHAT.get("LOGIN_CACHE_SECONDS", 2))

    def get(self, key: str) -> tuple[Any, L] | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            if time.monotonic() >= found[0]:
                del self._entries[key]
                return None
            return found[1], found[2]

    def put(self, key: str, user: Any, login: L) -> None:
        max_age = self.max_age
        if max_age <= 0:
            return
        now = time.monotonic()
        with self._lock:
            if len(self._entries) >= MAX_ENTRIES:
                self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
                if len(self._entries) >= MAX_ENTRIES:
                    self._entries.clear()
            self._entries[key] = (now + max_age, user, login)

    def forget(
        self,
        *,
        user_ids: Iterable[int] = (),
        session_keys: Iterable[str] = (),
        token_ids: Iterable[int] = (),
    ) -> None:
        """Drop every kept login of these users, sessions or tokens."""
        users, keys, tokens = set(user_ids), set(session_keys), set(token_ids)
        if not (users or keys or tokens):
            return
        with self._lock:
            self._entries = {
                key: entry
                for key, entry in self._entries.items()
                if entry[2].user_id not in users
                and entry[2].session_key not in keys
                and entry[2].token_id not in tokens
            }

    def forget_login(self, login: L) -> None:
        self.forget(
            session_keys=[login.session_key] if login.session_key else [],
            token_ids=[login.token_id] if login.token_id is not None else [],
        )


def token_key(digest: str) -> str:
    """The key of a bearer token, by its stored digest (`auth.hash_token`)."""
    return "t:" + digest


def session_key_of(session_key: str) -> str:
    return "s:" + session_key


_cache: LoginCache[Any] | None = None
_cache_lock = threading.Lock()


def cache() -> LoginCache[Any]:
    """This process's cache (made on first use)."""
    global _cache
    if _cache is None:
        with _cache_lock:
            if _cache is None:
                _cache = LoginCache()
    return _cache
