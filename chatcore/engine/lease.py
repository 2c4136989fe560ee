"""The dialog lease and its fencing token (C3, C11, G2; STYLE 17).

A process runs a dialog's turns only while it holds the dialog's lease: `Session.lease_owner`
names the process, `lease_expires_at` says until when, and `lease_epoch` is a fencing token
that grows by one at every acquisition. Every write made for a turn runs `Lease.check()` (or
`Lease.guard()` on a row it has already locked, or `check_all()` for the batched checkpoint
of all the process's turns) inside its own transaction: the session row is locked and the
write goes on only while owner and epoch are still this lease's. A process that lost its
lease (frozen, partitioned, slow) therefore writes nothing, and since events are published
only after such a write commits, it publishes nothing either. Renewal is batched too: one
fenced UPDATE extends every lease the process holds (`renew_all`).

The expiry time is a hint for other processes ("take it over, nobody renewed it"), never a
proof of ownership: the holder trusts its own clock only to keep quiet (`trusted`), and
trusts the database to go on writing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from sessions_app import rows
from sessions_app.models import Session, StagedInput, Turn, TurnStatus
from sessions_app.rows import cursor as sql_cursor

_SESSIONS = Session._meta.db_table
_SESSIONS_QUOTED = f'"{_SESSIONS}"'


@dataclass(frozen=True)
class Waiting:
    """Rows of a dialog waiting for its lease holder: a table and the status they wait in."""

    table: str
    status: str

    @property
    def params(self) -> tuple[str]:
        return (self.status,)

    def of(self, session_pk: str) -> bool:
        """Whether the dialog has such rows (one statement; no lease involved)."""
        sql = (
            f'SELECT 1 FROM "{self.table}" w'  # noqa: S608 (our own tables)
            ' WHERE w."session_id" = %s AND w."status" = %s LIMIT 1'
        )
        with sql_cursor() as cursor:
            cursor.execute(sql, [session_pk, self.status])
            return cursor.fetchone() is not None

    def sql(self, dialog: str) -> str:
        """A SELECT of such rows of the dialog aliased `dialog` (one parameter: the status)."""
        return (
            f'SELECT 1 FROM "{self.table}" w'  # noqa: S608 (our own tables)
            f' WHERE w."session_id" = {dialog}."id" AND w."status" = %s'
        )


QUEUED_TURNS = Waiting(Turn._meta.db_table, TurnStatus.QUEUED)
# A turn started under the lease of a lingering worker (`admission.admit_and_start`), which that
# worker is about to run.
RUNNING_TURNS = Waiting(Turn._meta.db_table, TurnStatus.RUNNING)
STAGED_INPUTS = Waiting(StagedInput._meta.db_table, StagedInput.Status.STAGED)


class LeaseLost(Exception):
    """This process no longer holds the dialog's lease at the epoch it ran with (G2)."""


@dataclass
class Lease:
    """A lease this process acquired: which dialog, whose, at which epoch."""

    session_pk: str
    owner: str
    epoch: int
    seconds: float
    # When the database last confirmed the lease (monotonic clock; it keeps counting while a
    # process is frozen, so a thawed holder knows it may have been replaced).
    confirmed_at: float = field(default_factory=time.monotonic)
    lost: bool = False
    released: bool = False

    def matches(self, session: Session) -> bool:
        """Whether `session`'s row (locked by the caller) still shows this lease."""
        return session.lease_owner == self.owner and session.lease_epoch == self.epoch

    def check(self) -> None:
        """Inside a transaction: lock the session row and fail unless this lease is still the
        current one. Call it before the first write of the transaction."""
        held = (
            Session.objects.select_for_update()
            .filter(pk=self.session_pk, lease_owner=self.owner, lease_epoch=self.epoch)
            .values_list("pk", flat=True)
            .first()
        )
        if held is None:
            self.lost = True
            raise LeaseLost(self.session_pk)

    def confirm(self, waiting: Waiting | None = None) -> bool:
        """`check()` for a read that writes nothing: fail unless this lease is still the
        current one, without locking the row (nor, on SQLite, taking the write lock).
        `waiting`: whether the dialog has rows of that kind waiting (queued turns, staged
        inputs), read in the same statement and returned (else True). It runs after every
        turn and at every step boundary, so it is written in SQL."""
        return self.waiting(*(() if waiting is None else (waiting,)))[0]

    def waiting(
        self, *kinds: Waiting, also: Sequence[tuple[str, list[Any]]] = ()
    ) -> tuple[bool, ...]:
        """`confirm` for several kinds of waiting rows at once: one statement, whether each
        has rows (in the order given; none given, a one-element True), then the value of
        each boolean expression of `also` (SQL and its parameters)."""
        sql, params = self.waiting_statement(*kinds, also=also)
        with sql_cursor() as cursor:
            cursor.execute(sql, params)
            return self.waiting_row(cursor.fetchone())

    def waiting_statement(
        self, *kinds: Waiting, also: Sequence[tuple[str, list[Any]]] = ()
    ) -> tuple[str, list[Any]]:
        """`waiting`'s statement and its parameters, for a caller that sends it with others
        (`committer.commit_outcomes`); `waiting_row` reads its row."""
        columns = [f"EXISTS ({kind.sql('s')})" for kind in kinds] + [sql for sql, _p in also]
        sql = (
            f'SELECT {", ".join(columns) or "1"} FROM "{_SESSIONS}" s'  # noqa: S608
            ' WHERE s."id" = %s AND s."lease_owner" = %s AND s."lease_epoch" = %s'
        )
        params = [
            *(p for kind in kinds for p in kind.params),
            *(p for _sql, values in also for p in values),
            self.session_pk,
            self.owner,
            self.epoch,
        ]
        return sql, params

    def waiting_row(self, row: Sequence[Any] | None) -> tuple[bool, ...]:
        """`waiting`'s answer from its statement's row (None: the lease is lost)."""
        if row is None:
            self.lost = True
            raise LeaseLost(self.session_pk)
        return tuple(bool(value) for value in row)

    def current_on(self, locked: Session, now: datetime) -> bool:
        """Whether the row the caller has just locked still shows this lease, unexpired."""
        expires = locked.lease_expires_at
        return self.matches(locked) and expires is not None and expires >= now

    def guard(self, locked: Session) -> None:
        """The same check on a session row the caller has just locked (no extra query)."""
        if not self.matches(locked):
            self.lost = True
            raise LeaseLost(self.session_pk)

    @property
    def trusted(self) -> bool:
        """Whether this process may still speak for the dialog without asking the database:
        not known lost, and confirmed within one lease period. Used to hold back frames that
        are not database writes (snapshots); writes always `check()`."""
        return (
            not self.lost
            and not self.released
            and time.monotonic() - self.confirmed_at < self.seconds
        )


