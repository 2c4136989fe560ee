"""ASGI entry point: HTTP through Django, WebSockets through Channels."""

from __future__ import annotations

import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatcore.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from chatcore.engine import runtime  # noqa: E402
from sessions_app.routing import websocket_urlpatterns  # noqa: E402
from sessions_app.upload_guard import UploadGuard  # noqa: E402
from sessions_app.ws_auth import ChatAuthMiddleware  # noqa: E402

router = ProtocolTypeRouter(
    {
        # H3: an oversized upload is refused before Django reads its body.
        "http": UploadGuard(django_asgi_app),
        "websocket": ChatAuthMiddleware(URLRouter(websocket_urlpatterns)),
    }
)


async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    # The engine lives in the server's loop; `serve` starts it at boot, this covers other
    # servers (idempotent).
    runtime.start_in_current_loop()
    await router(scope, receive, send)
