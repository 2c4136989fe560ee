"""The dialog's settings in the web chat, in a real headless Chromium (SPEC H4, E1, F5): the
model picker in the header (searchable, by keyboard), the next send asking the picked model,
the choice kept per dialog, the settings panel's system prompt with its character count, and
the tokens under an answer; also on a phone-sized screen and in Chinese."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

from __future__ import annotations

import re
from collections.abc import Iterator
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
from tests.fakemodel import FakeModelServer, Reply

pytestmark = [pytest.mark.browser, pytest.mark.slow]

LISTED = ["gpt-4o-mini"] + [f"model-{name}" for name in "abcdefghij"] + ["pirate-llm"]


@pytest.fixture(scope="module", autouse=True)
def listed(model: FakeModelServer) -> Iterator[None]:
    """The fake server lists more models than fit without a search field."""
    model.models = list(LISTED)
    yield


def turn_models(model: FakeModelServer) -> list[str]:
    return [str(r.body["model"]) for r in model.turn_requests()]


def test_a_picked_model_is_asked_by_the_next_send_and_kept_per_dialog(
    tab: Tab, model: FakeModelServer
) -> None:
    # covers: H4, E1
    page = tab.page
    first = tab.current_dialog()
    expect(page.locator("#model-name")).to_have_text("gpt-4o-mini")

    # By keyboard: Tab to the picker, search, Enter picks the first match.
    page.locator("#model-button").focus()
    page.keyboard.press("Enter")
    search = page.locator("#model-search")
    expect(search).to_be_visible()
    expect(page.locator("#model-list .model-option")).to_have_count(len(LISTED))
    search.fill("pirate")
    expect(page.locator("#model-list .model-option")).to_have_text(["pirate-llm"])
    search.press("Enter")
    expect(page.locator("#model-picker")).to_be_hidden()
    expect(page.locator("#model-name")).to_have_text("pirate-llm")
    assert tab.frames_sent("settings")[-1]["model"] == "pirate-llm"

    before = len(model.turn_requests())
    tab.send("which model are you?")
    expect(tab.answers().last).to_have_text("echo: which model are you?")
    assert turn_models(model)[before:] == ["pirate-llm"]

    # A new dialog starts with the chat's last model; a choice there is its own, and coming
    # back shows the one picked for this dialog.
    tab.new_dialog()
    expect(page.locator("#model-name")).to_have_text("pirate-llm")
    page.locator("#model-button").click()
    page.locator("#model-list .model-option", has_text="model-c").click()
    expect(page.locator("#model-name")).to_have_text("model-c")
    tab.send("and you?")
    expect(tab.answers().last).to_have_text("echo: and you?")
    assert turn_models(model)[-1] == "model-c"
    page.locator(f'.dialog-item[data-dialog-id="{first}"] .dialog-open').click()
    expect(page.locator("#model-name")).to_have_text("pirate-llm")

    # Arrow keys move through the list; Esc closes it and leaves the running answer alone
    # (the next Esc stops it).
    model.script(Reply(text="a long answer", endless=True))
    tab.send("tell me everything")
    tab.wait_stream_contains("a long answer")
    page.locator("#model-button").click()
    page.locator("#model-search").press("ArrowDown")
    expect(page.locator("#model-list .model-option").first).to_be_focused()
    page.keyboard.press("Escape")
    expect(page.locator("#model-picker")).to_be_hidden()
    expect(page.locator("#model-button")).to_be_focused()
    expect(page.locator("#stop-button")).to_be_visible()
    assert not tab.frames_sent("stop")
    page.keyboard.press("Escape")
    expect(page.locator("#stop-button")).to_be_hidden()


def test_the_settings_panel_sets_the_system_prompt_and_answers_show_their_tokens(
    tab: Tab, model: FakeModelServer
) -> None:
    # covers: H4, E1
    page = tab.page
    page.locator("#settings-button").click()
    dialog = page.locator("#settings-dialog")
    expect(dialog).to_be_visible()
    area = page.locator("#settings-prompt")
    expect(area).to_be_focused()
    area.fill("Talk like a pirate.")
    expect(page.locator("#settings-count")).to_have_text("19 / 20000 characters")
    _screenshot(page, "settings-panel.png")
    page.locator("#settings-save").click()
    expect(dialog).to_be_hidden()
    expect(page.locator("#toasts")).to_contain_text("Dialog settings saved.")

    model.script(
        Reply(
            text="Arr, matey.",
            usage={
                "prompt_tokens": 1500,
                "completion_tokens": 12,
                "prompt_tokens_details": {"cached_tokens": 1024},
            },
        )
    )
    before = len(model.turn_requests())
    tab.send("hello")
    expect(tab.answers().last).to_have_text("Arr, matey.")
    request = model.turn_requests()[before]
    assert "Talk like a pirate." in request.messages[0]["content"]

    button = page.locator("#messages .msg-assistant .usage-btn").last
    button.hover()
    usage = page.locator("#messages .msg-assistant .msg-usage").last
    expect(usage).to_have_text(re.compile(r"^1,500 in \(1,024 cached\) · 12 out · [\w.-]+$"))
    _screenshot(page, "settings-usage.png")

    # Reopened, the panel shows what the dialog keeps; Esc closes it unchanged.
    page.locator("#settings-button").click()
    expect(page.locator("#settings-prompt")).to_have_value("Talk like a pirate.")
    page.keyboard.press("Escape")
    expect(dialog).to_be_hidden()


def test_the_picker_fits_a_phone_and_speaks_chinese(context: Any, served: Served) -> None:
    # covers: H4, E1, F5
    page = context.new_page()
    page.set_viewport_size({"width": 390, "height": 800})
    phone = Tab(page, served.base).login()
    page.set_extra_http_headers({"Accept-Language": "zh-Hans"})
    page.reload()
    phone.wait_online()
    expect(page.locator("#settings-button")).to_have_attribute("aria-label", "对话设置")
    page.locator("#model-button").click()
    picker = page.locator("#model-picker")
    expect(picker).to_be_visible()
    box = picker.bounding_box()
    assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390
    expect(page.locator("#model-search")).to_have_attribute("placeholder", re.compile("搜索"))
    _screenshot(page, "settings-phone-zh.png")
    assert not phone.errors
