"""URL map: web chat, accounts, admin, health."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from sessions_app import share_views, views, web
from sessions_app.api import api
from sessions_app.chatapps import views as chatapp_views

urlpatterns = [
    path("", web.chat_page, name="chat"),
    path("healthz", views.healthz, name="healthz"),
    path("s/<str:share_id>", share_views.share_page, name="share"),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    path("i18n/", include("django.conf.urls.i18n")),
    path("channels/telegram/webhook", chatapp_views.telegram_webhook, name="telegram-webhook"),
    path("channels/feishu/events", chatapp_views.feishu_events, name="feishu-events"),
]
