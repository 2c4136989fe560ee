"""The web chat in daily use, in a real headless Chromium (issue 54; E1, B3, C6, D1, F5):
what a user sees when they stop with a message queued, type a path that starts with `/`,
wait for a slow first token, click "New dialog" three times, read code and streamed lists;
copy on their own messages, the keyboard shortcuts sheet and the theme switch."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser import (  # noqa: F401 - the shared fixtures
    Tab,
    _screenshot,
    browser,
    context,
    model,
    served,
    tab,
)
from tests.fakemodel import FakeModelServer, Reply

pytestmark = [pytest.mark.browser, pytest.mark.slow]


# --- 1. Stop never loses a queued message -----------------------------------------------------


def test_stop_gives_a_queued_message_back_to_the_composer(tab: Tab, model: FakeModelServer) -> None:
    # covers: E1, C6
    model.script(Reply(text="A long answer that goes on", chunk=4, endless=True))
    tab.send("Tell me everything.")
    tab.wait_stream_contains("goes on")
    tab.send("And my second question.")
    expect(tab.page.locator("#pending .chip-queued")).to_contain_text("1 ahead")

    tab.page.locator("#stop-button").click()

    expect(tab.page.locator("#pending .msg-pending")).to_have_count(0)
    expect(tab.page.locator("#composer-input")).to_have_value("And my second question.")
    expect(tab.page.locator("#toasts .toast", has_text="not sent")).to_have_count(1)
    expect(tab.page.locator("#send-button")).to_be_enabled()


# --- 2. A message that starts with `/` ------------------------------------------------------


def test_an_unknown_command_keeps_the_text_and_sends_it_as_a_message(tab: Tab) -> None:
    # covers: E1, B3 (PROTOCOL `send` literal)
    page = tab.page
    text = "/usr/bin/python crashes on start"

    tab.send(text)

    offer = page.locator("#composer-offer")
    expect(offer).to_be_visible()
    expect(offer).to_contain_text("/usr")
    expect(page.locator("#composer-input")).to_have_value(text)
    expect(page.locator("#messages .msg-user")).to_have_count(0)

    # By keyboard: back from the composer (past its own buttons) to the offer's button.
    send_literal = offer.get_by_role("button", name="Send as a message")
    page.locator("#composer-input").focus()
    for _ in range(6):
        page.keyboard.press("Shift+Tab")
        if send_literal.evaluate("b => b === document.activeElement"):
            break
    expect(send_literal).to_be_focused()
    page.keyboard.press("Enter")

    expect(page.locator("#messages .msg-user .bubble").last).to_have_text(text)
    expect(tab.answers().last).to_contain_text("echo: " + text)
    expect(page.locator("#composer-input")).to_have_value("")
    expect(offer).to_be_hidden()
    literal = [f for f in tab.frames_sent("send") if f.get("literal")]
    assert len(literal) == 1 and literal[0]["content"] == text

    # A known command works as before and clears the composer once answered.
    tab.send("/info")
    expect(page.locator("#messages .msg-command")).to_have_count(1)
    expect(page.locator("#composer-input")).to_have_value("")


# --- 3. Something moves before the first token -----------------------------------------------


def test_the_thinking_indicator_shows_until_the_first_token(
    tab: Tab, model: FakeModelServer
) -> None:
    # covers: E1, D1
    gate = threading.Event()
    model.script(Reply(text="Finally, an answer.", first_token_gate=gate, chunk=50))
    try:
        tab.send("A slow one, please.")
        dots = tab.page.locator("#live .msg-streaming .thinking")
        expect(dots).to_be_visible()
        expect(dots.locator(".dot")).to_have_count(3)
        tab.page.wait_for_timeout(500)  # still waiting: the indicator stays
        expect(dots).to_be_visible()
        assert all(not f.get("text") for f in tab.frames_received("turn_snapshot"))
    finally:
        gate.set()
    expect(tab.answers().last).to_have_text("Finally, an answer.")
    expect(tab.page.locator("#live .thinking")).to_have_count(0)


# --- 5. "New dialog" is a draft until its first message -------------------------------------


def test_new_dialog_is_a_draft_until_its_first_message(tab: Tab, served: Any) -> None:
    # covers: E1, B2
    page = tab.page
    stored = page.locator(".dialog-item:not(.is-draft)")
    before = stored.count()
    first = tab.current_dialog()
    sent_before = len(tab.sent)

    for _ in range(3):
        page.locator("#new-dialog").click()

    expect(page.locator("#chat-title")).to_have_text("New dialog")
    draft = page.locator(".dialog-item.is-current")
    expect(draft).to_have_count(1)  # one draft, however many clicks
    expect(draft).to_have_class(re.compile("is-draft"))
    expect(draft).to_contain_text("saved with its first message")
    expect(page.locator("#empty")).to_be_visible()
    expect(page.locator("#composer-input")).to_be_focused()
    page.wait_for_timeout(500)
    expect(stored).to_have_count(before)  # nothing stored
    assert tab.sent[sent_before:] == []

    tab.send("Plan a picnic")

    expect(stored).to_have_count(before + 1)
    expect(page.locator(".dialog-item.is-draft")).to_have_count(0)
    expect(page.locator(".dialog-item.is-current")).to_have_count(1)
    assert tab.current_dialog() != first
    expect(page.locator("#messages .msg-user .bubble")).to_have_text(["Plan a picnic"])
    expect(tab.answers().last).to_have_text("echo: Plan a picnic")
    # The welcome speaks of the web chat, not of terminal commands.
    welcome = page.locator("#messages .msg-system").first
    expect(welcome).to_contain_text("your list of dialogs")
    expect(welcome).not_to_contain_text("/switch")
    news = [f for f in tab.sent[sent_before:] if f.get("content") == "/new"]
    assert len(news) == 1


# --- 6. Highlighted code --------------------------------------------------------------------


PYTHON = "Here:\n\n```python\ndef greet(name):\n    return f'hi {name}'  # say hi\n```\n\nDone."


def test_fenced_python_is_highlighted_in_both_themes(tab: Tab, model: FakeModelServer) -> None:
    # covers: E1 (highlight.js under the CSP: script-src 'self')
    model.script(Reply(text=PYTHON, chunk=6, delay=0.02))
    tab.send("Show me a function.")

    code = tab.answers().last.locator("pre code")
    expect(code).to_have_class(re.compile("is-highlighted"))
    expect(code.locator("span.hljs-keyword").first).to_have_text("def")
    assert code.locator("span").count() >= 3
    expect(code).to_have_text("def greet(name):\n    return f'hi {name}'  # say hi")
    light = code.locator("span.hljs-keyword").first.evaluate("e => getComputedStyle(e).color")

    tab.page.locator("#theme-select").select_option("dark")
    dark = code.locator("span.hljs-keyword").first.evaluate("e => getComputedStyle(e).color")
    assert light != dark
    _screenshot(tab.page, "chat-code-dark.png")


def test_a_streamed_answer_colours_each_closed_block_once(tab: Tab, model: FakeModelServer) -> None:
    # covers: E1, D1 (no re-highlighting of the whole answer on every snapshot)
    blocks = "".join(f"```python\nx{i} = {i}\n```\n\n" for i in range(3))
    model.script(Reply(text=blocks + "and some more words. " * 30, chunk=5, delay=0.02))
    tab.page.evaluate(
        """() => {
          window.__hl = 0;
          const real = window.hljs.highlight;
          window.hljs.highlight = function () {
            window.__hl += 1;
            return real.apply(this, arguments);
          };
        }"""
    )
    tab.send("Three blocks.")
    expect(tab.answers().last.locator("pre code.is-highlighted")).to_have_count(3)
    snapshots = len(tab.frames_received("turn_snapshot"))
    calls = tab.page.evaluate("window.__hl")
    assert snapshots > 10
    assert calls == 3, (calls, snapshots)


# --- 7. No flicker while markdown streams ---------------------------------------------------


def test_a_streamed_list_never_shows_a_heading(tab: Tab, model: FakeModelServer) -> None:
    # covers: E1, D1
    body = "Steps to follow\n- first step\n- second step\n- third step\n"
    model.script(Reply(text=body, chunk=1, delay=0.03))
    tab.page.evaluate(
        """() => {
          window.__headings = [];
          new MutationObserver(() => {
            document.querySelectorAll('#live h1, #live h2').forEach(
              h => window.__headings.push(h.textContent));
          }).observe(document.getElementById('live'), {childList: true, subtree: true});
        }"""
    )
    tab.send("List the steps.")
    expect(tab.answers().last.locator("li")).to_have_count(3)
    # "Steps to follow\n-" is a heading in markdown until the item's text arrives.
    assert tab.page.evaluate("window.__headings") == []


def test_a_marker_only_last_line_waits_for_its_next_characters(tab: Tab) -> None:
    # covers: E1, D1 (format.js, as the page imports it)
    out = tab.page.evaluate(
        """async () => {
          const f = await import("/static/chat/format.js");
          return ["Intro\\n-", "Intro\\n==", "Intro\\n- one", "1.", "a\\n1.",
                  "```py\\nx = (\\n)", "text\\n```", "Intro\\n|--"]
            .map(t => [f.holdMarkerLine(t), f.closeOpenMarkdown(t), f.hasOpenFence(t)]);
        }"""
    )
    assert out == [
        ["Intro\n", "Intro\n", False],
        ["Intro\n", "Intro\n", False],
        ["Intro\n- one", "Intro\n- one", False],
        ["", "", False],
        ["a\n", "a\n", False],
        # Inside an open code fence every line is code, shown as it comes.
        ["```py\nx = (\n)", "```py\nx = (\n)\n```", True],
        ["text\n", "text\n", True],
        ["Intro\n", "Intro\n", False],
    ]


# --- 8. A table header on a phone -------------------------------------------------------------


def test_a_table_header_never_breaks_mid_word_on_a_phone(
    context: Any, served: Any, model: FakeModelServer
) -> None:
    # covers: E1
    page = context.new_page()
    page.set_viewport_size({"width": 360, "height": 740})
    phone = Tab(page, served.base).login()
    model.script(
        Reply(text="| Version | Stable | Released |\n|---|---|---|\n| 5.2 | yes | 2025 |\n")
    )
    phone.new_dialog()
    phone.send("Which version?")
    header = phone.answers().last.locator("th").nth(1)
    expect(header).to_have_text("Stable")
    height = header.evaluate("e => e.getBoundingClientRect().height")
    line = header.evaluate("e => parseFloat(getComputedStyle(e).lineHeight)")
    padding = header.evaluate(
        "e => { const s = getComputedStyle(e);"
        " return parseFloat(s.paddingTop) + parseFloat(s.paddingBottom); }"
    )
    assert height - padding < line * 1.5  # one line: the word is whole
    assert not phone.errors


# --- What a daily user reaches for ----------------------------------------------------------


def test_copy_on_your_own_message(tab: Tab, context: Any) -> None:
    # covers: E1
    context.grant_permissions(["clipboard-read", "clipboard-write"])
    tab.send("Words worth keeping")
    expect(tab.answers().last).to_contain_text("echo: Words worth keeping")
    user = tab.page.locator("#messages .msg-user").last
    user.hover()
    copy = user.get_by_role("button", name="Copy")
    copy.click()
    expect(copy).to_contain_text("Copied")
    assert tab.page.evaluate("navigator.clipboard.readText()") == "Words worth keeping"


def test_keyboard_shortcuts_and_their_sheet(tab: Tab) -> None:
    # covers: E1
    page = tab.page
    page.locator("#transcript").focus()
    page.keyboard.press("Shift+?")
    sheet = page.locator("#shortcuts-dialog")
    expect(sheet).to_be_visible()
    expect(sheet).to_contain_text("Start a new dialog")
    expect(sheet).to_contain_text("Stop the answer")
    expect(sheet.locator("kbd", has_text="Esc")).to_have_count(1)
    expect(sheet).to_contain_text("Search your dialogs")  # the page has a search box
    page.keyboard.press("Escape")
    expect(sheet).to_be_hidden()

    # "?" typed in the composer is text, not a shortcut.
    box = page.locator("#composer-input")
    box.click()
    page.keyboard.type("why?")
    expect(sheet).to_be_hidden()
    expect(box).to_have_value("why?")

    page.keyboard.press("Control+Shift+O")
    expect(page.locator("#chat-title")).to_have_text("New dialog")
    expect(box).to_be_focused()


def test_the_theme_switch_is_remembered_per_browser(tab: Tab, context: Any) -> None:
    # covers: E1
    page = tab.page

    def background() -> str:
        return str(
            page.evaluate("getComputedStyle(document.querySelector('.main')).backgroundColor")
        )

    page.emulate_media(color_scheme="light")
    light = background()
    page.locator("#theme-select").select_option("dark")
    dark = background()
    assert dark != light

    page.reload()
    tab.wait_online()
    expect(page.locator("#theme-select")).to_have_value("dark")
    assert background() == dark

    page.locator("#theme-select").select_option("system")
    assert background() == light
    page.emulate_media(color_scheme="dark")
    assert background() == dark
    page.locator("#theme-select").select_option("light")
    assert background() == light


# --- 9. Dialogs made through the API ----------------------------------------------------------


def test_a_dialog_made_through_the_api_is_listed_and_usable(tab: Tab) -> None:
    # covers: E1, E3
    page = tab.page
    status = page.evaluate(
        """async () => {
          const config = JSON.parse(document.getElementById('chat-config').textContent);
          const response = await fetch('/api/v1/sessions', {
            method: 'POST',
            headers: {'Content-Type': 'application/json', 'X-CSRFToken': config.csrf_token},
            body: JSON.stringify({title: 'Made by a script'}),
          });
          return response.status;
        }"""
    )
    assert status == 201
    page.reload()
    tab.wait_online()

    expect(page.locator(".dialog-group", has_text="API dialogs")).to_be_visible()
    item = page.locator(".dialog-item", has_text="Made by a script")
    expect(item.locator(".dialog-badge")).to_have_count(0)  # not read-only: it is yours
    item.locator(".dialog-open").click()
    expect(page.locator("#chat-title")).to_have_text("Made by a script")
    expect(page.locator("#composer-input")).to_be_enabled()

    tab.send("hello from the web")

    expect(tab.answers().last).to_have_text("echo: hello from the web")
