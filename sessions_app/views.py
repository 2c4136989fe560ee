"""Plain Django views: health (F4)."""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse

from chatcore.common import heap, publish
from chatcore.common.memlayer import LocalChannelLayer
from chatcore.engine.clientstate import snapshot_gaps

logger = logging.getLogger(__name__)


def _check_database() -> dict[str, Any]:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return {"ok": True, "vendor": connection.vendor}
    except Exception as exc:
        logger.warning("health: database check failed: %s", exc)
        return {"ok": False, "vendor": connection.vendor}


def _check_channel_layer() -> dict[str, Any]:
    layer = get_channel_layer()
    backend = str(settings.CHANNEL_LAYERS["default"]["BACKEND"]).rsplit(".", 1)[-1]
    if layer is None:
        return {"ok": False, "backend": backend}
    # D1, issue 10: frames this process did not get through, since it started: group
    # messages a full channel missed (the embedded layer counts them; Redis pub/sub queues are
    # unbounded) and publishes the layer refused.
    counts = {
        "dropped": layer.dropped if isinstance(layer, LocalChannelLayer) else 0,
        "failed_publishes": publish.failed_publishes(),
    }
    try:
        async_to_sync(layer.group_send)("health.probe", {"type": "health.probe"})
        return {"ok": True, "backend": backend, **counts}
    except Exception as exc:
        logger.warning("health: channel layer check failed: %s", exc)
        return {"ok": False, "backend": backend, **counts}


def _check_broker() -> dict[str, Any]:
    if not settings.REDIS_URL:
        return {"ok": True, "backend": "in-process"}
    try:
        import redis

        client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2)
        client.ping()
        return {"ok": True, "backend": "redis"}
    except Exception as exc:
        logger.warning("health: broker check failed: %s", exc)
        return {"ok": False, "backend": "redis"}


def healthz(request: HttpRequest) -> JsonResponse:
    checks = {
        "database": _check_database(),
        "channel_layer": _check_channel_layer(),
        "broker": _check_broker(),
    }
    ok = all(c["ok"] for c in checks.values())
    return JsonResponse(
        {
            "status": "ok" if ok else "degraded",
            "mode": "scaled" if settings.SCALED else "embedded",
            **checks,
            # D1: snapshot tails found missing by this process's connections since it started.
            "snapshot_gaps": snapshot_gaps(),
            # Issue 10: the garbage collector's pauses since the server settled (serve only).
            "collector": heap.report(),
        },
        status=200 if ok else 503,
    )
