"""The composer of the web chat in a real headless Chromium (E1, B3): slash commands typed in
it, Enter sends and Shift+Enter adds a line."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.browser import (  # noqa: F401 - the shared fixtures
    Tab,
    browser,
    context,
    model,
    served,
    tab,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_slash_commands_typed_in_the_composer(tab: Tab) -> None:
    # covers: E1, B3
    page = tab.page

    tab.send("/info")

    line = page.locator("#messages .msg-command .command-note").last
    expect(line).to_contain_text(tab.current_dialog())
    expect(page.locator("#messages .msg-user")).to_have_count(0)  # not a model turn

    tab.send("/switch no-such-dialog")

    toast = page.locator("#toasts .toast-error")
    expect(toast).to_contain_text("no-such-dialog")
    toast.locator(".toast-close").click()
    expect(toast).to_have_count(0)

    tab.send("/rename Typed title")
    expect(page.locator("#chat-title")).to_have_text("Typed title")
    expect(page.locator(".dialog-item.is-current .dialog-title")).to_have_text("Typed title")


def test_enter_sends_and_shift_enter_adds_a_line(tab: Tab) -> None:
    # covers: E1
    box = tab.page.locator("#composer-input")
    box.click()
    box.type("line one")
    box.press("Shift+Enter")
    box.type("line two")

    assert box.input_value() == "line one\nline two"
    expect(tab.page.locator("#messages .msg-user")).to_have_count(0)

    box.press("Enter")

    expect(tab.page.locator("#messages .msg-user .bubble").last).to_have_text("line one\nline two")
    assert box.input_value() == ""
    expect(tab.answers().last).to_contain_text("echo: line one")
