"""Admission reads the dialog's queue after it holds the dialog's row (C1, G6): a send that
waited for another transaction on that row (another send that started a turn) sees that
turn, so it never starts a second running turn in the dialog nor reports a stale position.
On PostgreSQL a statement's subqueries see the tables as of its start, so counts read in
the statement that waited for the lock would miss it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connections, transaction

from chatcore.engine import admission_lock
from sessions_app import services
from sessions_app.models import Session, Turn, TurnStatus
from tests.storage_helpers import create

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_dbs]


def test_an_admission_that_waited_for_the_row_sees_the_turn_started_meanwhile(user: Any) -> None:
    # covers: C1, C2 (one running turn per dialog; positions count what is ahead)
    session = create(user, "locked")
    holding, release = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def other_send() -> None:
        try:
            with transaction.atomic():
                live = services.lock_session(session.pk)
                assert live is not None
                Turn.objects.create(
                    session=live,
                    owner=user,
                    number=live.turn_counter + 1,
                    status=TurnStatus.RUNNING,
                    content="first",
                )
                Session.objects.filter(pk=live.pk).update(turn_counter=live.turn_counter + 1)
                holding.set()
                release.wait(10)
        finally:
            connections.close_all()

    def admit_beside() -> None:
        try:
            with transaction.atomic():
                live, state = admission_lock.lock_for_admission(session.pk, user.pk)
                seen.update(state=state, counter=live.turn_counter)
        finally:
            connections.close_all()

    first = threading.Thread(target=other_send, daemon=True)
    first.start()
    assert holding.wait(10)
    second = threading.Thread(target=admit_beside, daemon=True)
    second.start()
    time.sleep(0.3)  # the admission now waits for the row (or SQLite's write lock)
    assert not seen
    release.set()
    first.join(10)
    second.join(10)
    state = seen["state"]
    assert (state.running, state.queued) == (1, 0)
    assert state.busy
    assert seen["counter"] == session.turn_counter + 1
