"""`python manage.py telegram_poll`: the Telegram bot without a public URL. Long-polls
getUpdates (with an offset) and handles each update as the webhook would, with its own
engine, which shares the database (and its leases) with any server. Stops on Ctrl-C or
SIGTERM, letting running answers end as interrupted (F1)."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import QuerySet

from chatcore.engine import runtime
from chatcore.engine.engine import Engine
from sessions_app.chatapps import telegram
from sessions_app.models import Session


def _scope(qs: QuerySet[Session]) -> QuerySet[Session]:
    # This process resumes only Telegram dialogs' interrupted work (C11).
    return qs.filter(channel=telegram.CHANNEL)


class Command(BaseCommand):
    help = "Run the Telegram bot by polling getUpdates (no webhook needed)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--timeout", type=int, default=None, help="long-poll seconds (default 30)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not telegram.enabled():
            raise CommandError("Set TELEGRAM_BOT_TOKEN to run the Telegram bot.")
        asyncio.run(self._run(options["timeout"]))

    async def _run(self, timeout: int | None) -> None:
        engine = Engine(scope=_scope)
        await engine.start()
        runtime.set_engine(engine)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        self.stderr.write("Polling Telegram for updates; Ctrl-C stops.")
        poller = loop.create_task(telegram.poll(engine, stop=stop, timeout=timeout))
        try:
            await stop.wait()
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
        finally:
            await engine.shutdown()
            runtime.set_engine(None)
