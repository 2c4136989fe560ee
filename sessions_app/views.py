"""Plain Django views: health (F4, I3), which answers within its timeout whatever hangs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse

from chatcore.common import heap, publish
from chatcore.common.dbthreads import on_db
from chatcore.common.memlayer import LocalChannelLayer
from chatcore.common.redislayer import RedisPubSubLayer
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


async def _check_channel_layer() -> dict[str, Any]:
    layer = get_channel_layer()
    backend = str(settings.CHANNEL_LAYERS["default"]["BACKEND"]).rsplit(".", 1)[-1]
    if layer is None:
        return {"ok": False, "backend": backend}
    # D1, issue 10: frames this process did not get through, since it started: frames a
    # full channel missed (both layers bound a consumer's queue and count them) and publishes
    # the layer refused.
    counts = {
        "dropped": layer.dropped if isinstance(layer, LocalChannelLayer | RedisPubSubLayer) else 0,
        "failed_publishes": publish.failed_publishes(),
    }
    try:
        await layer.group_send("health.probe", {"type": "health.probe"})
        return {"ok": True, "backend": backend, **counts}
    except Exception as exc:
        logger.warning("health: channel layer check failed: %s", exc)
        return {"ok": False, "backend": backend, **counts}


async def _check_broker(timeout: float) -> dict[str, Any]:
    if not settings.REDIS_URL:
        return {"ok": True, "backend": "in-process"}
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(
        settings.REDIS_URL, socket_timeout=timeout, socket_connect_timeout=timeout
    )
    try:
        await client.ping()
        return {"ok": True, "backend": "redis"}
    except Exception as exc:
        logger.warning("health: broker check failed: %s", exc)
        return {"ok": False, "backend": "redis"}
    finally:
        await client.aclose()


async def _bounded(
    name: str, check: Awaitable[dict[str, Any]], timeout: float, fallback: dict[str, Any]
) -> dict[str, Any]:
    """`check`'s answer, or not ok with `timed_out` once `timeout` passed (I3: a frozen
    dependency makes health say so, it does not make health hang)."""
    try:
        return await asyncio.wait_for(check, timeout)
    except TimeoutError:
        logger.warning("health: %s did not answer within %.1fs", name, timeout)
        return {**fallback, "ok": False, "timed_out": True}


async def healthz(request: HttpRequest) -> JsonResponse:
    """Each dependency's state, checked side by side, each within
    CHAT["HEALTH_TIMEOUT_SECONDS"] (F4, I3); 503 when one is not ok."""
    timeout = float(settings.CHAT["HEALTH_TIMEOUT_SECONDS"])
    layer_backend = str(settings.CHANNEL_LAYERS["default"]["BACKEND"]).rsplit(".", 1)[-1]
    database, channel_layer, broker = await asyncio.gather(
        _bounded(
            "the database",
            on_db(_check_database)(),
            timeout,
            {"vendor": connection.vendor},
        ),
        _bounded(
            "the channel layer",
            _check_channel_layer(),
            timeout,
            {"backend": layer_backend},
        ),
        _bounded(
            "the broker",
            _check_broker(timeout),
            timeout,
            {"backend": "redis" if settings.REDIS_URL else "in-process"},
        ),
    )
    checks = {"database": database, "channel_layer": channel_layer, "broker": broker}
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
