"""The `sessions` list of each user with a socket on this process, read once and shared by
all of them (PROTOCOL "On connect", issue 57).

A reconnect storm brings every socket of a user back at once, each asking for the same
list. Read from the database for each, the list cost most of a connect (two queries and a
model instance per dialog); here it is read once per user and kept while it is known to be
current:

- it is kept only while some socket of the user on this process (a *watcher*) has joined
  every group whose messages announce a change of it (the web chat's, the user's API and
  terminal chats', linked chat apps' chats), since before the list was read: every change a
  list shows (a dialog made, deleted or restored, renamed, given a model, a message added)
  is published to those groups (`publish.publish_to_chat`), so a change made after the read
  is heard here;
- the process's channel layer tells it of every message of those groups as the layer sends
  it (the embedded layer, `heard`) or as it reaches a watching socket's queue (the Redis
  layer, `heard_on`), not when a consumer gets to it (`publish.listen`), so no socket that
  joins meanwhile is told a list older than what it will be sent next; the list is dropped
  then and read again by the next socket that asks;
- a list read while a message of those groups was heard is not kept (the read may have
  missed the change), nor one whose groups its readers had not all joined before the read;
- frames the layer watch found lost (a Redis connection lost) drop every list, and a
  list is kept `SESSIONS_CACHE_SECONDS` at most, whatever was heard: changes nobody announces
  (another program writing to the embedded database) show within that time.

A layer other than the project's own cannot tell, so nothing is kept on it. Everything here
runs on the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from datetime import timedelta
from typing import Any

from django.utils import timezone

from chatcore.common import events, publish
from sessions_app.models import Session


class SessionList:
    """One user's `sessions` list as read (`clientstate.sessions_listing`), shared by every
    socket of the user (never changed once made)."""

    __slots__ = ("items", "etag", "web", "groups", "members", "read_at")

    def __init__(self, items: list[dict[str, Any]], web: list[Session], groups: frozenset[str]):
        self.items = items
        # The dialogs of the web chat, most recently active first (B1 resolution from here).
        self.web = web
        # The groups of the other chats the list shows (the user's API and terminal chats,
        # linked chat apps' chats): a socket showing it follows their deltas and renames.
        self.groups = groups
        self.members = frozenset(item["session_id"] for item in items)
        self.etag = etag_of(items)
        self.read_at = time.monotonic()

    def frame(self, current: Any | None) -> dict[str, Any]:
        """The `sessions` frame of a socket whose current dialog is `current`."""
        return {**events.sessions_frame(current=current, items=self.items), "etag": self.etag}

    def unchanged_frame(self, current: Any | None) -> dict[str, Any]:
        """PROTOCOL "On connect": the list the client holds (its `sessions_etag`) is this one;
        no items."""
        frame = events.sessions_frame(current=current, items=[])
        del frame["items"]
        return {**frame, "unchanged": True, "etag": self.etag}

    def with_newest(self, session: Session) -> SessionList:
        """This list with `session` (a dialog of its chat made after the read) first."""
        return SessionList(
            [events.session_item(session), *self.items], [session, *self.web], self.groups
        )

    def resolved(self, requested: str | None, ttl_seconds: int) -> Session | None:
        """B1 from the list: the requested dialog, else the most recently active one if
        within the TTL; None when the list cannot tell (the dialog is older than the list's,
        or none is recent: a new one is made)."""
        if requested:
            return self.web_dialog(requested)
        if not self.web:
            return None
        latest = self.web[0]
        recent = latest.last_active_at >= timezone.now() - timedelta(seconds=ttl_seconds)
        return latest if recent else None

    def web_dialog(self, dialog_id: str) -> Session | None:
        for session in self.web:
            if session.dialog_id == dialog_id:
                return session
        return None


def etag_of(items: list[dict[str, Any]]) -> str:
    """A stable digest of what a list shows: every field of every item, in order (the same
    list gives the same etag in every process and after a restart)."""
    return hashlib.blake2b(events.frame_text({"items": items}).encode(), digest_size=12).hexdigest()


class Ticket:
    """What a read of a user's list was started under: the user's count of changes heard and
    the groups followed then."""

    __slots__ = ("epoch", "groups")

    def __init__(self, epoch: int, groups: frozenset[str]) -> None:
        self.epoch = epoch
        self.groups = groups


class _Watched:
    __slots__ = ("sockets", "epoch", "listing")

    def __init__(self) -> None:
        # The groups each watching socket (by its channel name) has joined.
        self.sockets: dict[str, frozenset[str]] = {}
        self.epoch = 0
        self.listing: SessionList | None = None

    def groups(self) -> frozenset[str]:
        out: set[str] = set()
        for joined in self.sockets.values():
            out |= joined
        return frozenset(out)


class SessionLists:
    """The per-process lists (see the module docstring); `max_age`: seconds a list is kept at
    most (`CHAT["SESSIONS_CACHE_SECONDS"]`, 0: never kept)."""

    def __init__(self, max_age: float) -> None:
        self.max_age = max_age
        self.enabled = False  # until a layer that tells of its groups' messages is attached
        self._users: dict[int, _Watched] = {}
        # group -> users (and how many of their sockets) whose lists it announces changes of
        self._by_group: dict[str, Counter[int]] = {}
        # The user of each watching socket, by its channel.
        self._owners: dict[str, int] = {}
        # Reads under way, by user: (the list, the user's epoch when the read began).
        self._reading: dict[int, asyncio.Future[tuple[SessionList, int]]] = {}
        self.reads = 0  # lists read (not served from here), for tests and benchmarks

    def attach(self, layer: Any) -> None:
        self.enabled = self.max_age > 0 and publish.listen(layer, self)

    # --- sockets --------------------------------------------------------------------------

    def watch(self, user_id: int, channel: str, groups: Iterable[str]) -> None:
        """A socket of the user has joined `groups` (more with later calls)."""
        watched = self._users.get(user_id)
        if watched is None:
            watched = self._users[user_id] = _Watched()
        self._owners[channel] = user_id
        before = watched.sockets.get(channel, frozenset())
        joined = frozenset(groups)
        if before and not joined <= before:
            joined = before | joined
        elif before:
            return
        watched.sockets[channel] = joined  # the caller's own set when it is one (shared)
        for group in joined - before:
            users = self._by_group.get(group)
            if users is None:
                users = self._by_group[group] = Counter()
            users[user_id] += 1

    def unwatch(self, user_id: int, channel: str) -> None:
        self._owners.pop(channel, None)
        watched = self._users.get(user_id)
        if watched is None:
            return
        for group in watched.sockets.pop(channel, frozenset()):
            users = self._by_group.get(group)
            if users is not None:
                users[user_id] -= 1
                if users[user_id] <= 0:
                    del users[user_id]
                    if not users:
                        del self._by_group[group]
        if not watched.sockets:
            del self._users[user_id]  # nobody hears its changes any more: its list goes

    def known_groups(self, user_id: int) -> frozenset[str]:
        """The other chats' groups of the user's last list (a socket joins them with its
        own, before it reads)."""
        watched = self._users.get(user_id)
        if watched is None:
            return frozenset()
        if watched.listing is not None:
            return watched.listing.groups
        return watched.groups()

    # --- lists ----------------------------------------------------------------------------

    def get(self, user_id: int) -> SessionList | None:
        watched = self._users.get(user_id)
        if watched is None or watched.listing is None:
            return None
        if time.monotonic() - watched.listing.read_at > self.max_age:
            watched.listing = None
            return None
        return watched.listing

    def ticket(self, user_id: int) -> Ticket | None:
        """Taken before a read of the user's list: `put` keeps the list only if nothing was
        heard meanwhile."""
        watched = self._users.get(user_id)
        if watched is None or not self.enabled:
            return None
        return Ticket(watched.epoch, watched.groups())

    async def read(
        self,
        user_id: int,
        chat_group: str,
        reader: Callable[[], Awaitable[SessionList]],
    ) -> SessionList:
        """The user's list as `reader` reads it, kept when it may be (`put`). The sockets of
        the user that ask while a read is under way share it, unless something was heard
        since it began (the read may have missed it): then they read again."""
        pending = self._reading.get(user_id)
        if pending is not None:
            listing, epoch = await asyncio.shield(pending)
            watched = self._users.get(user_id)
            if watched is not None and watched.epoch == epoch:
                return listing
        ticket = self.ticket(user_id)
        done: asyncio.Future[tuple[SessionList, int]] = asyncio.get_running_loop().create_future()
        self._reading[user_id] = done
        try:
            listing = await reader()
        except BaseException as exc:
            done.set_exception(exc)
            done.exception()  # retrieved: a read nobody shared logs nothing
            raise
        finally:
            if self._reading.get(user_id) is done:
                del self._reading[user_id]
        self.put(user_id, listing, ticket, chat_group)
        done.set_result((listing, ticket.epoch if ticket is not None else -1))
        return listing

    def put(
        self, user_id: int, listing: SessionList, ticket: Ticket | None, chat_group: str
    ) -> None:
        self.reads += 1
        watched = self._users.get(user_id)
        if (
            ticket is None
            or watched is None
            or watched.epoch != ticket.epoch
            or not (listing.groups | {chat_group}) <= ticket.groups
        ):
            return
        watched.listing = listing

    # --- publish.GroupListener --------------------------------------------------------------

    def heard(self, group: str) -> None:
        users = self._by_group.get(group)
        if not users:
            return
        for user_id in users:
            watched = self._users.get(user_id)
            if watched is not None:
                watched.epoch += 1
                watched.listing = None

    def heard_on(self, channel: str) -> None:
        """A message for the socket `channel` (a group's or its own) reached this process."""
        user_id = self._owners.get(channel)
        if user_id is not None:
            watched = self._users.get(user_id)
            if watched is not None:
                watched.epoch += 1
                watched.listing = None

    def lost(self) -> None:
        for watched in self._users.values():
            watched.epoch += 1
            watched.listing = None
