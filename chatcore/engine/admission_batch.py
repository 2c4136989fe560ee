"""A burst's admissions on PostgreSQL (C1, C2, F7, G6): sends to idle dialogs admitted and
their turns started a transaction per batch (`admit_and_start_many`; the engine gathers them,
`gather.Gathered`); what a batch does not start goes alone (`admission.admit_and_start`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, transaction

from chatcore.common.errors import Overloaded, QueueFull
from sessions_app.models import Session

from . import admission_lock
from .admission import start_locked
from .gather import ALONE
from .ingress import Ack, Inbound
from .queue import QueueState, Started
from .sessions import SessionStates

logger = logging.getLogger(__name__)


@dataclass
class Admission:
    """One send of a batch admitted together (`admit_and_start_many`): a send or steer that
    may start its turn under a new lease for `start_as` (no lingering worker's lease, no
    chat app's `accept`). `on_started` and `context_chars` as for
    `admission.admit_and_start`."""

    inbound: Inbound
    session: Session
    start_as: str
    on_started: Callable[[Started], None] | None = None
    context_chars: int | None = None


# `admit_and_start_many`'s outcome of one send: its ack and started turn, or `ALONE` (it is
# admitted on its own, `admission.admit_and_start`, after the batch).
AdmissionOutcome = tuple[Ack, Started] | object


def admit_and_start_many(
    batch: list[Admission], *, cfg: dict[str, Any], states: SessionStates
) -> list[AdmissionOutcome]:
    """`admission.admit_and_start` for many sends to idle dialogs at once, on PostgreSQL, in one
    transaction (G6: a burst's admissions cost a few transactions, not one each). The
    batch's dialogs and its senders are distinct (one send of each per batch, the caller's
    rule).

    One round trip reads the sends' turn contexts, locks the dialogs' rows, then the
    senders' rows, skipping any row another transaction holds, and reads every dialog's queue
    and F7 counts after those locks. A batch never waits for a lock, so it is never part of
    a circle of transactions waiting on each other (a lease renewal locks many dialogs in the
    order it finds them, another process's batch locks its own), and one contended row holds
    up no other send of the batch: the send whose dialog or sender was skipped goes alone,
    and waits there. Then each started turn's writes are its one statement (`rows.merged`).

    A send that does not start there and then (its row held elsewhere, a dialog busy or
    gone, a lease live elsewhere, inputs staged, no free slot, a full queue) is left alone
    (`ALONE`): the
    caller admits it on its own after this transaction, which refuses or queues it exactly
    as for any send. An error of the transaction itself leaves every send to go alone (with
    its retries)."""
    outcomes: list[AdmissionOutcome] = [ALONE] * len(batch)

    def write() -> list[tuple[int, Ack, Started]]:
        done: list[tuple[int, Ack, Started]] = []
        with transaction.atomic():
            confirmed = time.monotonic()
            found = admission_lock.lock_many(batch)
            for i, admission in enumerate(batch):
                # Its writes one statement (`rows.merged`).
                started = _start_one(admission, found, cfg=cfg, confirmed=confirmed)
                if started is not None:
                    ack = Ack(
                        started.session,
                        str(started.turn.pk),
                        0,
                        "send",
                        admission.inbound.client_msg_id,
                    )
                    done.append((i, ack, started))
            for i, _ack, started in done:
                if batch[i].on_started is not None:
                    batch[i].on_started(started)  # type: ignore[misc]
        return done

    try:
        done = write()
    except DatabaseError as exc:
        # Rolled back: nothing of it stays, and each send is admitted on its own.
        logger.warning("a batch of %d admissions failed; each goes alone: %s", len(batch), exc)
        return outcomes
    for i, ack, started in done:
        if started.appended is not None:
            # Its user message, in the history this process holds (A4: once committed), as
            # a send admitted alone records it: without it, the turn's answer no longer
            # followed what the cache held, the dialog's history was dropped, and its next
            # build read the whole window again.
            states.apply_appended(started.appended)
        outcomes[i] = (ack, started)
    return outcomes


def _start_one(
    admission: Admission,
    found: dict[str, tuple[Session, QueueState]],
    *,
    cfg: dict[str, Any],
    confirmed: float,
) -> Started | None:
    """`admit_and_start_many`'s start of one send on its locked row: the started turn, or
    None (it goes alone)."""
    got = found.get(str(admission.session.pk))
    if got is None:
        return None  # gone: refused on its own (NotFound)
    live, state = got
    if state.busy or state.staged:
        return None
    try:
        return start_locked(
            admission.inbound,
            live,
            state,
            owner=admission.start_as,
            cfg=cfg,
            confirmed=confirmed,
        )
    except (QueueFull, Overloaded):
        return None  # refused on its own, as any send
