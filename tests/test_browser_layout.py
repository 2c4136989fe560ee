"""How the web chat looks, in a real headless Chromium (E1): usable on a phone-sized screen,
and screenshots of both themes for a human look (artifacts/)."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser import (  # noqa: F401 - the shared fixtures
    Served,
    Tab,
    _screenshot,
    browser,
    model,
    served,
)
from tests.fakemodel import FakeModelServer, Reply

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_phone_sized_screen(browser: Any, served: Served) -> None:
    # covers: E1 (usable on a phone-sized screen)
    ctx = browser.new_context(
        viewport={"width": 375, "height": 740},
        device_scale_factor=2,
        is_mobile=True,
        has_touch=True,
        base_url=served.base,
    )
    try:
        t = Tab(ctx.new_page(), served.base).login()
        page = t.page
        expect(page.locator("#composer-input")).to_be_visible()
        expect(page.locator("#send-button")).to_be_visible()
        menu = page.locator("#menu-button")
        expect(menu).to_be_visible()
        expect(page.locator("#sidebar")).not_to_be_in_viewport()
        t.send("Hello from a phone")
        expect(t.answers().last).to_have_text("echo: Hello from a phone")
        box = page.locator("#composer-input").bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 375
        _screenshot(page, "chat-phone.png")

        menu.click()
        expect(page.locator("#sidebar")).to_be_in_viewport()
        expect(page.locator("#new-dialog")).to_be_visible()
        _screenshot(page, "chat-phone-sidebar.png")
        page.locator("#scrim").click(position={"x": 360, "y": 400})
        expect(page.locator("#sidebar")).not_to_be_in_viewport()
        assert not t.errors, t.errors
    finally:
        ctx.close()


SHOWCASE = """Here is a short plan, with code:

1. **Read** the protocol.
2. Render with `marked`, then sanitise.
3. Stream the tail.

```python
def tail(known: str, offset: int, text: str) -> str:
    return known[:offset] + text
```

| frame | meaning |
|---|---|
| `history_delta` | new messages |
| `turn_snapshot` | the answer so far |

> Model output is untrusted.
"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_screenshots_of_the_chat(
    browser: Any, served: Served, model: FakeModelServer, scheme: str
) -> None:
    # Not an assertion on looks: pictures for a human (artifacts/), and the page renders
    # markdown blocks (code with a copy button, tables) in both themes.
    ctx = browser.new_context(
        viewport={"width": 1280, "height": 820}, color_scheme=scheme, base_url=served.base
    )
    try:
        t = Tab(ctx.new_page(), served.base).login()
        t.new_dialog()
        page = t.page
        _screenshot(page, f"chat-empty-{scheme}.png")
        model.script(Reply(text=SHOWCASE, chunk=20, delay=0.01))
        t.send("How does the web chat render answers?")
        answer = t.answers().last
        expect(answer.locator(".code-block .code-copy")).to_have_count(1)
        expect(answer.locator("table")).to_have_count(1)
        model.script(Reply(text="Still writing the second answer, word by word", endless=True))
        t.send("And a second question while you stream?")
        t.wait_stream_contains("word by word")
        page.mouse.move(0, 0)
        _screenshot(page, f"chat-desktop-{scheme}.png")
        page.locator("#stop-button").click()
        expect(page.locator("#messages .turn-note")).to_be_visible()
        assert not t.errors, t.errors
    finally:
        ctx.close()
