"""What a socket opens with (PROTOCOL "On connect", issue 57): its dialog's newest page, or,
for a client that says what it holds, only what came after; with the running turn and the
queue.

Every restart of a server process brings all its clients back at once. Each used to cost a
full connect: the list of dialogs, the newest hundred messages, each read and serialised for
each socket. Here:

- a client that reconnects says what it holds (`Holds`: the dialog, the `history_revision`
  it holds, `since`, and the id of its newest message, `last_id`); when the messages stored
  since follow what it shows (`_after`: each the child of the one before, from its newest on
  to the dialog's head, none missing), it is sent them (usually none) as a `history_delta`
  from `since`, else a `session_history` as for a new client (a gap too old to send as a
  delta, a changed branch, a dialog deleted and made again under the same id);
- a page is made once per dialog and revision and kept, as JSON, for every socket that
  opens the dialog (`Pages`, least recently used first out past its byte budget); made from
  the messages the history cache holds when it holds them (`SessionStates.held`), else read;
- the sockets opening while others' reads are under way are read together
  (`gather.Gathered`): one trip to a database thread and one read transaction for a batch,
  one statement for its dialogs' rows, one for their running and queued turns
  (`connect_reads.dialogs_open`), one for the heads its resumes are checked against.
"""

from __future__ import annotations

import bisect
import threading
import uuid
from collections import OrderedDict
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_plus

from chatcore.common import dbthreads, events
from chatcore.common.dbthreads import on_db_idempotent
from sessions_app import branches, connect_reads, selectors
from sessions_app.models import Message, Session, Turn, TurnStatus

from . import clientstate
from .gather import Gathered
from .lists import SessionLists
from .sessions import SessionState, SessionStates
from .snapshots import LocalTurn

# A client further behind than this many messages reloads the page instead.
RESUME_MAX_MESSAGES = selectors.HISTORY_PAGE_DEFAULT
# A page's newest message ids kept to recognise a delta the page already holds.
RECENT_IDS = 16


@dataclass(frozen=True, slots=True)
class Holds:
    """What a reconnecting client says it holds (query parameters of the socket's URL,
    PROTOCOL "On connect"). A value that does not parse counts as not given."""

    dialog_id: str | None = None
    since: int | None = None
    last_id: str | None = None
    sessions_etag: str | None = None

    @classmethod
    def from_query(cls, query: bytes) -> Holds:
        if not query:
            return cls()
        values: dict[str, str] = {}
        for part in query.decode("latin1").split("&"):
            name, _eq, value = part.partition("=")
            if name not in values:  # the first of a name counts
                values[name] = unquote_plus(value) if "%" in value or "+" in value else value

        def one(name: str, longest: int = 200) -> str | None:
            found = values.get(name)
            return found if found and len(found) <= longest else None

        since = one("since", 20)
        last_id = one("last_id", 40)
        try:
            last_id = str(uuid.UUID(last_id)) if last_id is not None else None
        except ValueError:
            last_id = None
        return cls(
            dialog_id=one("dialog_id"),
            since=int(since) if since is not None and since.isdecimal() else None,
            last_id=last_id,
            sessions_etag=one("sessions_etag", 64),
        )


@dataclass(frozen=True, slots=True)
class Opening:
    """One socket's dialog to open: `session` as its socket found it; `since` and `last_id`
    when the client holds that dialog already."""

    session: Session
    since: int | None = None
    last_id: str | None = None


class Opened:
    """What a socket is sent on opening its dialog: `frame` (a `session_history` or the
    resume's `history_delta`), the running turn in it, and the ids of the newest messages
    the frame holds (a later delta of only those is not sent again)."""

    __slots__ = ("frame", "active_turn", "recent")

    def __init__(
        self, frame: dict[str, Any], active_turn: dict[str, Any] | None, recent: frozenset[str]
    ) -> None:
        self.frame = frame
        self.active_turn = active_turn
        self.recent = recent


class Page:
    """A dialog's newest page at one revision, as its frames' JSON."""

    __slots__ = ("key", "messages", "has_more", "recent", "head_id", "size")

    def __init__(self, key: tuple[Any, ...], frames: list[dict[str, Any]], has_more: bool):
        self.key = key
        self.messages = events.Embedded(frames)
        self.has_more = has_more
        self.recent = frozenset(f["id"] for f in frames[-RECENT_IDS:])
        # The page ends at the dialog's head (H1: the active path's last message).
        self.head_id: str | None = frames[-1]["id"] if frames else None
        self.size = len(self.messages) + 1024


