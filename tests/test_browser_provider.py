"""Cut answers in the web chat, in a real headless Chromium (SPEC E1, E5): an answer the model
stopped at its length limit looks cut (a marker, a notice, a Continue button) and Continue
appends the rest to the same answer; an answer withheld by the content filter says so.
Servers and the browser are set up as in tests/browser.py, whose fixtures are used here."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

from __future__ import annotations

import re
import threading

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

CUT = "The first part of a long answer about rivers"
REST = ", and here is the rest of it."


def _expect_joined(tab: Tab) -> None:
    answers = tab.page.locator("#messages .msg-assistant")
    expect(answers).to_have_count(1)
    expect(answers.locator(".md")).to_have_text(CUT + REST)
    expect(tab.page.locator("#messages .msg-cut")).to_have_count(0)
    expect(tab.page.locator("#messages .continue-btn")).to_have_count(0)


def test_a_truncated_answer_looks_cut_and_continue_appends_to_it(
    tab: Tab, model: FakeModelServer
) -> None:
    # covers: E1, E5
    model.script(Reply(text=CUT, finish_reason="length"))

    tab.send("Tell me everything about rivers.")

    answer = tab.page.locator("#messages .msg-assistant").last
    expect(answer.locator(".md")).to_have_text(CUT)
    expect(answer).to_have_class(re.compile(r"\bmsg-cut\b"))
    expect(answer.locator(".msg-cut-marker")).to_have_text("cut off at the length limit")
    expect(tab.page.locator("#messages .turn-notice")).to_contain_text(
        "cut off because it reached the length limit"
    )
    button = answer.locator(".continue-btn")
    expect(button).to_be_visible()
    expect(button).to_have_text("Continue")
    _screenshot(tab.page, "chat-truncated-answer.png")

    gate = threading.Event()
    model.script(Reply(text=REST, chunk=3, gate=gate))
    button.click()

    # The rest streams in right under the cut answer, whose marker and button step aside.
    live = tab.page.locator("#live .msg-streaming.is-continuation")
    expect(live.locator(".md")).to_contain_text("the rest of it")
    expect(answer.locator(".msg-cut-marker")).to_be_hidden()
    gate.set()

    _expect_joined(tab)
    expect(tab.page.locator("#messages .turn-notice")).to_have_count(0)
    sent = tab.frames_sent("continue")
    assert len(sent) == 1 and sent[0]["dialog_id"] == tab.current_dialog()
    assert sent[0].get("client_msg_id")
    queued = [f for f in tab.frames_received("queued") if f.get("mode") == "continue"]
    assert len(queued) == 1
    # The model was asked to go on from the cut answer.
    last = model.requests[-1].messages
    assert last[-2] == {"role": "assistant", "content": CUT}

    # A reload rebuilds the same joined answer from the stored, linked messages.
    tab.page.reload()
    tab.wait_online()
    _expect_joined(tab)


def test_continue_is_offered_on_the_newest_answer_only(tab: Tab, model: FakeModelServer) -> None:
    # covers: E1, E5
    model.script(Reply(text=CUT, finish_reason="length"))
    tab.send("first")
    expect(tab.page.locator("#messages .continue-btn")).to_be_visible()
    tab.send("second")
    expect(tab.page.locator("#messages .msg-assistant")).to_have_count(2)
    # The cut answer keeps its marker, but Continue no longer applies to it.
    expect(tab.page.locator("#messages .msg-cut-marker")).to_have_count(1)
    expect(tab.page.locator("#messages .continue-btn")).to_be_hidden()


def test_a_filtered_answer_says_so_without_an_empty_bubble(
    tab: Tab, model: FakeModelServer
) -> None:
    # covers: E1, E5
    model.script(Reply(text="", finish_reason="content_filter"))

    tab.send("Something the filter dislikes.")

    expect(tab.page.locator("#messages .turn-notice")).to_have_text(
        "The model's content filter stopped the answer."
    )
    expect(tab.page.locator("#messages .msg-assistant")).to_have_count(0)
    expect(tab.page.locator("#stop-button")).to_be_hidden()
