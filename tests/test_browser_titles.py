"""Real titles at once (issue 54 item 4, SPEC B4), in a real headless Chromium against a
`serve` process with the first title on (CHAT_FIRST_TITLE, on by default; the other browser
modules turn it off): after one exchange the dialog is named in the header and the list."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser import (  # noqa: F401 - the shared fixtures
    PASSWORD,
    Tab,
    _require_chromium,
    browser,
    context,
    model,
)
from tests.fakemodel import FakeModelServer, Reply, echo_reply
from tests.procs import ServeProcess as Served
from tests.procs import embedded_env, migrate_embedded

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def titles_or_echo(request: dict[str, Any]) -> Reply:
    """Turns echo; a title request (no tools, the title prompt) gets a title."""
    if not request.get("tools") and "title" in request["messages"][0]["content"]:
        return Reply(text="Picnic planning")
    return echo_reply(request)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model: FakeModelServer) -> Iterator[Served]:
    _require_chromium()
    var_dir = tmp_path_factory.mktemp("browser-titles-var")
    env = embedded_env(
        var_dir,
        LLM_BASE_URL=model.url,
        DEMO_PASSWORD=PASSWORD,
        CHAT_RATE_LIMIT_PER_MINUTE="100000",
        CHAT_FIRST_TITLE="1",
    )
    migrate_embedded(env, demo_user=True)
    server = Served(var_dir, env)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_a_dialog_is_named_after_its_first_exchange(
    context: Any, served: Served, model: FakeModelServer
) -> None:
    # covers: B4, E1
    model.default = titles_or_echo
    tab = Tab(context.new_page(), served.base).login()
    page = tab.page
    page.locator("#new-dialog").click()
    expect(page.locator("#chat-title")).to_have_text("New dialog")

    tab.send("Help me plan a picnic")

    expect(tab.answers().last).to_have_text("echo: Help me plan a picnic")
    expect(page.locator("#chat-title")).to_have_text("Picnic planning")
    current = page.locator(".dialog-item.is-current .dialog-title")
    expect(current).to_have_text("Picnic planning")
    assert not current.inner_text().startswith("Dialog ")
    assert not tab.errors
