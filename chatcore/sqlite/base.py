"""SQLite, with this process's write transactions taking turns in Python (embedded mode, G6).

SQLite runs one write transaction at a time; the others wait in its busy handler, which polls
with sleeps of 1, 2, 5, 10 ms and more. With several database threads
(`chatcore.common.dbthreads`) that sleep lands on users: a dialog's claim that meets another
send's admission sleeps well past its commit, and the first token waits for it. Here a write
transaction (`BEGIN IMMEDIATE`, every `atomic` block but the read transactions of
`selectors.read_transaction`, which begin `DEFERRED`) first takes a lock of the process, so
the next writer starts the moment the previous one ends. Readers never take it (WAL lets
them run beside the writer). Another process (the terminal chat, a management command)
still meets SQLite's own busy timeout, as before; waiting for the lock longer than that
timeout fails the same way SQLite would ("database is locked"), and storage retries it.
"""

from __future__ import annotations

import threading
from typing import Any

from django.db import OperationalError
from django.db.backends.sqlite3 import base

_write_lock = threading.Lock()


class DatabaseWrapper(base.DatabaseWrapper):
    # The hooks overridden here are Django's private transaction hooks; its type stubs leave
    # them out, hence the `type: ignore`s.
    _holds_write_lock = False

    def _start_transaction_under_autocommit(self) -> None:
        if getattr(self, "transaction_mode", None) == "DEFERRED":
            super()._start_transaction_under_autocommit()  # type: ignore[misc]
            return
        timeout = float(self.settings_dict["OPTIONS"].get("timeout", 5))
        if not _write_lock.acquire(timeout=timeout):
            raise OperationalError("database is locked")
        self._holds_write_lock = True
        try:
            super()._start_transaction_under_autocommit()  # type: ignore[misc]
        except BaseException:
            self._release_write_lock()
            raise

    def _release_write_lock(self) -> None:
        if self._holds_write_lock:
            self._holds_write_lock = False
            _write_lock.release()

    def _commit(self) -> Any:
        try:
            return super()._commit()  # type: ignore[misc]
        finally:
            self._release_write_lock()

    def _rollback(self) -> Any:
        try:
            return super()._rollback()  # type: ignore[misc]
        finally:
            self._release_write_lock()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._release_write_lock()
