"""The web chat in a real headless Chromium against a real `serve` process (E1, D1-D3).

One server (embedded mode, its own SQLite file) and one fake model server per module; each
test gets a fresh browser context, signs in through the login form and scripts the model's
replies itself. Screenshots of the page land in `artifacts/` (git-ignored) for a human look.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.fakemodel import FakeModelServer, Reply, echo_reply
from tests.procs import ROOT, embedded_env, manage
from tests.procs import ServeProcess as Served

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
PASSWORD = "browser-test-password"
ARTIFACTS = ROOT / "artifacts"
WAIT_MS = 15_000

expect.set_options(timeout=WAIT_MS)


def _require_chromium() -> None:
    if not Path(CHROMIUM).exists():
        reason = f"Chromium not found at {CHROMIUM} (apt-get install chromium)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason + "; CI must run the browser tests")
        pytest.skip(reason)


# --- Servers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> Iterator[FakeModelServer]:
    server = FakeModelServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model: FakeModelServer) -> Iterator[Served]:
    _require_chromium()
    var_dir = tmp_path_factory.mktemp("browser-var")
    env = embedded_env(
        var_dir,
        LLM_BASE_URL=model.url,
        DEMO_PASSWORD=PASSWORD,
        # Every test signs in as the demo user: no per-minute cap across the module, and no
        # title jobs taking a reply scripted for a turn.
        CHAT_RATE_LIMIT_PER_MINUTE="100000",
        CHAT_AUTO_TITLE_AFTER="100000",
    )
    for args in (("migrate", "--noinput"), ("ensure_demo_user",)):
        done = manage(*args, env=env)
        assert done.returncode == 0, f"{args[0]} failed:\n{done.stdout}\n{done.stderr}"
    server = Served(var_dir, env)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(served: Served) -> Iterator[Any]:
    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            yield chromium
        finally:
            chromium.close()


class Tab:
    """One signed-in page of the chat, with the helpers the tests share."""

    def __init__(self, page: Any, base: str) -> None:
        self.page = page
        self.base = base
        self.sent: list[dict[str, Any]] = []
        self.received: list[dict[str, Any]] = []
        self.errors: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        page.on("websocket", self._watch)

    def _watch(self, ws: Any) -> None:
        import json

        def parse(payload: Any) -> dict[str, Any]:
            try:
                return dict(json.loads(payload))
            except (TypeError, ValueError):
                return {}

        ws.on("framesent", lambda payload: self.sent.append(parse(payload)))
        ws.on("framereceived", lambda payload: self.received.append(parse(payload)))

    # --- navigation -----------------------------------------------------------------------
    def login(self) -> Tab:
        page = self.page
        page.goto(self.base + "/")
        page.wait_for_url(re.compile(r"/accounts/login/"))
        page.get_by_label("Username").fill("demo")
        page.get_by_label("Password").fill(PASSWORD)
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url(re.compile(r"^" + re.escape(self.base) + r"/(#.*)?$"))
        self.wait_online()
        return self

    def open(self) -> Tab:
        """A second tab of an already signed-in context."""
        self.page.goto(self.base + "/")
        self.wait_online()
        return self

    def wait_online(self) -> None:
        expect(self.page.locator("#app")).to_have_attribute("data-conn", "online")
        expect(self.page.locator(".dialog-item.is-current")).to_have_count(1)

    def current_dialog(self) -> str:
        return str(self.page.locator(".dialog-item.is-current").get_attribute("data-dialog-id"))

    def new_dialog(self) -> str:
        before = self.current_dialog()
        self.page.locator("#new-dialog").click()
        self.page.wait_for_function(
            "prev => { const el = document.querySelector('.dialog-item.is-current');"
            " return el && el.dataset.dialogId !== prev; }",
            arg=before,
        )
        expect(self.page.locator("#messages .msg-system")).to_have_count(1)  # the welcome
        return self.current_dialog()

    def send(self, text: str) -> None:
        box = self.page.locator("#composer-input")
        box.fill(text)
        box.press("Enter")

    # --- reading ----------------------------------------------------------------------------
    def streaming(self) -> Any:
        return self.page.locator("#live .msg-streaming .md")

    def answers(self) -> Any:
        return self.page.locator("#messages .msg-assistant .md")

    def wait_stream_contains(self, text: str) -> str:
        expect(self.streaming()).to_contain_text(text)
        return str(self.streaming().inner_text())

    def frames_sent(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.sent if f.get("type") == kind]

    def frames_received(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.received if f.get("type") == kind]


@pytest.fixture
def context(browser: Any, served: Served) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1280, "height": 820}, base_url=served.base)
    try:
        yield ctx
    finally:
        ctx.close()


@pytest.fixture
def tab(context: Any, served: Served, model: FakeModelServer) -> Iterator[Tab]:
    with model._lock:
        model.replies.clear()
    model.default = echo_reply
    t = Tab(context.new_page(), served.base)
    t.login()
    t.new_dialog()
    yield t
    assert not t.errors, f"JavaScript errors on the page: {t.errors}"


def _screenshot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), animations="disabled")


LONG = (
    "Streaming is a **latest-wins** snapshot: the client keeps the text it has and the "
    "server sends only the new tail. "
) * 4


# --- Tests --------------------------------------------------------------------------------


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


def test_slash_commands_typed_in_the_composer(tab: Tab) -> None:
    # covers: E1, B3
    page = tab.page

    tab.send("/info")

    line = page.locator("#messages .msg-command .command-note").last
    expect(line).to_contain_text(tab.current_dialog())
    expect(page.locator("#messages .msg-user")).to_have_count(0)  # not a model turn

    tab.send("/switch no-such-dialog")

    toast = page.locator("#toasts .toast-error")
    expect(toast).to_contain_text("no-such-dialog")
    toast.locator(".toast-close").click()
    expect(toast).to_have_count(0)

    tab.send("/rename Typed title")
    expect(page.locator("#chat-title")).to_have_text("Typed title")
    expect(page.locator(".dialog-item.is-current .dialog-title")).to_have_text("Typed title")


def test_enter_sends_and_shift_enter_adds_a_line(tab: Tab) -> None:
    # covers: E1
    box = tab.page.locator("#composer-input")
    box.click()
    box.type("line one")
    box.press("Shift+Enter")
    box.type("line two")

    assert box.input_value() == "line one\nline two"
    expect(tab.page.locator("#messages .msg-user")).to_have_count(0)

    box.press("Enter")

    expect(tab.page.locator("#messages .msg-user .bubble").last).to_have_text("line one\nline two")
    assert box.input_value() == ""
    expect(tab.answers().last).to_contain_text("echo: line one")


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


def test_reload_mid_answer_resumes_the_stream(tab: Tab, model: FakeModelServer) -> None:
    # covers: E1, D3
    model.script(Reply(text=LONG * 3, chunk=3, delay=0.04))  # about 9 s of streaming
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


HISTORY_JS_CHECKS = """
() => {
  const H = window.ChatHistory;
  const out = {};
  const h = new H();
  h.load({session_id: "web:u1:d", dialog_id: "d", title: "T", history_revision: 2,
          has_more: true, active_turn: null,
          messages: [{id: "m1", seq: 1, role: "system"}, {id: "m2", seq: 2, role: "user"}]});
  out.loaded = [h.revision, h.list().map(m => m.id), h.hasMore];
  out.contiguous = h.applyDelta({base_revision: 2, history_revision: 3,
                                 messages: [{id: "m3", seq: 3, role: "assistant"}]});
  out.afterContiguous = [h.revision, h.list().map(m => m.id)];
  out.duplicate = h.applyDelta({base_revision: 2, history_revision: 3,
                                messages: [{id: "m3", seq: 3}]});
  out.gap = h.applyDelta({base_revision: 5, history_revision: 6, messages: [{id: "m6", seq: 6}]});
  out.afterGap = [h.revision, h.list().length];
  out.overlap = h.applyDelta({base_revision: 2, history_revision: 4,
                              messages: [{id: "m3", seq: 3}, {id: "m4", seq: 4}]});
  out.afterOverlap = [h.revision, h.list().map(m => m.id)];
  out.older = h.loadOlder({has_more: false, messages: [{id: "m0", seq: 0}]}).map(m => m.id);
  out.afterOlder = [h.list().map(m => m.id), h.revision, h.hasMore];
  // Snapshots: known[:offset] + text, offsets in code points.
  const s = [];
  s.push(h.applySnapshot({turn_id: "t", text_offset: 0, text: "Hi \\u{1F600}", frame: 1,
                          tools: []}));
  s.push(h.applySnapshot({turn_id: "t", text_offset: 4, text: " there", frame: 2,
                          tools: [{call_id: "c", name: "current_time", status: "running"}]}));
  s.push(h.applySnapshot({turn_id: "t", text_offset: 3, text: "\\u{1F642} there!", frame: 3}));
  s.push(h.applySnapshot({turn_id: "t", text_offset: 99, text: "x", frame: 4}));
  s.push(h.applySnapshot({turn_id: "t", text_offset: 0, text: "old", frame: 1}));
  out.snapshots = s.map(r => [r.status, r.text === undefined ? null : r.text,
                              r.tools ? r.tools.length : null]);
  out.turnText = h.turnText("t");
  h.endTurn("t");
  out.afterEnd = h.turnText("t");
  // A session_history with an active turn seeds the stream (offset 0), then tails apply.
  const r = new H();
  r.load({session_id: "s", history_revision: 1, messages: [], has_more: false,
          active_turn: {turn_id: "u", text_offset: 0, text: "abc", frame: 7, tools: []}});
  out.seeded = r.turnText("u");
  out.tail = r.applySnapshot({turn_id: "u", text_offset: 3, text: "def", frame: 8}).text;
  out.cp = [H.codePointLength("a\\u{1F600}b"), H.codePointSlice("a\\u{1F600}b", 2)];
  return out;
}
"""


def test_history_module_logic(tab: Tab) -> None:
    # covers: D2, D1 (the client's rules, in the browser)
    out = tab.page.evaluate(HISTORY_JS_CHECKS)

    assert out["loaded"] == [2, ["m1", "m2"], True]
    assert out["contiguous"] == "applied"
    assert out["afterContiguous"] == [3, ["m1", "m2", "m3"]]
    assert out["duplicate"] == "duplicate"
    assert out["gap"] == "gap"
    assert out["afterGap"] == [3, 3]  # a gap changes nothing
    assert out["overlap"] == "applied"  # known ids are skipped, the new one lands
    assert out["afterOverlap"] == [4, ["m1", "m2", "m3", "m4"]]
    assert out["older"] == ["m0"]
    assert out["afterOlder"] == [["m0", "m1", "m2", "m3", "m4"], 4, False]
    assert out["snapshots"] == [
        ["applied", "Hi \U0001f600", 0],
        ["applied", "Hi \U0001f600 there", 1],
        ["applied", "Hi \U0001f642 there!", 1],
        ["gap", None, None],
        ["stale", None, None],
    ]
    assert out["turnText"] == "Hi \U0001f642 there!"
    assert out["afterEnd"] == ""
    assert out["seeded"] == "abc"
    assert out["tail"] == "abcdef"
    assert out["cp"] == [3, "a\U0001f600"]


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
