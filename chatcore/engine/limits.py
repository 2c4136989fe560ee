"""Fairness limits (SPEC F7): one user never degrades the others.

Every number comes from `settings.CHAT` (env `CHAT_*`); callers that started under other
settings (an engine keeps the settings it started with) pass their own `cfg`:

- running turns per user (`USER_RUNNING_TURNS`): checked in the database when a worker claims
  a queued turn, so it holds across processes (`turn_may_start`); a dialog held back waits in
  its queue and is started when one of the user's turns ends (`waiting_dialogs`) or by the
  sweep once its owner has a free slot (`not_held_back`);
- concurrent model calls of the process (`MODEL_CALLS_MAX`): `BoundedProvider` makes a call
  wait for a slot instead of ever waiting on the HTTP pool;
- open WebSockets per user (`USER_SOCKETS_MAX`): `SocketRegistry` (one per engine).

The per-user rate budgets are `rates`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection
from django.db.models import Count, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Coalesce

from chatcore.common.dbthreads import Batch
from chatcore.common.ids import FIRST_PARTY_CHANNELS
from sessions_app.models import Session, Turn, TurnStatus
from sessions_app.rows import cursor as sql_cursor

from .provider_types import ChatProvider, Completion, ProviderEvent

logger = logging.getLogger(__name__)


def _cfg(cfg: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return settings.CHAT if cfg is None else cfg


# --- Running turns per user (across processes) ----------------------------------------------


def party(owner_id: int, channel: str, chat_id: str) -> Q:
    """Who a running-turn slot belongs to, as a filter of `Turn`s: on first-party channels
    (web, api, cli) the user, across those channels; on an external platform, one platform
    chat (its account owns every chat of the platform, and one busy chat must not hold up
    the others)."""
    if channel in FIRST_PARTY_CHANNELS:
        return Q(owner_id=owner_id, session__channel__in=FIRST_PARTY_CHANNELS)
    return Q(owner_id=owner_id, session__channel=channel, session__chat_id=chat_id)


_TURNS = Turn._meta.db_table
_SESSIONS = Session._meta.db_table
_USERS = User._meta.db_table
_USER_PK = User._meta.pk.column


def lock_owner(owner_id: int) -> None:
    """Serialise claims of one user's turns (all processes): lock the user's row for the
    claiming transaction, so two dialogs of one user never both take the last slot. SQLite
    needs no lock: its write transactions already run one at a time. It runs before every
    turn starts, so it is written in SQL (the ORM's compilation cost more than the lock)."""
    if connection.features.has_select_for_update:
        with sql_cursor() as cursor:
            cursor.execute(
                f'SELECT 1 FROM "{_USERS}" WHERE "{_USER_PK}" = %s FOR UPDATE',  # noqa: S608
                [owner_id],
            )


def _party_sql(
    turns: str, sessions: str, owner_id: int, channel: str, chat_id: str
) -> tuple[str, list[Any]]:
    """`party` as SQL on the aliases of a turn and its dialog."""
    if channel in FIRST_PARTY_CHANNELS:
        marks = ", ".join(["%s"] * len(FIRST_PARTY_CHANNELS))
        return (
            f'{turns}."owner_id" = %s AND {sessions}."channel" IN ({marks})',
            [owner_id, *sorted(FIRST_PARTY_CHANNELS)],
        )
    return (
        f'{turns}."owner_id" = %s AND {sessions}."channel" = %s AND {sessions}."chat_id" = %s',
        [owner_id, channel, chat_id],
    )


def slot_columns(
    *, owner_id: int, channel: str, chat_id: str, session_id: str, received_at: Any
) -> tuple[str, list[Any]]:
    """F7's two counts for a turn of `session_id` received at `received_at`, as two columns
    of a SELECT (so the admission reads them in the statement of its queue counts): the
    party's running turns, and its other dialogs that wait for a slot (queued, nothing
    running) with an older turn. Our own tables; values are parameters."""
    party = _party_sql("", "", owner_id, channel, chat_id)[1]
    received = connection.ops.adapt_datetimefield_value(received_at)
    params = [
        *party,
        TurnStatus.RUNNING,
        *party,
        TurnStatus.QUEUED,
        received,
        str(session_id),
        TurnStatus.RUNNING,
        *party,
    ]
    return _slot_sql(channel in FIRST_PARTY_CHANNELS), params


@functools.cache
def _slot_sql(first_party: bool) -> str:
    """`slot_columns`' text, made once per kind of party (it runs for every send)."""
    channel = next(iter(FIRST_PARTY_CHANNELS)) if first_party else ""
    running_party = _party_sql("t", "s", 0, channel, "")[0]
    waiting_party = _party_sql("w", "ws", 0, channel, "")[0]
    busy_party = _party_sql("r", "rs", 0, channel, "")[0]
    return (
        f'(SELECT COUNT(*) FROM "{_TURNS}" t INNER JOIN "{_SESSIONS}" s'  # noqa: S608
        f' ON s."id" = t."session_id" WHERE {running_party} AND t."status" = %s) AS "f_running",'
        f' (SELECT COUNT(DISTINCT w."session_id") FROM "{_TURNS}" w INNER JOIN "{_SESSIONS}" ws'
        f' ON ws."id" = w."session_id" WHERE {waiting_party} AND w."status" = %s'
        ' AND w."received_at" < %s AND w."session_id" <> %s AND w."session_id" NOT IN ('
        f'SELECT r."session_id" FROM "{_TURNS}" r INNER JOIN "{_SESSIONS}" rs'
        f' ON rs."id" = r."session_id" WHERE r."status" = %s AND {busy_party})) AS "f_older"'
    )


def slot_free(running: int, older: int, cfg: Mapping[str, Any] | None = None) -> bool:
    """F7 on `slot_columns`' counts: the party has a free slot, and no dialog of theirs that
    waits for one has an older head (so held-back dialogs start in the order they were sent,
    never starved by a busy dialog's next turn)."""
    cap = int(_cfg(cfg)["USER_RUNNING_TURNS"])
    if running >= cap:
        return False
    # The order is a preference, the cap is not: with nothing of theirs running, start now
    # (an older dialog nobody can run, e.g. outside a terminal engine's scope, never blocks).
    return running == 0 or running + older < cap


def turn_may_start(turn: Turn, cfg: Mapping[str, Any] | None = None) -> bool:
    """F7, in the claiming transaction after `lock_owner`: `slot_free` on `slot_columns`,
    one statement. It runs before every claimed turn starts, so it is written in SQL (the
    ORM's compilation of it cost more than the query)."""
    session = turn.session
    columns, params = slot_columns(
        owner_id=turn.owner_id,
        channel=session.channel,
        chat_id=session.chat_id,
        session_id=str(turn.session_id),
        received_at=turn.received_at,
    )
    with sql_cursor() as cursor:
        cursor.execute(f"SELECT {columns}", params)
        running, older = cursor.fetchone()
    return slot_free(int(running or 0), int(older or 0), cfg)


def waiting_dialogs(turn: Turn, cfg: Mapping[str, Any] | None = None) -> list[str]:
    """After `turn` ended: its party's dialogs with queued turns and none running, oldest
    queued turn first, as many as the party has free slots: those to start now (any process
    may take them). One query when nothing waits, the usual case."""
    cap = int(_cfg(cfg)["USER_RUNNING_TURNS"])
    session = turn.session
    where, params = _party_sql("t", "s", turn.owner_id, session.channel, session.chat_id)
    # It runs after every turn, so it is written in SQL (our own tables; values are params).
    sql = (
        f'SELECT t."session_id", MIN(t."received_at") AS "first" FROM "{_TURNS}" t'  # noqa: S608
        f' INNER JOIN "{_SESSIONS}" s ON s."id" = t."session_id"'
        f' WHERE {where} AND t."status" = %s AND NOT EXISTS (SELECT 1 FROM "{_TURNS}" r'
        ' WHERE r."session_id" = t."session_id" AND r."status" = %s)'
        ' GROUP BY t."session_id" ORDER BY "first" LIMIT %s'
    )
    with sql_cursor() as cursor:
        cursor.execute(sql, [*params, TurnStatus.QUEUED, TurnStatus.RUNNING, cap])
        rows = [row[0] for row in cursor.fetchall()]
    if not rows:
        return []
    mine = party(turn.owner_id, session.channel, session.chat_id)
    free = cap - Turn.objects.filter(mine, status=TurnStatus.RUNNING).count()
    return rows[: max(0, free)]


def waiting_elsewhere(turn: Turn) -> tuple[str, list[Any]]:
    """After `turn` ended, as a boolean SQL expression (for a statement the after-turn step
    runs anyway, `after_turn.after_turn_read`): whether another dialog of its party waits for a
    slot (queued turns, none running). Only then is `waiting_dialogs` worth its query; a
    party rarely has one, so most turns end without it."""
    session = turn.session
    where, params = _party_sql("pt", "ps", turn.owner_id, session.channel, session.chat_id)
    sql = (
        f'EXISTS (SELECT 1 FROM "{_TURNS}" pt INNER JOIN "{_SESSIONS}" ps'  # noqa: S608
        f' ON ps."id" = pt."session_id" WHERE {where} AND pt."status" = %s'
        ' AND pt."session_id" <> %s AND NOT EXISTS (SELECT 1 FROM'
        f' "{_TURNS}" pr WHERE pr."session_id" = pt."session_id" AND pr."status" = %s))'
    )
    return sql, [*params, TurnStatus.QUEUED, str(turn.session_id), TurnStatus.RUNNING]


def not_held_back(qs: QuerySet[Session], cfg: Mapping[str, Any] | None = None) -> QuerySet[Session]:
    """Dialogs of `qs` except those whose party already runs the most turns allowed: the
    sweep leaves those alone (they start when one of the party's turns ends). A dialog with
    a turn still marked running stays in: it needs its recovery, whatever the count."""
    cap = int(_cfg(cfg)["USER_RUNNING_TURNS"])
    running = Turn.objects.filter(status=TurnStatus.RUNNING)
    capped_users = (
        running.filter(session__channel__in=FIRST_PARTY_CHANNELS)
        .values("owner_id")
        .annotate(n=Count("pk"))
        .filter(n__gte=cap)
        .values("owner_id")
    )
    chat_running = (
        running.filter(session__channel=OuterRef("channel"), session__chat_id=OuterRef("chat_id"))
        .values("session__channel")
        .annotate(n=Count("pk"))
        .values("n")[:1]
    )
    held = Q(channel__in=FIRST_PARTY_CHANNELS, owner_id__in=capped_users) | (
        ~Q(channel__in=FIRST_PARTY_CHANNELS) & Q(chat_running__gte=cap)
    )
    return qs.annotate(chat_running=Coalesce(Subquery(chat_running), 0)).exclude(
        held & ~Q(pk__in=running.values("session_id"))
    )


# --- Model calls of the process -------------------------------------------------------------


class BoundedProvider:
    """Wraps a provider so at most `limit` model calls of this process stream at once; the
    next waits for a slot (in its dialog's queue, as far as its client can tell), never on
    the HTTP connection pool (F7)."""

    def __init__(self, inner: ChatProvider, limit: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.limit = max(1, limit)
        self._slots = asyncio.Semaphore(self.limit)
        self.active = 0
        self.max_active = 0

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def stream(
        self,
        *,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        purpose: str = "turn",
        max_tokens: int | None = None,
        prepared: Any = None,
        model: str | None = None,
    ) -> AsyncIterator[ProviderEvent]:
        """`prepared`: the request made ahead by the provider's `prepare_request`, if it has
        one (the others are never given any)."""
        completion: Completion | None = None
        # Only for a provider that made it: the others take no such argument.
        ahead = {} if prepared is None else {"prepared": prepared}
        if model is not None:
            ahead["model"] = model  # H4: the dialog's model
        async with self._slots:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            try:
                async for event in self.inner.stream(
                    messages=messages, tools=tools, purpose=purpose, max_tokens=max_tokens, **ahead
                ):
                    if isinstance(event, Completion):
                        # Hand the result over only once the call is over and its slot
                        # free: a caller that stops iterating at the result holds nothing.
                        completion = event
                        continue
                    yield event
            finally:
                self.active -= 1
        if completion is not None:
            yield completion


def bounded(provider: ChatProvider, cfg: Mapping[str, Any] | None = None) -> ChatProvider:
    if isinstance(provider, BoundedProvider):
        return provider
    return BoundedProvider(provider, int(_cfg(cfg)["MODEL_CALLS_MAX"]))


# --- Open WebSockets per user ---------------------------------------------------------------


# F7 across processes: for each socket of a batch, in one atomic step on the server, its
# user's entries past their time go, the socket is added, and when the user's count then
# passes its bound the socket is taken out again (refused). KEYS: each socket's user's set;
# ARGV: now, the TTL, then each socket's id and bound. One reply per socket, 1: counted.
_OPEN_SCRIPT = """
local now = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local out = {}
for i, key in ipairs(KEYS) do
  local conn = ARGV[1 + 2 * i]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  redis.call('ZADD', key, now + ttl, conn)
  if redis.call('ZCARD', key) > tonumber(ARGV[2 + 2 * i]) then
    redis.call('ZREM', key, conn)
    out[i] = 0
  else
    redis.call('EXPIRE', key, ttl)
    out[i] = 1
  end
end
return out
"""


class SocketRegistry:
    """Open WebSockets per user (F7). In embedded mode a process-local count; in scaled mode
    each connection is also a member of a per-user sorted set in Redis, scored by when it
    stops counting (refreshed while it is open), so a crashed process's sockets stop counting
    by themselves and the bound holds across processes."""

    TTL_SECONDS = 90

    def __init__(self) -> None:
        self._local: dict[int, set[str]] = {}
        self._lock = threading.Lock()
        self._redis: Any = None
        self._open_script: Any = None
        # Scaled mode: the sockets of a reconnect storm registered, and closed, a round trip
        # per batch (issue 57): `opens.run((user_id, conn_id, limit))`,
        # `closes.run((user_id, conn_id))`.
        self.opens: Batch[tuple[int, str, int], bool] = Batch("socket-opens", self.open_many)
        self.closes: Batch[tuple[int, str], None] = Batch("socket-closes", self.close_many)

    def open_many(self, items: list[tuple[int, str, int]]) -> list[bool]:
        """`open` of several sockets, their Redis commands in one round trip."""
        shared = self._open_shared_many(items)
        return [
            self._open_local(u, c, n, found) for (u, c, n), found in zip(items, shared, strict=True)
        ]

    def _client(self) -> Any:
        if not settings.SCALED:
            return None
        if self._redis is None:
            import redis

            # I3: connect and reply timeouts (`settings.REDIS_OPTIONS`): a stalled Redis
            # holds a connecting socket a few seconds, then the bound is this process's.
            self._redis = redis.Redis.from_url(settings.REDIS_URL, **settings.REDIS_OPTIONS)
        return self._redis

    def open(self, user_id: int, conn_id: str, limit: int) -> bool:
        """Register a connection; False (and nothing registered) when the user already has
        `limit` open. Blocking I/O in scaled mode: call it off the event loop. With Redis
        unreachable, the bound falls back to this process's count (G5: a Redis restart never
        locks people out)."""
        return self._open_local(
            user_id, conn_id, limit, self._open_shared_many([(user_id, conn_id, limit)])[0]
        )

    def _open_local(self, user_id: int, conn_id: str, limit: int, shared: bool | None) -> bool:
        with self._lock:
            conns = self._local.setdefault(user_id, set())
            if shared is False or (shared is None and len(conns) >= limit):
                if not conns:
                    del self._local[user_id]
                return False
            conns.add(conn_id)
        return True

    def _open_shared_many(self, items: list[tuple[int, str, int]]) -> list[bool | None]:
        """The cross-process answers, or None when there are none (embedded mode, Redis
        down)."""
        client = self._client()
        if client is None:
            return [None] * len(items)
        args: list[Any] = [time.time(), self.TTL_SECONDS]
        for _user_id, conn_id, limit in items:
            args += [conn_id, limit]
        try:
            if self._open_script is None:
                self._open_script = client.register_script(_OPEN_SCRIPT)
            keys = [f"ws:user:{user_id}" for user_id, _c, _n in items]
            replies = self._open_script(keys=keys, args=args, client=client)
            return [bool(reply) for reply in replies]
        except Exception:
            logger.warning("socket registry: Redis unavailable; counting this process only")
            return [None] * len(items)

    def close(self, user_id: int, conn_id: str) -> None:
        self.close_many([(user_id, conn_id)])

    def close_many(self, items: list[tuple[int, str]]) -> list[None]:
        """Closed sockets stop counting: at once here, in one round trip in Redis."""
        with self._lock:
            for user_id, conn_id in items:
                conns = self._local.get(user_id)
                if conns is not None:
                    conns.discard(conn_id)
                    if not conns:
                        del self._local[user_id]
        client = self._client()
        if client is not None:
            try:
                pipe = client.pipeline(transaction=False)
                for user_id, conn_id in items:
                    pipe.zrem(f"ws:user:{user_id}", conn_id)
                pipe.execute()
            except Exception:
                # They stop counting by themselves after TTL_SECONDS.
                logger.warning("socket registry: could not remove %d closed socket(s)", len(items))
        return [None] * len(items)

    def refresh(self) -> None:
        """Scaled mode: keep this process's open connections counted (called periodically)."""
        client = self._client()
        if client is None:
            return
        with self._lock:
            local = {user: set(conns) for user, conns in self._local.items()}
        if not local:
            return
        expires = time.time() + self.TTL_SECONDS
        pipe = client.pipeline()
        for user_id, conns in local.items():
            key = f"ws:user:{user_id}"
            pipe.zadd(key, dict.fromkeys(conns, expires))
            pipe.expire(key, self.TTL_SECONDS)
        pipe.execute()

    def count(self, user_id: int) -> int:
        with self._lock:
            return len(self._local.get(user_id, ()))
