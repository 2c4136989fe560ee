"""`serve [--host H] [--port P]`: run the ASGI app under Daphne, with the engine in its loop.

`make run` uses it in embedded mode; scaled mode runs several of these processes on different
ports against the same PostgreSQL and Redis. Unlike `runserver` it has no autoreloader, serves
static files itself (no proxy needed for a demo or a small deployment), starts the engine
runtime inside Daphne's asyncio loop before the first request, and lets the engine shut down
gracefully on SIGINT/SIGTERM before the reactor stops.
"""

from __future__ import annotations

# Daphne must install Twisted's asyncio reactor before anything imports Twisted's default
# reactor; `daphne.server` does that on import (as daphne's own cli.py relies on), so it is
# imported before every other third-party module here. The `daphne` app in INSTALLED_APPS
# imports it even earlier, during django.setup().
import daphne.server  # isort: skip
import asyncio
import ipaddress
import logging
import re
from typing import Any

from daphne.access import AccessLogGenerator
from daphne.endpoints import build_endpoint_description_strings
from django.conf import settings
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.management.base import BaseCommand, CommandError, CommandParser
from twisted.internet import defer, reactor

from sessions_app.management.edge import BodyCapFactory, QuietSocket, SecurityHeaders, body_cap

logger = logging.getLogger(__name__)

# STYLE 5: turns do not belong to sockets, so an application instance whose client has left
# only needs a short grace period to finish its own cleanup; Daphne's default (10 s) fits.
APPLICATION_CLOSE_TIMEOUT = 10
# Daphne drops a connection whose frame exceeds its limit without a word. Keep its limit well
# above the engine's frame limit (F6, 256 KiB) so the consumer can answer `too_large` itself.
MIN_WEBSOCKET_MESSAGE_SIZE = 1024 * 1024