def acquire(session_pk: str, *, owner: str, seconds: float) -> Lease | None:
    """Take a free or expired lease, raising the epoch, in one statement (G6: a round trip
    before every first token). Not re-entrant: a live lease, ours or another process's, is
    never taken (C11)."""
    now = timezone.now()
    started = time.monotonic()
    table = connection.ops.quote_name(Session._meta.db_table)
    adapt = connection.ops.adapt_datetimefield_value
    with sql_cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET lease_owner = %s, lease_expires_at = %s, "  # noqa: S608
            "lease_epoch = lease_epoch + 1 "
            "WHERE id = %s AND (lease_owner = '' OR lease_expires_at < %s) "
            "RETURNING lease_epoch",
            [owner, adapt(now + timedelta(seconds=seconds)), session_pk, adapt(now)],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    return Lease(session_pk, owner, int(row[0]), seconds, confirmed_at=started)


# Leases per statement in the batched check and renewal: three parameters each stays well
# under SQLite's default limit of 999 bound parameters.
CHUNK = 300


def _chunks(items: Sequence[Lease]) -> Iterator[Sequence[Lease]]:
    for start in range(0, len(items), CHUNK):
        yield items[start : start + CHUNK]


def check_all(leases: Iterable[Lease]) -> None:
    """`check()` for many leases at once, inside the caller's transaction: lock, in one
    statement (per CHUNK leases) and in primary-key order, the session rows still held at
    each lease's owner and epoch. Every other lease is marked `lost`; the caller writes
    nothing for it. Leases already known lost are not asked about again (an epoch only
    grows)."""
    wanted = {(h.session_pk, h.owner, h.epoch): h for h in leases if not h.lost}
    held: set[tuple[str, str, int]] = set()
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    for part in _chunks(list(wanted.values())):
        # Every running turn's dialog, every second: written in SQL (the ORM compiled this
        # OR of conditions slower than the database ran it).
        condition = " OR ".join(
            ['(s."id" = %s AND s."lease_owner" = %s AND s."lease_epoch" = %s)'] * len(part)
        )
        sql = (
            f'SELECT s."id", s."lease_owner", s."lease_epoch" FROM {_SESSIONS_QUOTED} s'  # noqa: S608
            f' WHERE {condition} ORDER BY s."id"{lock}'
        )
        params = [value for h in part for value in (h.session_pk, h.owner, h.epoch)]
        with sql_cursor() as cursor:
            cursor.execute(sql, params)
            held.update((pk, owner, int(epoch)) for pk, owner, epoch in cursor.fetchall())
    for key, h in wanted.items():
        if key not in held:
            h.lost = True


