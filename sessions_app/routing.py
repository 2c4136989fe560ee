"""WebSocket URL map (PROTOCOL "WebSocket: /ws/chat/")."""

from __future__ import annotations

from django.urls import path

from .consumers import ChatConsumer

websocket_urlpatterns = [
    path("ws/chat/", ChatConsumer.as_asgi()),
]
