"""Inbound routes of the chat apps (PROTOCOL "Chat apps"). Thin (STYLE 1): check the
platform's secret, check the body's shape (`events`), hand the update to its adapter. A
refused request (403, or 400 for a malformed body) changes nothing; a platform that is not
configured is not found."""

from __future__ import annotations

import logging

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from chatcore.engine import runtime

from . import events, feishu, telegram

logger = logging.getLogger(__name__)


@csrf_exempt
@require_POST
async def telegram_webhook(request: HttpRequest) -> HttpResponse:
    if not telegram.enabled():
        return JsonResponse({"error": "telegram is not configured"}, status=404)
    if not telegram.secret_ok(request.headers.get("X-Telegram-Bot-Api-Secret-Token")):
        return JsonResponse({"error": "bad secret token"}, status=403)
    try:
        # I3: every field the adapter reads is checked before anything is claimed or stored.
        update = events.telegram_update(events.load_json(request.body))
    except events.Malformed as exc:
        logger.warning("telegram update refused: %s", exc)
        return JsonResponse({"error": str(exc)}, status=400)
    engine = await runtime.get_engine()
    adapter = await telegram.telegram_adapter(engine)
    return _answer(await adapter.handle_update(update))


@csrf_exempt
@require_POST
async def feishu_events(request: HttpRequest) -> HttpResponse:
    if not feishu.enabled():
        return JsonResponse({"error": "feishu is not configured"}, status=404)
    headers = {k.lower(): v for k, v in request.headers.items()}
    try:
        event = feishu.open_callback(request.body, headers)
    except feishu.CallbackRefused as exc:
        logger.warning("feishu callback refused: %s", exc)
        return JsonResponse({"error": str(exc)}, status=exc.status)
    if event.get("type") == "url_verification":
        return JsonResponse({"challenge": event.get("challenge", "")})
    try:
        # I3: every field the adapter reads is checked before anything is claimed or stored.
        event = events.feishu_event(event)
    except events.Malformed as exc:
        logger.warning("feishu callback refused: %s", exc)
        return JsonResponse({"error": str(exc)}, status=400)
    engine = await runtime.get_engine()
    adapter = await feishu.feishu_adapter(engine)
    return _answer(await adapter.handle_event(event))


def _answer(outcome: str) -> HttpResponse:
    if outcome == "retry":
        # D5: the message could not be stored; a non-2xx makes the platform deliver it again.
        return JsonResponse({"ok": False, "result": outcome}, status=503)
    return JsonResponse({"ok": True, "result": outcome})
