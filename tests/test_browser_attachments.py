"""Attachments in the web chat, in a real headless Chromium (H3, E1): the file picker, the
chips with upload progress and remove, thumbnails in the history that open the full image,
file chips that download, on a phone-sized screen and by keyboard."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

from __future__ import annotations

import base64
import re
from pathlib import Path

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
from tests.fakemodel import FakeModelServer, Reply
from tests.file_helpers import png_bytes

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _pick(tab: Tab, *paths: Path) -> None:
    with tab.page.expect_file_chooser() as chooser:
        tab.page.locator("#attach-button").click()
    chooser.value.set_files([str(p) for p in paths])


def test_an_image_from_the_file_picker_reaches_the_model_and_shows_as_a_thumbnail(
    tab: Tab, model: FakeModelServer, tmp_path: Path
) -> None:
    # covers: H3, E1
    page = tab.page
    data = png_bytes((120, 80), "green")
    image = tmp_path / "green.png"
    image.write_bytes(data)

    _pick(tab, image)

    chip = page.locator("#attach-chips .attach-chip")
    expect(chip).to_have_count(1)
    expect(chip.locator(".attach-name")).to_have_text("green.png")
    expect(chip.locator(".attach-meta")).to_have_text(f"{len(data)} B")  # uploaded
    # Its preview is the server's thumbnail (the page's policy allows no blob: images).
    page.wait_for_function(
        "() => { const i = document.querySelector('#attach-chips .attach-preview');"
        " return i && i.complete && i.naturalWidth > 0; }"
    )
    expect(page.locator("#send-button")).to_be_enabled()

    model.script(Reply(text="A green rectangle."))
    tab.send("What colour is it?")

    thumb = page.locator("#messages .msg-user .attach-thumb img")
    expect(thumb).to_have_count(1)
    page.wait_for_function(
        "() => { const i = document.querySelector('#messages .attach-thumb img');"
        " return i && i.complete && i.naturalWidth > 0; }"
    )
    expect(page.locator("#attach-chips")).to_be_hidden()
    expect(tab.answers().last).to_have_text("A green rectangle.")
    sent = tab.frames_sent("send")[-1]
    assert len(sent["attachments"]) == 1

    parts = [m for m in model.turn_requests()[-1].messages if m["role"] == "user"][-1]["content"]
    url = parts[1]["image_url"]["url"]
    assert base64.b64decode(url.split(",", 1)[1]) == data

    # Click: the full image in a new tab.
    with page.context.expect_page() as opened:
        thumb.click()
    full = opened.value
    full.wait_for_load_state()
    assert full.url.endswith("/api/v1/files/" + sent["attachments"][0])
    full.close()

    # The history after a reload shows it too.
    page.reload()
    tab.wait_online()
    expect(page.locator("#messages .msg-user .attach-thumb img")).to_have_count(1)


def test_file_chips_on_a_phone_by_keyboard(
    tab: Tab, model: FakeModelServer, tmp_path: Path
) -> None:
    # covers: H3, E1
    page = tab.page
    page.set_viewport_size({"width": 390, "height": 760})
    notes = tmp_path / "notes.md"
    notes.write_text("# Plan\n\n- ship it\n", encoding="utf-8")
    extra = tmp_path / "extra.txt"
    extra.write_text("not this one", encoding="utf-8")
    binary = tmp_path / "tool.png"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(64))

    _pick(tab, notes, extra, binary)

    chips = page.locator("#attach-chips .attach-chip")
    expect(chips).to_have_count(3)
    refused = chips.filter(has_text="tool.png")
    expect(refused).to_have_class("attach-chip is-error")
    expect(page.locator("#toasts .toast-error")).to_contain_text("tool.png")

    # Remove by keyboard: focus the remove button of a chip and press Enter.
    for name in ("extra.txt", "tool.png"):
        page.get_by_role("button", name=f"Remove {name}").focus()
        page.keyboard.press("Enter")
    expect(chips).to_have_count(1)
    box = chips.first.bounding_box()
    assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390

    model.script(Reply(text="Noted."))
    page.locator("#composer-input").focus()
    page.keyboard.press("Enter")  # attachments alone may be sent

    link = page.locator("#messages .msg-user a.attach-file")
    expect(link).to_have_count(1)
    expect(link).to_contain_text("notes.md")
    assert link.get_attribute("download") == "notes.md"
    with page.expect_download() as download:
        link.click()
    saved = tmp_path / "downloaded.md"
    download.value.save_as(saved)
    assert saved.read_text(encoding="utf-8") == "# Plan\n\n- ship it\n"
    expect(tab.answers().last).to_have_text("Noted.")


def test_pasting_an_image_and_dropping_a_file_attach_them(tab: Tab, model: FakeModelServer) -> None:
    # covers: H3, E1
    page = tab.page
    png = base64.b64encode(png_bytes((30, 20), "yellow")).decode()
    # Paste an image into the message box, as a screenshot tool's copy gives it.
    page.evaluate(
        """png => {
        const bytes = Uint8Array.from(atob(png), c => c.charCodeAt(0));
        const data = new DataTransfer();
        data.items.add(new File([bytes], "image.png", { type: "image/png" }));
        const box = document.getElementById("composer-input");
        box.dispatchEvent(new ClipboardEvent("paste", { clipboardData: data, bubbles: true }));
        }""",
        png,
    )
    # Drop a text file onto the chat.
    page.evaluate(
        """() => {
        const data = new DataTransfer();
        data.items.add(new File(["dropped text"], "dropped.txt", { type: "text/plain" }));
        const main = document.getElementById("main");
        main.dispatchEvent(new DragEvent("dragenter", { dataTransfer: data, bubbles: true }));
        main.dispatchEvent(new DragEvent("dragover", { dataTransfer: data, bubbles: true }));
        main.dispatchEvent(new DragEvent("drop", { dataTransfer: data, bubbles: true }));
        }"""
    )
    chips = page.locator("#attach-chips .attach-chip")
    expect(chips).to_have_count(2)
    expect(chips.nth(0).locator(".attach-name")).to_have_text("image.png")
    expect(chips.nth(1).locator(".attach-name")).to_have_text("dropped.txt")
    expect(chips.nth(1).locator(".attach-meta")).to_have_text("12 B")
    expect(page.locator("#app")).not_to_have_class(re.compile(r"\bis-dropping\b"))

    model.script(Reply(text="Both seen."))
    tab.send("two files")
    expect(page.locator("#messages .msg-user .attach-thumb img")).to_have_count(1)
    expect(page.locator("#messages .msg-user a.attach-file")).to_contain_text("dropped.txt")
    expect(tab.answers().last).to_have_text("Both seen.")
    parts = [m for m in model.turn_requests()[-1].messages if m["role"] == "user"][-1]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "text"]
    assert parts[2]["text"] == "File: dropped.txt\n\ndropped text"


def test_the_chat_says_when_the_model_cannot_see_images(
    tab: Tab, model: FakeModelServer, tmp_path: Path
) -> None:
    # covers: H3, E5
    image = tmp_path / "chart.png"
    image.write_bytes(png_bytes())
    _pick(tab, image)
    expect(tab.page.locator("#attach-chips .attach-meta")).to_have_text(f"{image.stat().st_size} B")
    model.script(
        Reply(
            status=400,
            error={"error": {"message": "This model does not support image input."}},
        )
    )
    tab.send("read the chart")
    note = tab.page.locator("#messages .turn-note")
    expect(note).to_contain_text("The model cannot see images")
