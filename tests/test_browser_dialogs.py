"""Dialogs and the connection in the web chat, in a real headless Chromium (E1, B3, D2, D3):
new / switch / rename / delete, unread marks, older pages on scroll, and a reconnect with
resync after a server restart."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

from __future__ import annotations

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
from tests.fakemodel import FakeModelServer

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_dialogs_new_switch_rename_delete(tab: Tab, context: Any, served: Served) -> None:
    # covers: E1, B3, D3
    page = tab.page
    first = tab.current_dialog()
    tab.send("alpha message")
    expect(tab.answers().last).to_have_text("echo: alpha message")

    second = tab.new_dialog()
    assert second != first
    expect(page.locator("#messages .msg-user")).to_have_count(0)
    tab.send("beta message")
    expect(tab.answers().last).to_have_text("echo: beta message")
    expect(page.locator(f'.dialog-item[data-dialog-id="{first}"]')).to_have_count(1)

    # Switch back: the first dialog's transcript, and only it.
    page.locator(f'.dialog-item[data-dialog-id="{first}"] .dialog-open').click()
    expect(page.locator(f'.dialog-item[data-dialog-id="{first}"]')).to_have_class(
        re.compile("is-current")
    )
    expect(page.locator("#messages .msg-user .bubble")).to_have_text(["alpha message"])

    # A second tab watches the titles change live.
    other = Tab(context.new_page(), served.base).open()
    # The user acts in the first tab, the one in front (Chromium runs no animation frames for
    # a tab behind another, so every click there would wait for its stability check).
    page.bring_to_front()

    page.locator(f'.dialog-item[data-dialog-id="{second}"] .dialog-more').click()
    page.get_by_role("menuitem", name="Rename").click()
    field = page.locator(".dialog-rename")
    field.fill("Renamed beta")
    field.press("Enter")

    title = other.page.locator(f'.dialog-item[data-dialog-id="{second}"] .dialog-title')
    expect(title).to_have_text("Renamed beta")
    expect(page.locator(f'.dialog-item[data-dialog-id="{second}"] .dialog-title')).to_have_text(
        "Renamed beta"
    )
    # Renaming another dialog does not switch to it.
    expect(page.locator(".dialog-item.is-current")).to_have_attribute("data-dialog-id", first)

    # Rename the current dialog from the header.
    page.locator("#chat-title").click()
    header_field = page.locator(".title-rename")
    header_field.fill("Alpha, renamed")
    header_field.press("Enter")
    expect(page.locator("#chat-title")).to_have_text("Alpha, renamed")
    expect(
        other.page.locator(f'.dialog-item[data-dialog-id="{first}"] .dialog-title')
    ).to_have_text("Alpha, renamed")

    # Delete the second dialog, after confirming.
    page.locator(f'.dialog-item[data-dialog-id="{second}"] .dialog-more').click()
    page.get_by_role("menuitem", name="Delete").click()
    confirm = page.locator("#confirm-dialog")
    expect(confirm).to_be_visible()
    expect(confirm).to_contain_text("Renamed beta")
    page.locator("#confirm-cancel").click()
    expect(page.locator(f'.dialog-item[data-dialog-id="{second}"]')).to_have_count(1)

    page.locator(f'.dialog-item[data-dialog-id="{second}"] .dialog-more').click()
    page.get_by_role("menuitem", name="Delete").click()
    page.locator("#confirm-ok").click()
    expect(page.locator(f'.dialog-item[data-dialog-id="{second}"]')).to_have_count(0)
    expect(other.page.locator(f'.dialog-item[data-dialog-id="{second}"]')).to_have_count(0)
    expect(page.locator(".dialog-item.is-current")).to_have_attribute("data-dialog-id", first)
    assert not other.errors, other.errors


def test_other_dialogs_activity_marks_them_unread(
    tab: Tab, context: Any, served: Served, model: FakeModelServer
) -> None:
    # covers: E1, D2
    busy = tab.current_dialog()
    other = Tab(context.new_page(), served.base).open()
    quiet = other.new_dialog()
    assert quiet != busy
    # `tab` is still on `busy`; an answer there marks it unread in the other tab.
    tab.send("ping from the first tab")
    expect(tab.answers().last).to_have_text("echo: ping from the first tab")

    item = other.page.locator(f'.dialog-item[data-dialog-id="{busy}"]')
    expect(item).to_have_class(re.compile("is-unread"))
    expect(item.locator(".unread-dot")).to_have_count(1)
    expect(other.page.locator(".dialog-item").first).to_have_attribute("data-dialog-id", busy)

    item.locator(".dialog-open").click()
    expect(item).to_have_class(re.compile("is-current"))
    expect(item).not_to_have_class(re.compile("is-unread"))
    expect(other.page.locator("#messages .msg-user .bubble").last).to_have_text(
        "ping from the first tab"
    )
    assert not other.errors, other.errors


INJECT_MANY = """
async ([dialog, n]) => {
  const ws = new WebSocket(`ws://${location.host}/ws/chat/?dialog_id=${dialog}`);
  await new Promise((ok, fail) => { ws.onopen = ok; ws.onerror = fail; });
  let answered = 0;
  const done = new Promise(ok => {
    ws.onmessage = ev => {
      const f = JSON.parse(ev.data);
      if ((f.type === "queued" || f.type === "error") && ++answered === n) ok();
    };
  });
  for (let i = 0; i < n; i++) {
    ws.send(JSON.stringify({type: "inject", dialog_id: dialog, content: `note ${i}`,
                            client_msg_id: `note-${i}`}));
  }
  await done;
  ws.close();
}
"""


def test_older_messages_load_when_scrolling_up(tab: Tab) -> None:
    # covers: E1 (history pages with before_seq, scroll position kept)
    page = tab.page
    dialog = tab.current_dialog()
    # Idle injects (C5) are user messages without model turns: a long history, quickly.
    page.evaluate(INJECT_MANY, [dialog, 120])
    expect(page.locator("#messages .msg-user")).to_have_count(120)  # live, as deltas

    page.reload()
    tab.wait_online()
    # The first page is the most recent 100 of 121 messages (welcome + 120 notes).
    expect(page.locator("#messages .msg")).to_have_count(100)
    first = page.locator("#messages .msg-user .bubble").first
    expect(first).to_have_text("note 20")
    assert page.locator("#transcript").evaluate("el => el.scrollTop") > 0  # at the bottom

    page.locator("#transcript").evaluate("el => { el.scrollTop = 0; }")

    expect(page.locator("#messages .msg")).to_have_count(121)
    expect(page.locator("#messages .msg").first).to_have_class(re.compile("msg-system"))
    expect(page.locator("#messages .msg-user .bubble").first).to_have_text("note 0")
    # The reader stays where they were: "note 20" is still at the top of the view.
    offset = page.locator("#messages .msg-user .bubble", has_text=re.compile(r"^note 20$"))
    top = offset.evaluate(
        "el => el.getBoundingClientRect().top"
        " - document.getElementById('transcript').getBoundingClientRect().top"
    )
    assert 0 <= top < 200, top
    pages = [f for f in tab.frames_sent("history") if "before_seq" in f]
    assert len(pages) == 1 and pages[0]["before_seq"] == 22
    expect(page.locator("#older")).to_be_hidden()


def test_reconnects_and_resyncs_after_a_server_restart(tab: Tab, served: Served) -> None:
    # covers: E1 (reconnect with resync), D2
    page = tab.page
    tab.send("before the restart")
    expect(tab.answers().last).to_have_text("echo: before the restart")
    dialog = tab.current_dialog()

    served.stop()
    expect(page.locator("#app")).to_have_attribute("data-conn", "reconnecting")
    expect(page.locator("#conn-banner")).to_be_visible()
    expect(page.locator("#conn-banner")).to_contain_text("Reconnecting")
    _screenshot(page, "chat-reconnecting.png")
    served.start()

    expect(page.locator("#app")).to_have_attribute("data-conn", "online", timeout=40_000)
    expect(page.locator("#conn-banner")).to_be_hidden()
    expect(page.locator(".dialog-item.is-current")).to_have_attribute("data-dialog-id", dialog)
    expect(page.locator("#messages .msg-user .bubble")).to_have_text(["before the restart"])
    tab.send("after the restart")
    expect(tab.answers().last).to_have_text("echo: after the restart")
    # The resync came from the server's own frames on reopen: two connections, one history
    # each, and no `history` asked by the client.
    assert len(tab.frames_received("session_history")) >= 2
    assert not [f for f in tab.frames_sent("history") if "before_seq" not in f]
