"""The operators' admin, as an operator reads it (SPEC E2, H5, F5): an answer that only calls
tools shows its calls in the dialog's message list, the message count says it counts the
user's messages, and every label of our models in the admin is Chinese under zh-hans."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.apps import apps
from django.contrib import admin
from django.contrib.admin.utils import label_for_field
from django.test import Client
from django.urls import reverse
from django.utils import translation

from sessions_app import services

pytestmark = [pytest.mark.django_db, pytest.mark.both_dbs]

HAN = re.compile(r"[\u4e00-\u9fff]")
ADMIN_APPS = ("sessions_app", "audit")


@pytest.fixture
def client(make_user: Any) -> Client:
    c = Client()
    c.force_login(make_user("ops", staff=True))
    return c


def test_an_answer_that_only_calls_tools_shows_its_calls(client: Client, user: Any) -> None:
    # covers: E2, C8
    s = services.session_create(owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id="t")
    long_query = "weather in Paris " * 20
    services.messages_append(
        session_pk=s.pk,
        messages=[
            services.NewMessage(
                role="assistant",
                content="",
                kind="assistant",
                tool_calls=[
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "web_search", "arguments": f'{{"q": "{long_query}"}}'},
                    },
                    {
                        "id": "c2",
                        "type": "function",
                        "function": {"name": "remember", "arguments": '{"note": "<b>x</b>"}'},
                    },
                ],
            )
        ],
    )
    page = client.get(reverse("admin:sessions_app_session_change", args=[s.pk]))
    body = page.content.decode()
    assert "Tool call: <code>web_search({&quot;q&quot;: &quot;weather in Paris" in body
    assert long_query not in body  # shortened
    assert "…)</code>" in body
    # Arguments are escaped, never rendered as markup.
    assert "remember({&quot;note&quot;: &quot;&lt;b&gt;x&lt;/b&gt;&quot;})" in body
    listing = client.get(reverse("admin:sessions_app_message_changelist"))
    assert "web_search(" in listing.content.decode()
    # The row's title names the calls too.
    assert "#2 assistant: web_search, remember" in body


def test_message_count_says_it_counts_user_messages(client: Client, user: Any) -> None:
    # covers: E2, A2
    services.session_create(owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id="c")
    listing = client.get(reverse("admin:sessions_app_session_changelist")).content.decode()
    assert "User messages" in listing
    assert "Message count" not in listing


def _labels(model_admin: Any) -> dict[str, str]:
    model = model_admin.model
    # What the admin shows: the form's fields (editable ones), the read-only fields, the
    # list's columns and its filters.
    names = {f.name for f in model._meta.get_fields() if getattr(f, "editable", False)}
    for shown in (model_admin.list_display, model_admin.list_filter, model_admin.readonly_fields):
        names |= {n for n in shown if isinstance(n, str) and n != "__str__"}
    names -= {"id", "password"}
    out = {}
    for name in names:
        try:
            out[name] = str(label_for_field(name, model, model_admin))
        except AttributeError:
            continue
    return out


def test_every_label_of_our_models_in_the_admin_is_chinese() -> None:
    # covers: F5, E2, H5
    models = [
        m
        for a in ADMIN_APPS
        for m in apps.get_app_config(a).get_models()
        if admin.site.is_registered(m)
    ]
    assert len(models) >= 8
    untranslated = []
    with translation.override("zh-hans"):
        for app in ADMIN_APPS:
            if not HAN.search(str(apps.get_app_config(app).verbose_name)):
                untranslated.append(app)
        for model in models:
            opts = model._meta
            for text in (opts.verbose_name, opts.verbose_name_plural):
                if not HAN.search(str(text)):
                    untranslated.append(f"{opts.label}: {text}")
            for name, label in _labels(admin.site.get_model_admin(model)).items():
                if not HAN.search(label):
                    untranslated.append(f"{opts.label}.{name}: {label}")
            for field in opts.get_fields():
                for value, text in getattr(field, "choices", None) or []:
                    if value != "" and not HAN.search(str(text)):
                        untranslated.append(f"{opts.label}.{field.name}={value}: {text}")
    assert untranslated == []


def test_the_chinese_admin_shows_chinese_columns_and_filters(client: Client, user: Any) -> None:
    # covers: F5, E2, H5
    services.session_create(owner=user, channel="web", chat_id=f"u{user.pk}", dialog_id="zh")
    page = client.get(
        reverse("admin:sessions_app_session_changelist"), HTTP_ACCEPT_LANGUAGE="zh-hans"
    ).content.decode()
    for text in ("对话", "标题", "所有者", "用户消息", "最近活动"):
        assert text in page
    trail = client.get(
        reverse("admin:audit_auditevent_changelist"), HTTP_ACCEPT_LANGUAGE="zh-hans"
    ).content.decode()
    for text in ("审计事件", "操作者", "操作", "目标类型", "重命名了对话"):
        assert text in trail
