"""Linked chat-app dialogs in the web chat, in a real headless Chromium against a real `serve`
process with Telegram configured against the fake Bot API server (issue 13 item 5; SPEC A1,
E1, D1-D3): listed under their platform, opened with their history, their turns streamed
live, and a read-only one shown with its composer disabled."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import expect

from tests.browser import CHROMIUM, PASSWORD, Tab, _require_chromium, _screenshot
from tests.fakemodel import FakeModelServer, Reply, echo_reply
from tests.fakeplatforms import TELEGRAM_TOKEN, FakeTelegram
from tests.procs import ServeProcess as Served
from tests.procs import embedded_env, manage, migrate_embedded

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SECRET = "browser-webhook-s3cret"


@pytest.fixture(scope="module")
def model() -> Iterator[FakeModelServer]:
    server = FakeModelServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def telegram() -> Iterator[FakeTelegram]:
    server = FakeTelegram().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def env(
    tmp_path_factory: pytest.TempPathFactory, model: FakeModelServer, telegram: FakeTelegram
) -> dict[str, str]:
    _require_chromium()
    return embedded_env(
        tmp_path_factory.mktemp("browser-chatapps-var"),
        LLM_BASE_URL=model.url,
        DEMO_PASSWORD=PASSWORD,
        CHAT_RATE_LIMIT_PER_MINUTE="100000",
        CHAT_AUTO_TITLE_AFTER="100000",
        TELEGRAM_BOT_TOKEN=TELEGRAM_TOKEN,
        TELEGRAM_WEBHOOK_SECRET=SECRET,
        TELEGRAM_API_BASE=telegram.url,
    )


@pytest.fixture(scope="module")
def served(env: dict[str, str]) -> Iterator[Served]:
    migrate_embedded(env, demo_user=True)
    server = Served(Path(env["CHAT_VAR_DIR"]), env)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(served: Served) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            yield chromium
        finally:
            chromium.close()


def link(env: dict[str, str], *, writable: bool) -> None:
    """What an operator does in the admin: link the Telegram account to the demo user."""
    code = (
        "from django.contrib.auth.models import User\n"
        "from sessions_app.chatapps import store\n"
        "from sessions_app.models import ChannelAccount\n"
        "account = ChannelAccount.objects.get(channel='telegram', external_id='7')\n"
        f"store.account_link(account=account, user=User.objects.get(username='demo'), "
        f"writable={writable})\n"
    )
    done = manage("shell", "-c", code, env=env)
    assert done.returncode == 0, done.stderr


def say(served: Served, telegram: FakeTelegram, text: str) -> dict[str, Any]:
    update = telegram.update(text, user_id=7, chat_id=42)
    response = httpx.post(
        f"{served.base}/channels/telegram/webhook",
        json=update,
        headers={"X-Telegram-Bot-Api-Secret-Token": SECRET},
        timeout=30,
    )
    assert response.status_code == 200 and response.json()["result"] == "send"
    return update


def test_linked_telegram_dialogs_in_the_sidebar_read_only_then_writable(
    browser: Any,
    served: Served,
    env: dict[str, str],
    model: FakeModelServer,
    telegram: FakeTelegram,
) -> None:
    # covers: A1, E1, D1, D2 (issue 13 item 5: the same person sees their chat-app dialogs)
    model.default = echo_reply
    say(served, telegram, "hello from telegram")
    link(env, writable=False)

    ctx = browser.new_context(viewport={"width": 1280, "height": 820}, base_url=served.base)
    try:
        tab = Tab(ctx.new_page(), served.base).login()
        page = tab.page
        group = page.locator(".dialog-group-linked")
        expect(group).to_have_text("Telegram (linked)")
        linked = page.locator(".dialog-item").filter(has=page.locator(".dialog-badge"))
        expect(linked).to_have_count(1)
        expect(linked.locator(".dialog-badge")).to_have_text("read-only")
        expect(linked.locator(".dialog-more")).to_have_count(0)

        # Open it: its history, the composer disabled with a note.
        linked.locator(".dialog-open").click()
        expect(page.locator(".dialog-item.is-current .dialog-badge")).to_have_count(1)
        expect(page.locator("#messages .msg-user .bubble").last).to_have_text("hello from telegram")
        expect(tab.answers().last).to_have_text("echo: hello from telegram")
        expect(page.locator("#composer-input")).to_be_disabled()
        expect(page.locator("#composer-readonly")).to_be_visible()
        expect(page.locator("#composer-readonly")).to_contain_text("read-only")
        opened = [f for f in tab.frames_sent("history") if f.get("follow")]
        assert opened and opened[-1]["session_id"].startswith("telegram:42:")

        # A new message in Telegram streams into the open page.
        model.script(Reply(text="a streamed answer " * 12, chunk=4, delay=0.04))
        say(served, telegram, "second question")
        expect(page.locator("#messages .msg-user .bubble").last).to_have_text("second question")
        tab.wait_stream_contains("a streamed answer")
        expect(page.locator("#stop-button")).to_be_hidden()  # read-only: nothing to stop
        expect(tab.answers().last).to_contain_text("a streamed answer", timeout=30_000)
        _screenshot(page, "chat-linked-read-only.png")

        # Back to a web dialog: the composer works again.
        page.locator(".dialog-item:not(:has(.dialog-badge)) .dialog-open").first.click()
        expect(page.locator(".dialog-item.is-current .dialog-badge")).to_have_count(0)
        expect(page.locator("#composer-input")).to_be_enabled()
        expect(page.locator("#composer-readonly")).to_be_hidden()

        # Writable: the web user writes into the Telegram dialog; the answer reaches Telegram.
        link(env, writable=True)
        page.reload()
        tab.wait_online()
        page.locator(".dialog-group-linked + ul .dialog-open").first.click()
        expect(page.locator("#messages .msg-user .bubble").last).to_have_text("second question")
        expect(page.locator("#composer-input")).to_be_enabled()
        expect(page.locator("#composer-readonly")).to_be_hidden()
        model.default = echo_reply
        tab.send("from the browser")
        expect(tab.answers().last).to_have_text("echo: from the browser", timeout=30_000)
        sends = [f for f in tab.frames_sent("send") if f.get("content") == "from the browser"]
        assert sends and sends[0]["session_id"].startswith("telegram:42:")
        assert "dialog_id" not in sends[0]
        deadline = time.monotonic() + 30
        while "echo: from the browser" not in [m.text for m in telegram.bot_messages("42")]:
            assert time.monotonic() < deadline, "the answer never reached Telegram"
            time.sleep(0.1)
        assert not tab.errors, f"JavaScript errors on the page: {tab.errors}"
    finally:
        ctx.close()
