"""Edit, regenerate and versions in the web chat, in a real headless Chromium (SPEC H1, E1):
a user message edited in place (Enter saves and sends, Escape cancels), an answer
regenerated, and "‹ 1/2 ›" switching back and forth, by mouse and by keyboard, on a desktop
and a phone-sized screen, and ↑ in an empty composer editing your last message."""

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


def _user_bubbles(tab: Tab):
    return tab.page.locator("#messages .msg-user .bubble")


def test_edit_regenerate_and_switch_versions(tab: Tab) -> None:
    # covers: H1, E1
    page = tab.page
    tab.send("first question")
    expect(tab.answers().last).to_have_text("echo: first question")

    # Escape cancels an edit and changes nothing.
    message = page.locator("#messages .msg-user").last
    message.hover()
    message.locator(".edit-btn").click()
    box = message.locator(".edit-input")
    expect(box).to_be_focused()
    box.fill("never sent")
    box.press("Escape")
    expect(message.locator(".edit-input")).to_have_count(0)
    expect(_user_bubbles(tab)).to_have_text(["first question"])
    assert tab.frames_sent("edit") == []

    # Enter saves and sends the new version; its answer follows it.
    message.locator(".edit-btn").click()
    box = message.locator(".edit-input")
    box.fill("second version")
    box.press("Enter")
    expect(tab.answers().last).to_have_text("echo: second version")
    expect(_user_bubbles(tab)).to_have_text(["second version"])
    versions = page.locator("#messages .msg-user .versions")
    expect(versions.locator(".version-count")).to_have_text("2/2")

    # Back to the first version and forth again: each loads that branch at once.
    versions.get_by_role("button", name="Previous version").click()
    expect(_user_bubbles(tab)).to_have_text(["first question"])
    expect(tab.answers()).to_have_text(["echo: first question"])
    expect(page.locator("#messages .msg-user .version-count")).to_have_text("1/2")
    # By keyboard: the switcher keeps the focus.
    nxt = page.locator("#messages .msg-user .versions").get_by_role("button", name="Next version")
    nxt.focus()
    page.keyboard.press("Enter")
    expect(_user_bubbles(tab)).to_have_text(["second version"])
    expect(page.locator("#messages .msg-user .version-count")).to_have_text("2/2")

    # Regenerate a completed answer: a second version of the answer.
    model_before = len(tab.frames_sent("regenerate"))
    answer = page.locator("#messages .msg-assistant").last
    answer.hover()
    answer.locator(".regenerate-btn").click()
    expect(page.locator("#messages .msg-assistant .version-count")).to_have_text("2/2")
    assert len(tab.frames_sent("regenerate")) == model_before + 1
    expect(tab.answers()).to_have_count(1)
    page.locator("#messages .msg-assistant .versions").get_by_role(
        "button", name="Previous version"
    ).click()
    expect(page.locator("#messages .msg-assistant .version-count")).to_have_text("1/2")
    expect(tab.answers()).to_have_text(["echo: second version"])


def test_versions_on_a_phone_sized_screen(tab: Tab) -> None:
    # covers: H1, E1
    page = tab.page
    page.set_viewport_size({"width": 390, "height": 760})
    tab.send("on the phone")
    expect(tab.answers().last).to_have_text("echo: on the phone")
    message = page.locator("#messages .msg-user").last
    edit = message.locator(".edit-btn")
    expect(edit).to_be_visible()  # no hover on a phone: the action is always shown
    edit.click()
    box = message.locator(".edit-input")
    box.fill("edited on the phone")
    message.locator(".edit-save").click()
    expect(_user_bubbles(tab)).to_have_text(["edited on the phone"])
    step = page.locator("#messages .msg-user .versions").get_by_role(
        "button", name="Previous version"
    )
    box_size = step.bounding_box()
    assert box_size is not None and box_size["width"] >= 32 and box_size["height"] >= 32
    step.click()
    expect(_user_bubbles(tab)).to_have_text(["on the phone"])
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390