def confirm_all(leases: Sequence[Lease], waiting: Waiting) -> list[bool | LeaseLost]:
    """`confirm(waiting)` for many leases in one statement (the step boundaries of many
    turns, `gather`): for each lease in order, whether its dialog has such rows, or
    `LeaseLost` (the lease is marked lost) when it is no longer the dialog's."""
    found: dict[str, tuple[str, int, bool]] = {}
    for part in _chunks(leases):
        ids = [h.session_pk for h in part]
        params: list[Any]
        if connection.vendor == "postgresql":
            # One text whatever the batch's size: the server plans it once.
            where, params = 's."id" = ANY(%s)', [ids]
        else:
            where, params = f's."id" IN ({", ".join(["%s"] * len(ids))})', ids
        sql = (
            f'SELECT s."id", s."lease_owner", s."lease_epoch", EXISTS ({waiting.sql("s")})'  # noqa: S608
            f" FROM {_SESSIONS_QUOTED} s WHERE {where}"
        )
        with sql_cursor() as cursor:
            cursor.execute(sql, [*waiting.params, *params])
            for pk, owner, epoch, has in cursor.fetchall():
                found[str(pk)] = (owner, int(epoch), bool(has))
    out: list[bool | LeaseLost] = []
    for h in leases:
        row = found.get(h.session_pk)
        if row is None or row[:2] != (h.owner, h.epoch):
            h.lost = True
            out.append(LeaseLost(h.session_pk))
        else:
            out.append(row[2])
    return out


def renew_all(leases: Iterable[Lease]) -> list[Lease]:
    """Extend every lease this process holds in one statement (per owner, lease period and
    CHUNK leases): an UPDATE fenced by owner and epoch that returns the rows it renewed.
    Each renewed lease is confirmed as of just before the statement; every other one was
    taken over and is marked `lost` and returned. Released or lost leases are skipped (an
    expired lease nobody took over is still ours: nobody else can have written). A database
    error propagates and marks nothing: the caller retries at its next beat."""
    groups: dict[tuple[str, float], list[Lease]] = {}
    for h in leases:
        if not h.released and not h.lost:
            groups.setdefault((h.owner, h.seconds), []).append(h)
    table = connection.ops.quote_name(Session._meta.db_table)
    adapt = connection.ops.adapt_datetimefield_value
    lost: list[Lease] = []
    for (owner, seconds), group in groups.items():
        for part in _chunks(group):
            started = time.monotonic()
            expires = adapt(timezone.now() + timedelta(seconds=seconds))
            fenced = " OR ".join(["(id = %s AND lease_epoch = %s)"] * len(part))
            params: list[Any] = [expires, owner]
            for h in part:
                params += [h.session_pk, h.epoch]
            with sql_cursor() as cursor:
                cursor.execute(
                    f"UPDATE {table} SET lease_expires_at = %s "  # noqa: S608
                    f"WHERE lease_owner = %s AND ({fenced}) RETURNING id, lease_epoch",
                    params,
                )
                renewed = {(str(pk), int(epoch)) for pk, epoch in cursor.fetchall()}
            for h in part:
                if (h.session_pk, h.epoch) in renewed:
                    h.confirmed_at = started
                elif not h.released:
                    # A lease released while the statement ran is not lost: its release
                    # cleared the owner first.
                    h.lost = True
                    lost.append(h)
    return lost


def release(lease: Lease) -> None:
    """Give the lease up (only our own epoch: a successor's lease is never cleared)."""
    lease.released = True
    Session.objects.filter(
        pk=lease.session_pk, lease_owner=lease.owner, lease_epoch=lease.epoch
    ).update(lease_owner="", lease_expires_at=None)


def release_if_idle(lease: Lease) -> bool:
    """Give the lease up if the dialog has no queued turn, in one statement: a turn queued
    before it is seen here (False: the holder claims it); one queued after finds the lease
    free (its enqueuer takes it). A turn started under this lease at its admission (handed
    to the holder) keeps it too. Only our own epoch, as `release`. It runs after every
    turn, so it is written in SQL.

    On PostgreSQL the row is locked first, in the same transaction: a statement's
    subqueries see the tables as of its start, so an UPDATE that waited for an admission
    holding the row would not see the turn that admission added; the next statement does.
    Both go in one round trip (`rows.pipelined`).
    SQLite runs one write at a time, so there the statement alone is enough."""
    sql = (
        f'UPDATE "{_SESSIONS}" SET "lease_owner" = %s, "lease_expires_at" = NULL'  # noqa: S608
        ' WHERE "id" = %s AND "lease_owner" = %s AND "lease_epoch" = %s'
        f" AND NOT EXISTS ({QUEUED_TURNS.sql(_SESSIONS_QUOTED)})"
        f" AND NOT EXISTS ({RUNNING_TURNS.sql(_SESSIONS_QUOTED)})"
    )
    params = [*QUEUED_TURNS.params, *RUNNING_TURNS.params]
    locks_rows = connection.features.has_select_for_update
    with transaction.atomic() if locks_rows else nullcontext(), sql_cursor() as cursor:
        if locks_rows:
            with sql_cursor() as locking, rows.pipelined():
                # One round trip: the UPDATE runs once the lock is held, on its own snapshot.
                locking.execute(
                    f'SELECT 1 FROM "{_SESSIONS}" WHERE "id" = %s FOR UPDATE',  # noqa: S608
                    [lease.session_pk],
                )
                cursor.execute(sql, ["", lease.session_pk, lease.owner, lease.epoch, *params])
        else:
            cursor.execute(sql, ["", lease.session_pk, lease.owner, lease.epoch, *params])
        released = cursor.rowcount == 1
    if released:
        lease.released = True
    return released
