"""Search, export, import and share links in the web chat, in a real headless Chromium
(SPEC H2): Ctrl+K search opening a hit at its message (on an older page, highlighted), the
dialog menu's export and share link (made, opened without a login, revoked), the sidebar's
import, and the search on a phone-sized screen."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

# covers: H2

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser import (  # noqa: F401 - the shared fixtures
    Served,
    Tab,
    _screenshot,
    browser,
    context,
    model,
    served,
    tab,
)
from tests.test_browser_dialogs import INJECT_MANY
from tests.test_carry_api import CHATGPT

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NEEDLE = """
async ([dialog, text]) => {
  const ws = new WebSocket(`ws://${location.host}/ws/chat/?dialog_id=${dialog}`);
  await new Promise((ok, fail) => { ws.onopen = ok; ws.onerror = fail; });
  const done = new Promise(ok => {
    ws.onmessage = ev => { const f = JSON.parse(ev.data); if (f.type === "queued") ok(); };
  });
  ws.send(JSON.stringify({type: "inject", dialog_id: dialog, content: text, client_msg_id: "n"}));
  await done;
  ws.close();
}
"""


def test_search_opens_the_hit_at_its_message(tab: Tab) -> None:
    page = tab.page
    first = tab.current_dialog()
    page.evaluate(NEEDLE, [first, "明天的天气预报说有雨"])
    page.evaluate(INJECT_MANY, [first, 130])  # the needle ends up on an older page
    expect(page.locator("#messages .msg-user")).to_have_count(131)
    tab.new_dialog()

    page.keyboard.press("Control+K")
    expect(page.locator("#search-input")).to_be_focused()
    page.keyboard.type("天气")
    hit = page.locator("#search-results .search-hit")
    expect(hit).to_have_count(1)
    expect(hit.locator("mark")).to_have_text("天气")
    expect(page.locator("#dialog-list")).to_be_hidden()
    _screenshot(page, "search-results.png")

    page.keyboard.press("ArrowDown")
    expect(hit).to_be_focused()
    page.keyboard.press("Enter")
    expect(page.locator(".dialog-item.is-current")).to_have_attribute("data-dialog-id", first)
    found = page.locator("#messages .msg-found")
    expect(found).to_have_count(1)
    expect(found.locator(".bubble")).to_have_text("明天的天气预报说有雨")
    expect(found).to_be_in_viewport()

    # The highlight spans count code points, as the server does (an emoji is one).
    pieces = page.evaluate(
        "async () => (await import('/static/chat/search.js'))"
        ".snippetPieces('\U0001f600 ab cd', [[2, 4], [5, 99]])"
    )
    assert pieces == [
        {"text": "\U0001f600 ", "mark": False},
        {"text": "ab", "mark": True},
        {"text": " ", "mark": False},
        {"text": "cd", "mark": True},
    ]

    # Esc in the box clears the search and brings the dialog list back.
    page.keyboard.press("Control+K")
    page.keyboard.press("Escape")
    expect(page.locator("#search-input")).to_have_value("")
    expect(page.locator("#dialog-list")).to_be_visible()


def test_export_share_and_import_from_the_menus(tab: Tab, browser: Any, served: Served) -> None:
    page = tab.page
    dialog = tab.current_dialog()
    tab.send("share this answer")
    expect(tab.answers().last).to_have_text("echo: share this answer")
    item = page.locator(f'.dialog-item[data-dialog-id="{dialog}"]')

    item.locator(".dialog-more").click()
    with page.expect_download() as download:
        page.get_by_role("menuitem", name="Export as JSON").click()
    saved = download.value
    assert saved.suggested_filename.endswith(".json")
    document = json.loads(open(saved.path(), encoding="utf-8").read())
    assert document["format"] == "chatcore.dialog.v1"
    assert [m["content"] for m in document["messages"]][-2:] == [
        "share this answer",
        "echo: share this answer",
    ]

    item.locator(".dialog-more").click()
    page.get_by_role("menuitem", name="Share…").click()
    share = page.locator("#share-dialog")
    expect(share).to_be_visible()
    share.get_by_role("button", name="Create a link").click()
    url_field = share.locator(".share-url")
    expect(url_field).to_have_count(1)
    url = url_field.input_value()
    assert re.match(re.escape(served.base) + r"/s/[\w-]{32}$", url), url

    stranger = browser.new_context()  # no login
    public = stranger.new_page()
    response = public.goto(url)
    assert response is not None and response.status == 200
    expect(public.locator(".msg-assistant .md")).to_have_text("echo: share this answer")
    _screenshot(public, "share-page.png")

    share.get_by_role("button", name="Revoke").click()
    expect(url_field).to_have_count(0)
    response = public.goto(url)
    assert response is not None and response.status == 404
    stranger.close()
    share.get_by_role("button", name="Close").click()
    expect(share).to_be_hidden()

    with page.expect_file_chooser() as chooser:
        page.locator("#import-button").click()
    chooser.value.set_files(
        files=[
            {
                "name": "conversation.json",
                "mimeType": "application/json",
                "buffer": json.dumps(CHATGPT).encode(),
            }
        ]
    )
    expect(page.locator(".dialog-item.is-current .dialog-title")).to_have_text("Trip to Kyoto")
    expect(page.locator("#messages .msg-user .bubble")).to_have_text(["Plan a day in Kyoto"])
    expect(tab.answers()).to_have_text(["Fushimi Inari at dawn, then tea."])


def test_search_on_a_phone(tab: Tab) -> None:
    page = tab.page
    dialog = tab.current_dialog()
    tab.send("pineapple pizza opinions")
    expect(tab.answers().last).to_have_text("echo: pineapple pizza opinions")
    tab.new_dialog()
    page.set_viewport_size({"width": 390, "height": 780})
    page.keyboard.press("Control+K")  # opens the slide-over with the box focused
    expect(page.locator("#app")).to_have_class(re.compile("sidebar-open"))
    expect(page.locator("#search-input")).to_be_focused()
    page.keyboard.type("pineapple")
    hits = page.locator("#search-results .search-hit")
    expect(hits).to_have_count(2)  # the question and the answer
    hits.first.click()
    expect(page.locator("#app")).not_to_have_class(re.compile("sidebar-open"))
    expect(page.locator(".dialog-item.is-current")).to_have_attribute("data-dialog-id", dialog)
    expect(page.locator("#messages .msg-found")).to_be_in_viewport()
