"""Answers in the web chat, in a real headless Chromium against a real `serve` process (E1,
D1-D3, E5): streaming, tool chips, Stop and Retry, failures, a reload mid-answer, and
model output rendered inert."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.browser import (  # noqa: F401 - the shared fixtures
    WAIT_MS,
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


LONG = (
    "Streaming is a **latest-wins** snapshot: the client keeps the text it has and the "
    "server sends only the new tail. "
) * 4


def test_answer_streams_in_as_it_is_written(tab: Tab, model: FakeModelServer) -> None:
    # covers: E1, D1, D2
    model.script(Reply(text=LONG, chunk=4, delay=0.04))

    tab.send("Explain streaming, please.")

    expect(tab.page.locator("#messages .msg-user .bubble").last).to_have_text(
        "Explain streaming, please."
    )
    partial = tab.wait_stream_contains("latest-wins")
    expect(tab.page.locator("#stop-button")).to_be_visible()
    expect(tab.page.locator("#live .msg-streaming .caret")).to_have_count(1)
    answer = tab.answers().last
    expect(answer).to_contain_text("only the new tail", timeout=30_000)
    expect(tab.page.locator("#live .msg-streaming")).to_have_count(0)
    final = answer.inner_text()
    # The partial text was visible before the whole answer, and is its beginning.
    assert 0 < len(partial.strip()) < len(final.strip())
    assert partial.startswith("Streaming is a ") and final.startswith("Streaming is a ")
    assert "**" not in partial  # half-written markup is closed while streaming
    assert answer.locator("strong").first.inner_text() == "latest-wins"
    expect(tab.page.locator("#stop-button")).to_be_hidden()
    expect(tab.page.locator("#pending .msg-pending")).to_have_count(0)
    # Every send carried a client_msg_id; a normal turn never reloads the history (D2).
    sends = tab.frames_sent("send")
    assert sends and all(f.get("client_msg_id") for f in sends)
    assert not [f for f in tab.frames_sent("history") if "before_seq" not in f]
    assert tab.frames_received("history_delta")
    assert tab.frames_received("turn_snapshot")


def test_tool_progress_shows_as_chips(tab: Tab, model: FakeModelServer) -> None:
    # covers: E1, C8
    model.script(
        Reply(tool_calls=[("current_time", {})]),
        Reply(text="It is about *now*. " * 10, chunk=3, delay=0.03),
    )

    tab.send("What time is it?")

    chip = tab.page.locator("#live .msg-streaming .tool-chip")
    expect(chip).to_contain_text("current_time")
    expect(chip).to_have_attribute("data-status", "ok")
    _screenshot(tab.page, "chat-tool-progress.png")
    answer = tab.page.locator("#messages .msg-assistant").last
    expect(answer.locator(".md")).to_contain_text("It is about now.", timeout=30_000)
    expect(tab.page.locator("#messages .tool-chip", has_text="current_time")).to_have_count(1)
    expect(tab.page.locator("#messages .msg-tool .tool-result")).to_have_count(1)


@pytest.mark.parametrize("how", ["button", "escape"])
def test_stop_keeps_the_partial_answer(tab: Tab, model: FakeModelServer, how: str) -> None:
    # covers: E1, C6
    model.script(Reply(text="A partial answer that never ends", chunk=4, endless=True))

    tab.send("Talk forever.")
    tab.wait_stream_contains("never ends")
    # A second send while the first runs is queued and says so.
    tab.send("And then this.")
    queued = tab.page.locator("#pending .msg-pending")
    expect(queued).to_have_count(1)
    expect(queued.locator(".chip-queued")).to_contain_text("Queued")

    if how == "button":
        tab.page.locator("#stop-button").click()
    else:
        tab.page.locator("#composer-input").press("Escape")

    note = tab.page.locator("#messages .turn-note.turn-cancelled")
    expect(note).to_be_visible()
    expect(note.locator(".retry-btn")).to_be_visible()
    expect(tab.page.locator("#live .msg-streaming")).to_have_count(0)
    partial = tab.page.locator("#messages .msg-assistant.msg-partial").last
    expect(partial).to_contain_text("A partial answer that never ends")
    expect(partial.locator(".msg-status")).to_have_text("stopped")
    if how == "button":
        _screenshot(tab.page, "chat-stopped.png")
    expect(tab.page.locator("#stop-button")).to_be_hidden()
    # Stop drops the unstarted send too (C6).
    expect(queued).to_have_count(0)
    assert tab.frames_sent("stop")
    assert model.requests[-1].aborted.wait(10)


def test_retry_after_a_stop_runs_the_turn_again(tab: Tab, model: FakeModelServer) -> None:
    # covers: E1, C6
    model.script(
        Reply(text="First try, cut short", chunk=4, endless=True),
        Reply(text="Second try, complete."),
    )
    tab.send("Try twice.")
    tab.wait_stream_contains("cut short")
    tab.page.locator("#stop-button").click()
    retry = tab.page.locator("#messages .turn-note .retry-btn")
    expect(retry).to_be_visible()

    retry.click()

    expect(tab.answers().last).to_have_text("Second try, complete.")
    expect(tab.page.locator("#messages .turn-note")).to_have_count(0)
    # The user message was not added again.
    expect(tab.page.locator("#messages .msg-user")).to_have_count(1)


def test_a_failed_answer_says_why_and_can_be_retried(tab: Tab, model: FakeModelServer) -> None:
    # covers: E1, C10, C6
    model.script(
        Reply(status=400, error={"error": {"message": "model says no (secret details)"}}),
        Reply(text="Worked the second time."),
    )

    tab.send("Please fail once.")

    note = tab.page.locator("#messages .turn-note.turn-failed")
    expect(note).to_be_visible()
    expect(note).to_contain_text("The answer failed")
    expect(tab.page.locator("#stop-button")).to_be_hidden()
    _screenshot(tab.page, "chat-failed-turn.png")
    note.locator(".retry-btn").click()
    expect(tab.answers().last).to_have_text("Worked the second time.")
    expect(note).to_have_count(0)
    retries = tab.frames_sent("retry")
    assert len(retries) == 1 and retries[0]["dialog_id"] == tab.current_dialog()


def test_reload_mid_answer_resumes_the_stream(tab: Tab, model: FakeModelServer) -> None:
    # covers: E1, D3
    reply = Reply(text=LONG * 3, chunk=3, delay=0.04)  # about 9 s of streaming
    model.script(reply)
    tab.send("A long answer, please.")
    tab.wait_stream_contains("latest-wins")

    tab.page.reload()
    tab.wait_online()

    # The running answer is back (active_turn), keeps growing, and completes.
    stream = tab.streaming()
    expect(stream).to_contain_text("latest-wins")
    first = len(stream.inner_text())
    tab.page.wait_for_function(
        "n => { const el = document.querySelector('#live .msg-streaming .md');"
        " return el && el.innerText.length > n; }",
        arg=first,
        timeout=WAIT_MS,
    )
    expect(tab.page.locator("#stop-button")).to_be_visible()
    reply.delay = 0.0  # resumed and growing: the rest of the answer need not trickle
    answer = tab.answers().last
    expect(answer).to_contain_text("only the new tail", timeout=45_000)
    expect(tab.page.locator("#live .msg-streaming")).to_have_count(0)
    expect(tab.page.locator("#messages .msg-user .bubble")).to_have_text(["A long answer, please."])


def test_model_output_is_rendered_inert(tab: Tab, model: FakeModelServer) -> None:
    # covers: E1 (sanitised markdown)
    dialogs: list[str] = []
    tab.page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    hostile = (
        "Look: <img src=x onerror=alert(1)> and [x](javascript:alert(1)) and "
        '<a href="javascript:alert(2)" onclick="alert(3)">y</a>\n\n'
        "<script>alert(4)</script>\n\n"
        "[safe](https://example.com/docs) **bold**\n\n"
        "![pixel](https://example.com/track.png)"
    )
    model.script(Reply(text=hostile, chunk=7, delay=0.01))

    tab.send("<b>not bold</b> <img src=y onerror=alert(5)>")

    user = tab.page.locator("#messages .msg-user .bubble").last
    expect(user).to_have_text("<b>not bold</b> <img src=y onerror=alert(5)>")
    answer = tab.page.locator("#messages .msg-assistant .md").last
    expect(answer.locator("strong")).to_have_text("bold")
    page = tab.page
    assert page.locator("img").count() == 0
    assert page.locator("[onerror], [onclick]").count() == 0
    assert page.locator("script:not([src]):not([type='application/json'])").count() == 0
    hrefs = answer.locator("a").evaluate_all("els => els.map(a => a.getAttribute('href'))")
    assert all(h is None or h.startswith("https:") for h in hrefs), hrefs
    link = answer.locator("a", has_text="x").first
    assert (link.get_attribute("href") or "") == ""
    safe = answer.locator("a", has_text="safe")
    expect(safe).to_have_attribute("href", "https://example.com/docs")
    expect(safe).to_have_attribute("target", "_blank")
    expect(safe).to_have_attribute("rel", "noopener noreferrer")
    # Raw HTML shows as the text it is; the image became a link, never a fetch.
    expect(answer).to_contain_text("<img src=x onerror=alert(1)>")
    expect(answer.locator("a", has_text="pixel")).to_have_attribute(
        "href", "https://example.com/track.png"
    )
    expect(answer).to_contain_text('<a href="javascript:alert(2)" onclick="alert(3)">y</a>')
    expect(answer).to_contain_text("<script>alert(4)</script>")
    # Clicking the defused link does nothing either.
    link.click()
    page.wait_for_timeout(300)
    assert dialogs == []
    assert page.url.startswith(tab.base)
