"""The dialog lease and its fencing token (C3, C11, G2; STYLE 17).

A process runs a dialog's turns only while it holds the dialog's lease: `Session.lease_owner`
names the process, `lease_expires_at` says until when, and `lease_epoch` is a fencing token
that grows by one at every acquisition. Every write made for a turn runs `Lease.check()` (or
`Lease.guard()` on a row it has already locked) inside its own transaction: the session row is
locked and the write goes on only while owner and epoch are still this lease's. A process
that lost its lease (frozen, partitioned, slow) therefore writes nothing, and since events
are published only after such a write commits, it publishes nothing either.

The expiry time is a hint for other processes ("take it over, nobody renewed it"), never a
proof of ownership: the holder trusts its own clock only to keep quiet (`trusted`), and
trusts the database to go on writing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import connection
from django.utils import timezone

from sessions_app.models import Session


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

    def _matches(self, session: Session) -> bool:
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

    def guard(self, locked: Session) -> None:
        """The same check on a session row the caller has just locked (no extra query)."""
        if not self._matches(locked):
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
    with connection.cursor() as cursor:
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


def renew(lease: Lease) -> bool:
    """Extend the lease if owner and epoch are unchanged; False (and `lost`) otherwise. An
    expired lease nobody took over is still ours: nobody else can have written."""
    started = time.monotonic()
    renewed = Session.objects.filter(
        pk=lease.session_pk, lease_owner=lease.owner, lease_epoch=lease.epoch
    ).update(lease_expires_at=timezone.now() + timedelta(seconds=lease.seconds))
    if renewed:
        lease.confirmed_at = started
    else:
        lease.lost = True
    return bool(renewed)


def release(lease: Lease) -> None:
    """Give the lease up (only our own epoch: a successor's lease is never cleared)."""
    lease.released = True
    Session.objects.filter(
        pk=lease.session_pk, lease_owner=lease.owner, lease_epoch=lease.epoch
    ).update(lease_owner="", lease_expires_at=None)