def test_switching_keeps_the_reader_where_they_were(tab: Tab) -> None:
    # covers: H1, E1
    page = tab.page
    long = " ".join(["words to make this message tall"] * 25)
    for n in range(5):
        tab.send(f"message {n} {long}")
        expect(tab.answers()).to_have_count(n + 1)
    third = page.locator("#messages .msg-user").nth(2)
    third.locator(".edit-btn").click()
    third.locator(".edit-input").fill("third, short")
    third.locator(".edit-input").press("Enter")
    expect(tab.answers().last).to_have_text("echo: third, short")
    edited = page.locator("#messages .msg-user").nth(2)
    edited.scroll_into_view_if_needed()
    page.evaluate("document.getElementById('transcript').scrollTop -= 40")
    before = edited.bounding_box()
    assert before is not None
    edited.locator(".versions").get_by_role("button", name="Previous version").click()
    expect(page.locator("#messages .msg-user")).to_have_count(5)  # the long branch again
    switched = page.locator("#messages .msg-user").nth(2)
    expect(switched.locator(".version-count")).to_have_text("1/2")
    after = switched.bounding_box()
    assert after is not None and abs(after["y"] - before["y"]) < 4, (before, after)
    # The keyboard stays on the switcher.
    focused = page.evaluate("document.activeElement.className")
    assert "version-step" in focused


def test_arrow_up_in_an_empty_composer_edits_your_last_message(tab: Tab) -> None:
    # covers: H1, E1
    page = tab.page
    tab.send("first words")
    expect(tab.answers().last).to_have_text("echo: first words")
    tab.send("last words")
    expect(tab.answers().last).to_have_text("echo: last words")

    # The "?" sheet lists ↑ (the page offers editing).
    page.locator("#transcript").focus()
    page.keyboard.press("Shift+?")
    sheet = page.locator("#shortcuts-dialog")
    expect(sheet).to_be_visible()
    expect(sheet.locator("kbd", has_text="↑")).to_have_count(1)
    expect(sheet).to_contain_text("Edit your last message")
    page.keyboard.press("Escape")
    expect(sheet).to_be_hidden()

    # ↑ in a composer with text moves the caret, nothing opens.
    composer = page.locator("#composer-input")
    composer.fill("draft")
    composer.press("ArrowUp")
    expect(page.locator("#messages .edit-input")).to_have_count(0)
    expect(composer).to_be_focused()

    # Empty: ↑ opens the last message's editor; Escape gives the composer back.
    composer.fill("")
    composer.press("ArrowUp")
    last = page.locator("#messages .msg-user").last
    box = last.locator(".edit-input")
    expect(box).to_be_focused()
    expect(box).to_have_value("last words")
    expect(page.locator("#messages .edit-input")).to_have_count(1)
    box.press("Escape")
    expect(page.locator("#messages .edit-input")).to_have_count(0)
    expect(composer).to_be_focused()
    assert tab.frames_sent("edit") == []

    # Again, and Enter saves and sends the new version, which is answered.
    composer.press("ArrowUp")
    box = page.locator("#messages .msg-user").last.locator(".edit-input")
    expect(box).to_have_value("last words")
    box.fill("better last words")
    box.press("Enter")
    expect(tab.answers().last).to_have_text("echo: better last words")
    expect(_user_bubbles(tab)).to_have_text(["first words", "better last words"])
    expect(page.locator("#messages .msg-user").last.locator(".version-count")).to_have_text("2/2")
    edits = tab.frames_sent("edit")
    assert len(edits) == 1 and edits[0]["content"] == "better last words"


def test_arrow_up_with_nothing_to_edit_does_nothing(tab: Tab) -> None:
    # covers: H1, E1
    page = tab.page
    composer = page.locator("#composer-input")
    composer.focus()
    composer.press("ArrowUp")
    expect(page.locator("#messages .edit-input")).to_have_count(0)
    expect(composer).to_be_focused()
