"""ASGI entry point: HTTP through Django, WebSockets through Channels."""

from __future__ import annotations

import os
from collections.abc import Awaitable
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatcore.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from chatcore.engine import runtime  # noqa: E402
from sessions_app.routing import websocket_urlpatterns  # noqa: E402
from sessions_app.upload_guard import UploadGuard  # noqa: E402

# The socket authenticates itself (`ws_auth.authenticate`, in the consumer): no middleware
# coroutine waits for the socket's whole life, one per open socket (issue 57).
websocket_app = URLRouter(websocket_urlpatterns)
router = ProtocolTypeRouter(
    {
        # H3: an oversized upload is refused before Django reads its body.
        "http": UploadGuard(django_asgi_app),
        "websocket": websocket_app,
    }
)


class _Application:
    """The router, with the engine started in the server's loop first: `serve` starts it at
    boot, this covers other servers (idempotent). A plain callable that hands back the
    router's coroutine, so it adds no frame of its own to an open socket."""

    _asgi_single_callable = True

    def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Awaitable[None]:
        runtime.start_in_current_loop()
        return router(scope, receive, send)


application = _Application()
