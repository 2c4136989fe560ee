"""What the browser tests share (E1): one `serve` process (embedded mode, its own SQLite file)
and one fake model server per test module, a headless Chromium, and `Tab`, a signed-in page
with the helpers the tests use. Each test gets a fresh browser context, signs in through the
login form and scripts the model's replies itself. Screenshots land in `artifacts/`
(git-ignored) for a human look.

Test modules import the fixtures they request by name (module-scoped: one server per module).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.fakemodel import FakeModelServer, echo_reply
from tests.procs import ROOT, embedded_env, migrate_embedded
from tests.procs import ServeProcess as Served

CHROMIUM = "/usr/bin/chromium"
PASSWORD = "browser-test-password"
ARTIFACTS = ROOT / "artifacts"
WAIT_MS = 15_000

expect.set_options(timeout=WAIT_MS)


def _require_chromium() -> None:
    if not Path(CHROMIUM).exists():
        reason = f"Chromium not found at {CHROMIUM} (apt-get install chromium)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason + "; CI must run the browser tests")
        pytest.skip(reason)


# --- Servers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> Iterator[FakeModelServer]:
    server = FakeModelServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model: FakeModelServer) -> Iterator[Served]:
    _require_chromium()
    var_dir = tmp_path_factory.mktemp("browser-var")
    env = embedded_env(
        var_dir,
        LLM_BASE_URL=model.url,
        DEMO_PASSWORD=PASSWORD,
        # Every test signs in as the demo user: no per-minute cap across the module, and no
        # title jobs taking a reply scripted for a turn.
        CHAT_RATE_LIMIT_PER_MINUTE="100000",
        CHAT_AUTO_TITLE_AFTER="100000",
    )
    migrate_embedded(env, demo_user=True)
    server = Served(var_dir, env)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(served: Served) -> Iterator[Any]:
    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            yield chromium
        finally:
            chromium.close()


class Tab:
    """One signed-in page of the chat, with the helpers the tests share."""

    def __init__(self, page: Any, base: str) -> None:
        self.page = page
        self.base = base
        self.sent: list[dict[str, Any]] = []
        self.received: list[dict[str, Any]] = []
        # The URL of each socket the page opened (a reconnect says what it holds in it).
        self.socket_urls: list[str] = []
        self.errors: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        page.on("websocket", self._watch)

    def _watch(self, ws: Any) -> None:
        import json

        def parse(payload: Any) -> dict[str, Any]:
            try:
                return dict(json.loads(payload))
            except (TypeError, ValueError):
                return {}

        self.socket_urls.append(ws.url)
        ws.on("framesent", lambda payload: self.sent.append(parse(payload)))
        ws.on("framereceived", lambda payload: self.received.append(parse(payload)))

    # --- navigation -----------------------------------------------------------------------
    def login(self) -> Tab:
        page = self.page
        page.goto(self.base + "/")
        page.wait_for_url(re.compile(r"/accounts/login/"))
        page.get_by_label("Username").fill("demo")
        page.get_by_label("Password").fill(PASSWORD)
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url(re.compile(r"^" + re.escape(self.base) + r"/(#.*)?$"))
        self.wait_online()
        return self

    def open(self) -> Tab:
        """A second tab of an already signed-in context."""
        self.page.goto(self.base + "/")
        self.wait_online()
        return self

    def wait_online(self) -> None:
        expect(self.page.locator("#app")).to_have_attribute("data-conn", "online")
        expect(self.page.locator(".dialog-item.is-current")).to_have_count(1)

    def current_dialog(self) -> str:
        return str(self.page.locator(".dialog-item.is-current").get_attribute("data-dialog-id"))

    def new_dialog(self) -> str:
        """A new stored dialog, made by typing `/new` (the "New dialog" button only opens a
        draft, stored with its first message)."""
        before = self.current_dialog()
        self.send("/new")
        self.page.wait_for_function(
            "prev => { const el = document.querySelector('.dialog-item.is-current');"
            " return el && el.dataset.dialogId !== prev; }",
            arg=before,
        )
        expect(self.page.locator("#messages .msg-system")).to_have_count(1)  # the welcome
        return self.current_dialog()

    def send(self, text: str) -> None:
        box = self.page.locator("#composer-input")
        box.fill(text)
        box.press("Enter")

    # --- reading ----------------------------------------------------------------------------
    def streaming(self) -> Any:
        return self.page.locator("#live .msg-streaming .md")

    def answers(self) -> Any:
        return self.page.locator("#messages .msg-assistant .md")

    def wait_stream_contains(self, text: str) -> str:
        expect(self.streaming()).to_contain_text(text)
        return str(self.streaming().inner_text())

    def frames_sent(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.sent if f.get("type") == kind]

    def frames_received(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.received if f.get("type") == kind]


@pytest.fixture
def context(browser: Any, served: Served) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1280, "height": 820}, base_url=served.base)
    try:
        yield ctx
    finally:
        ctx.close()


@pytest.fixture
def tab(context: Any, served: Served, model: FakeModelServer) -> Iterator[Tab]:
    with model._lock:
        model.replies.clear()
    model.default = echo_reply
    t = Tab(context.new_page(), served.base)
    t.login()
    t.new_dialog()
    yield t
    assert not t.errors, f"JavaScript errors on the page: {t.errors}"


def _screenshot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), animations="disabled")