class Pages:
    """The newest page of the dialogs sockets opened, least recently used first out past
    `max_bytes`; used from the database threads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._pages: OrderedDict[str, Page] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, pk: str, key: tuple[Any, ...]) -> Page | None:
        with self._lock:
            page = self._pages.get(pk)
            if page is None or page.key != key:
                return None
            self._pages.move_to_end(pk)
            return page

    def put(self, pk: str, page: Page) -> None:
        with self._lock:
            old = self._pages.pop(pk, None)
            if old is not None:
                self._size -= old.size
            if page.size > self.max_bytes:
                return
            self._pages[pk] = page
            self._size += page.size
            while self._size > self.max_bytes:
                _pk, dropped = self._pages.popitem(last=False)
                self._size -= dropped.size


def _frame(message: Message, forks: Mapping[str, list[int]]) -> dict[str, Any]:
    """A message's frame with its siblings as the dialog's row has them now (H1), whatever an
    older read left on the instance."""
    frame = events.message_frame(message)
    frame.pop("siblings", None)
    kin = forks.get(branches.fork_key(message.parent_seq)) if forks else None
    if kin:
        frame["siblings"] = kin
    return frame


def _held_newest(state: SessionState, session: Session, count: int) -> list[Message] | None:
    """The newest `count` messages of the active path, newest first, from what the history
    cache holds; None when it does not hold enough of them (the page is read instead)."""
    messages = state.messages  # replaced by every change, never changed in place
    messages = messages[: bisect.bisect_right(messages, session.last_seq, key=_seq)]
    if not session.forked:
        if len(messages) < count and state.base_seq > 0:
            return None  # older messages exist that the cache does not hold
        return messages[::-1][:count]
    by_seq = {m.seq: m for m in messages}
    out: list[Message] = []
    at: int | None = session.head_seq or None
    while at is not None and len(out) < count:
        found = by_seq.get(at)
        if found is None:
            return None  # the path goes on below what the cache holds
        out.append(found)
        at = found.parent_seq
    return out


def _seq(message: Message) -> int:
    return message.seq


def _key(session: Session) -> tuple[int, int, int]:
    """What a dialog's page depends on: its generation, revision and head (a head's move
    takes a seq of its own, and so does every append that changes the forks)."""
    return (session.generation, session.last_seq, session.head_seq)


class Openings:
    """The process's openings: the users' lists (`lists`), the dialogs' pages, and the batch
    of reads (see the module docstring). `local_turns`: the turns this process runs."""

    def __init__(
        self,
        *,
        cfg: Mapping[str, Any],
        states: SessionStates,
        local_turns: Mapping[str, LocalTurn],
        spawn: Any,
    ) -> None:
        self.lists = SessionLists(float(cfg.get("SESSIONS_CACHE_SECONDS", 10)))
        self.pages = Pages(int(cfg["PAGE_CACHE_MAX_BYTES"]))
        self.states = states
        self.local_turns = local_turns
        self.page_max_bytes = int(cfg["HISTORY_PAGE_MAX_BYTES"])
        self._batches: Gathered[Opening, Opened] = Gathered(
            "openings",
            self.open_many,
            spawn=spawn,
            alone_limit=max(1, dbthreads.thread_count() // 3),
            max_batch=64,
        )

    def attach(self, layer: Any) -> None:
        self.lists.attach(layer)

    async def layer_lost(self) -> None:
        """The layer watch saw frames lost (G5): what was kept on their word goes."""
        self.lists.lost()

    async def open(self, opening: Opening) -> Opened:
        def alone() -> Coroutine[Any, Any, Opened]:
            return on_db_idempotent(self.open_one)(opening)

        return await self._batches(opening, alone)

    def open_one(self, opening: Opening) -> Opened:
        outcome = self.open_many([opening])[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def open_many(self, openings: list[Opening]) -> list[Opened | BaseException]:
        """Synchronous (ORM): the openings of a batch in one read transaction."""
        pks = [o.session.pk for o in openings]
        out: list[Opened | BaseException] = []
        with selectors.read_transaction():
            rows, turns = connect_reads.dialogs_open(session_pks=pks)
            sessions = [rows.get(o.session.pk, o.session) for o in openings]
            # The heads a client that holds the newest revision must show, unless a page
            # kept says it already.
            heads = connect_reads.head_ids(
                heads=[
                    (s.pk, s.head_seq)
                    for o, s in zip(openings, sessions, strict=True)
                    if o.since == s.last_seq and self.pages.get(s.pk, _key(s)) is None
                ]
            )
            for opening, session in zip(openings, sessions, strict=True):
                try:
                    out.append(self._open(opening, session, turns.get(session.pk, []), heads))
                except Exception as exc:
                    out.append(exc)
        return out

    def _open(
        self, opening: Opening, session: Session, turns: list[Turn], heads: Mapping[str, str]
    ) -> Opened:
        running = next((t for t in turns if t.status == TurnStatus.RUNNING), None)
        snapshot = clientstate.snapshot_of(session, running, self.local_turns)
        queue = [events.queue_item(t) for t in turns if t.status == TurnStatus.QUEUED]
        if opening.since is not None:
            news = self._after(session, opening.since, opening.last_id, heads)
            if news is not None:
                frames = [_frame(m, session.forks) for m in news]
                frame = events.resume_delta_frame(
                    session=session,
                    base_revision=opening.since,
                    messages=frames,
                    active_turn=snapshot,
                    queue=queue,
                )
                return Opened(frame, snapshot, frozenset(f["id"] for f in frames))
        page = self.page(session)
        frame = events.history_page_frame(
            session=session,
            messages=page.messages,
            has_more=page.has_more,
            active_turn=snapshot,
            queue=queue,
        )
        return Opened(frame, snapshot, page.recent)

    def page(self, session: Session) -> Page:
        """The dialog's newest page (`selectors.messages_page`'s), kept for the next socket."""
        key = _key(session)
        page = self.pages.get(session.pk, key)
        if page is not None:
            return page
        limit = selectors.HISTORY_PAGE_DEFAULT
        state = self.states.held(session)
        newest = _held_newest(state, session, limit + 1) if state is not None else None
        if newest is None and not session.forked:
            newest = connect_reads.newest_messages(session_pk=session.pk, count=limit + 1)
        if newest is not None:
            messages, has_more = selectors.newest_page(newest, limit)
        else:
            messages, has_more = selectors.messages_page(
                session_pk=session.pk, limit=limit, session=session
            )
        page = Page(key, [_frame(m, session.forks) for m in messages], has_more)
        self.pages.put(session.pk, page)
        return page

    def _after(
        self, session: Session, since: int, last_id: str | None, heads: Mapping[str, str]
    ) -> list[Message] | None:
        """The messages a client that holds the dialog at revision `since` (its newest message
        `last_id`, else the one of seq `since`) lacks, oldest first, when they follow what it
        shows: each the child of the one before, from its newest message on to the dialog's
        head, with no seq left out (a move of the head takes a seq of its own, H1). None when
        it must load the page instead."""
        if since > session.last_seq or session.last_seq - since > RESUME_MAX_MESSAGES:
            return None
        if since == session.last_seq:
            # Nothing new (a storm's usual case): the client's newest message must be the
            # head, which ends the dialog's page when one is kept, else read for the batch.
            page = self.pages.get(session.pk, _key(session))
            head = page.head_id if page is not None else heads.get(session.pk)
            if head == last_id if last_id else session.head_seq == since:
                return []
            return None
        rows = self._around(session, since, last_id)
        if rows is None:
            return None
        mine = next(
            (m for m in rows if (str(m.id) == last_id if last_id else m.seq == since)), None
        )
        if mine is None or mine.seq > since:
            return None  # not the dialog it held (deleted, cleared, made again)
        news = [m for m in rows if m.seq > since]
        at = mine.seq
        for m in news:
            if m.parent_seq != at:
                return None
            at = m.seq
        if len(news) != session.last_seq - since or at != session.head_seq:
            return None
        if sum(selectors.message_size(m) for m in news) > self.page_max_bytes:
            return None  # more than a page may hold: the page is sent instead
        return news

    def _around(self, session: Session, since: int, last_id: str | None) -> list[Message] | None:
        """The messages after `since` and the client's newest one, in seq order: from the
        history cache when it holds them, else read (at most what a resume may send)."""
        state = self.states.held(session)
        if state is not None and state.base_seq < since:
            messages = state.messages
            start = bisect.bisect_right(messages, since, key=_seq)
            news = messages[start : bisect.bisect_right(messages, session.last_seq, key=_seq)]
            before = messages[:start]
            # The client's newest message is one of the last ones before `since`.
            mine = next(
                (
                    m
                    for m in reversed(before[-RESUME_MAX_MESSAGES:])
                    if (str(m.id) == last_id if last_id else m.seq == since)
                ),
                None,
            )
            if mine is not None:
                return [mine, *news]
        return connect_reads.messages_after(
            session_pk=session.pk, since=since, also_id=last_id, limit=RESUME_MAX_MESSAGES + 1
        )