class _Server(daphne.server.Server):
    """Daphne's server, telling the command once it really listens; its HTTP requests refuse
    a body over the cap before Django reads any (`edge.BodyCapFactory`, F3); its sockets
    are `edge.QuietSocket`s."""

    def __init__(self, *args: Any, on_listening: Any, body_cap: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_listening = on_listening
        self._body_cap = body_cap

    @property
    def http_factory(self) -> Any:
        return self._http_factory

    @http_factory.setter
    def http_factory(self, factory: Any) -> None:
        # Daphne's `run` makes its HTTP factory here; ours is the same with capped requests.
        self._http_factory = BodyCapFactory(self, self._body_cap)

    @property
    def ws_factory(self) -> Any:
        return self._ws_factory

    @ws_factory.setter
    def ws_factory(self, factory: Any) -> None:
        # Daphne's `run` makes its WebSocket factory here, then sets its options.
        factory.protocol = QuietSocket
        self._ws_factory = factory

    def listen_success(self, port: Any) -> None:
        super().listen_success(port)
        host = port.getHost()
        self._on_listening(host.host, host.port)


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def _redact(url: str) -> str:
    """A URL fit for output: credentials removed (F4: secrets never logged)."""
    return re.sub(r"//[^/@]*@", "//***@", url)


class Command(BaseCommand):
    help = "Serve HTTP and WebSockets with Daphne (default http://127.0.0.1:$PORT, port 8000)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
        parser.add_argument(
            "--port",
            type=int,
            default=None,
            help="port to listen on (default: $PORT or 8000; 0 picks a free one)",
        )
        parser.add_argument(
            "--nostatic",
            action="store_false",
            dest="serve_static",
            help="do not serve static files (a proxy or CDN serves STATIC_URL)",
        )
        parser.add_argument(
            "--access-log",
            action="store_true",
            help="print one line per request to stdout",
        )
        parser.add_argument(
            "--application-close-timeout",
            type=int,
            default=APPLICATION_CLOSE_TIMEOUT,
            help="seconds an app instance may run after its client left (default 10)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        host: str = options["host"]
        port: int = options["port"] if options["port"] is not None else settings.PORT
        if not 0 <= port <= 65535:
            raise CommandError(f"Invalid port {port}.")
        if not is_loopback(host) and settings.SECRET_KEY == settings.DEV_SECRET_KEY:
            # F8: the built-in key is public; sessions signed with it could be forged.
            raise CommandError(
                f"Refusing to serve on {host}: DJANGO_SECRET_KEY is not set, and the built-in "
                "development key must not be used beyond this machine. Set DJANGO_SECRET_KEY "
                "to a long random value (for example: python -c 'import secrets; "
                "print(secrets.token_urlsafe(50))'), or bind to 127.0.0.1."
            )

        from chatcore.asgi import application

        app: Any = application
        if options["serve_static"]:
            # F8: static files get the same security headers as pages.
            app = SecurityHeaders(ASGIStaticFilesHandler(app), websocket=application)

        frame_limit = settings.CHAT.get("FRAME_LIMIT_BYTES")
        if not isinstance(frame_limit, int):
            frame_limit = 0
        max_message = max(MIN_WEBSOCKET_MESSAGE_SIZE, 2 * frame_limit)
        display_host = f"[{host}]" if ":" in host else host

        def on_listening(bound_host: str, bound_port: int) -> None:
            self.stdout.write(f"Serving on http://{display_host}:{bound_port}")
            self.stdout.flush()

        def on_ready() -> None:
            # Daphne calls this before its reactor runs the asyncio loop; schedule the engine
            # start as the loop's first callback so it binds to the running loop.
            from chatcore.engine import runtime

            def start() -> None:
                global _settling
                runtime.start_in_current_loop()
                _settling = asyncio.get_running_loop().create_task(_settle_heap())

            asyncio.get_event_loop().call_soon(start)
            # F1, B3: on SIGINT/SIGTERM the reactor waits for the engine to refuse new work
            # and reap its tasks (bounded by its own grace period) before it stops.
            twisted_reactor: Any = reactor  # its zope interface confuses mypy
            twisted_reactor.addSystemEventTrigger("before", "shutdown", _engine_shutdown)

        if settings.SCALED:
            mode = f"scaled mode: {settings.DATABASES['default']['ENGINE'].rsplit('.', 1)[-1]}"
            mode += f", Redis {_redact(settings.REDIS_URL)}"
        else:
            mode = f"embedded mode: {settings.DATABASES['default']['ENGINE'].rsplit('.', 1)[-1]}"
            mode += ", in-memory channel layer, in-process background jobs"
        self.stdout.write(f"Starting Daphne on {display_host}:{port} ({mode}). Ctrl-C stops it.")
        self.stdout.flush()

        server = _Server(
            application=app,
            endpoints=build_endpoint_description_strings(host=host, port=port),
            signal_handlers=True,
            action_logger=AccessLogGenerator(self.stdout) if options["access_log"] else None,
            http_timeout=None,  # SSE streams last as long as their turn
            websocket_max_message_size=max_message,
            websocket_max_frame_size=max_message,
            application_close_timeout=options["application_close_timeout"],
            root_path=getattr(settings, "FORCE_SCRIPT_NAME", "") or "",
            ready_callable=on_ready,
            on_listening=on_listening,
            body_cap=body_cap(),
        )
        server.run()
        if not server.listening_addresses:
            raise CommandError(
                f"Could not listen on {display_host}:{port} (is the port in use? "
                "try another with --port or PORT=...)."
            )


# The task that settles the heap once the engine has started (kept: a task nobody holds may
# be collected before it runs).
_settling: asyncio.Task[None] | None = None


async def _settle_heap() -> None:
    """Once the engine has started (its tokenizer tables loaded), take what the process
    holds for good out of the cyclic collector's view (`chatcore.common.heap`)."""
    from chatcore.common import heap
    from chatcore.engine import runtime

    await runtime.get_engine()
    heap.settle(int(settings.CHAT["GC_YOUNG_THRESHOLD"]))


def _engine_shutdown() -> defer.Deferred[None]:
    from chatcore.engine import runtime

    grace = settings.CHAT.get("SHUTDOWN_GRACE_SECONDS")
    limit = (grace if isinstance(grace, int | float) else 10.0) + 5.0

    async def stop() -> None:
        try:
            await asyncio.wait_for(runtime.shutdown(), timeout=limit)
        except Exception:
            logger.exception("engine shutdown did not finish cleanly")

    return defer.Deferred.fromFuture(asyncio.ensure_future(stop()))
