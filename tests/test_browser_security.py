"""The web chat's security behaviour in a real headless Chromium against a real `serve`
process (SPEC F8, E1): a crafted link (`/#%`) does not break the page; the page runs under
its Content-Security-Policy without a single violation; signing out in one tab ends the
socket of another tab (closed with 4401), which then shows the login page."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser import Tab, browser, model, served  # noqa: F401 - shared fixtures
from tests.fakemodel import FakeModelServer, echo_reply
from tests.procs import ServeProcess as Served

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def context(browser: Any, served: Served, model: FakeModelServer) -> Iterator[Any]:  # noqa: F811
    with model._lock:
        model.replies.clear()
    model.default = echo_reply
    ctx = browser.new_context(viewport={"width": 1280, "height": 820}, base_url=served.base)
    try:
        yield ctx
    finally:
        ctx.close()


def csp_violations(page: Any) -> list[str]:
    found: list[str] = []
    page.on(
        "console",
        lambda msg: found.append(msg.text) if "Content Security Policy" in msg.text else None,
    )
    return found


@pytest.mark.parametrize("fragment", ["%", "%E0%A4%A", "%zz", "a%2"])
def test_a_crafted_link_does_not_break_the_page(
    context: Any,
    served: Served,  # noqa: F811
    fragment: str,
) -> None:
    # covers: F8 (item: `/#%` left the page on "Connecting…"), E1
    tab = Tab(context.new_page(), served.base)
    violations = csp_violations(tab.page)
    tab.login()
    tab.page.goto("about:blank")  # a fresh load of the page, not a fragment change
    tab.page.goto(f"{served.base}/#{fragment}")
    tab.wait_online()
    # It is usable: a send is answered.
    tab.send("still works")
    expect(tab.answers().last).to_contain_text("echo: still works")
    assert tab.errors == []
    assert violations == []


def test_a_link_to_a_dialog_still_opens_it(context: Any, served: Served) -> None:  # noqa: F811
    # covers: E1 (the guard keeps valid links working)
    tab = Tab(context.new_page(), served.base)
    tab.login()
    first = tab.current_dialog()
    tab.new_dialog()
    tab.page.goto(f"{served.base}/#{first}")
    tab.page.reload()
    tab.wait_online()
    expect(tab.page.locator(".dialog-item.is-current")).to_have_attribute("data-dialog-id", first)
    assert tab.errors == []


def test_signing_out_in_one_tab_ends_the_other_tabs_socket(
    context: Any,
    served: Served,  # noqa: F811
) -> None:
    # covers: F8 (logout closes that login's sockets with 4401), E1
    first = Tab(context.new_page(), served.base)
    violations = csp_violations(first.page)
    first.login()
    second = Tab(context.new_page(), served.base).open()
    first.page.bring_to_front()  # the user signs out in the tab in front
    first.page.get_by_role("button", name="Sign out").click()
    first.page.wait_for_url(re.compile(r"/accounts/login/"))
    # The other tab's socket is closed by the server (4401): it goes to the login page.
    second.page.wait_for_url(re.compile(r"/accounts/login/"), timeout=10_000)
    assert first.errors == [] and second.errors == []
    assert violations == []
