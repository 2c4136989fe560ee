"""The web chat resumes after a server restart instead of reloading (E1, D2; PROTOCOL "On
connect", issue 57), in a real Chromium against a real `serve` that is stopped and started
again mid-conversation: the page says what it holds, gets `sessions` `unchanged` and a
`history_delta` (empty, or holding what another tab said meanwhile), never a second
`session_history`, and keeps the messages it shows (the same DOM nodes) while it goes on."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

from __future__ import annotations

from typing import Any

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
from tests.procs import ServeProcess

pytestmark = [pytest.mark.browser, pytest.mark.slow]

MARK_SHOWN = (
    "() => document.querySelectorAll('#messages .msg').forEach(n => { n.dataset.kept = 'yes'; })"
)
KEPT = "() => [...document.querySelectorAll('#messages .msg')].map(n => n.dataset.kept || 'new')"


def resumes(tab: Tab) -> list[dict[str, Any]]:
    return [f for f in tab.frames_received("history_delta") if "active_turn" in f]


def restart(served: ServeProcess, tab: Tab) -> None:
    served.stop()
    expect(tab.page.locator("#app")).to_have_attribute("data-conn", "reconnecting")
    served.start()


def test_a_restart_resumes_without_reloading_the_history(tab: Tab, served: ServeProcess) -> None:
    # covers: E1, D2 (reconnect with resync, by a delta from what the page holds)
    page = tab.page
    tab.send("before the restart")
    expect(tab.answers().last).to_have_text("echo: before the restart")
    page.evaluate(MARK_SHOWN)
    histories = len(tab.frames_received("session_history"))

    restart(served, tab)
    expect(page.locator("#app")).to_have_attribute("data-conn", "online", timeout=40_000)
    resumed = resumes(tab)
    assert len(resumed) == 1 and resumed[0]["messages"] == []
    assert resumed[0]["base_revision"] == resumed[0]["history_revision"]
    said = tab.socket_urls[-1]
    assert "since=" in said and "last_id=" in said and "sessions_etag=" in said
    # The answer changed the list (its count and time) after the list the page was sent:
    # the list comes whole, with its etag; at the next restart it is unchanged.
    assert "items" in tab.frames_received("sessions")[-1]
    restart(served, tab)
    expect(page.locator("#app")).to_have_attribute("data-conn", "online", timeout=40_000)
    assert len(resumes(tab)) == 2
    assert tab.frames_received("sessions")[-1].get("unchanged") is True
    assert len(tab.frames_received("session_history")) == histories  # no reload
    assert set(page.evaluate(KEPT)) == {"yes"}  # the very same nodes

    tab.send("after the restart")
    expect(tab.answers().last).to_have_text("echo: after the restart")
    expect(page.locator("#messages .msg-user .bubble")).to_have_text(
        ["before the restart", "after the restart"]
    )
    assert len(tab.frames_received("session_history")) == histories


def test_what_another_tab_said_meanwhile_comes_as_the_resume(
    tab: Tab, served: ServeProcess, context: Any
) -> None:
    # covers: E1, D2, D3 (the delta holds what was stored while the page was away)
    page = tab.page
    tab.send("first")
    expect(tab.answers().last).to_have_text("echo: first")
    page.evaluate(MARK_SHOWN)
    histories = len(tab.frames_received("session_history"))
    # While held off, the page's sockets are turned away (as a server that is not back yet).
    held = {"off": True}

    def route(ws: Any) -> None:
        if held["off"]:
            ws.close(code=1012, reason="restarting")
        else:
            ws.connect_to_server()

    page.route_web_socket("**/ws/chat/**", route)
    restart(served, tab)
    other = Tab(context.new_page(), served.base).open()
    other.send("said elsewhere")
    expect(other.answers().last).to_have_text("echo: said elsewhere")
    other.page.close()
    held["off"] = False

    expect(page.locator("#app")).to_have_attribute("data-conn", "online", timeout=40_000)
    expect(tab.answers().last).to_have_text("echo: said elsewhere")
    resumed = resumes(tab)
    assert len(resumed) == 1
    assert [m["content"] for m in resumed[0]["messages"]] == [
        "said elsewhere",
        "echo: said elsewhere",
    ]
    assert len(tab.frames_received("session_history")) == histories
    assert page.evaluate(KEPT)[:3] == ["yes", "yes", "yes"]  # welcome, question, answer kept


def test_the_resume_rules_of_the_history_module(tab: Tab) -> None:
    # covers: D2 (history.js: a resume applies at the revision held, else it is a gap)
    out = tab.page.evaluate(
        """() => {
          const H = window.ChatHistory;
          const h = new H();
          h.load({session_id: "s", dialog_id: "d", history_revision: 2, messages: [
            {id: "m1", seq: 1}, {id: "m2", seq: 2}],
            active_turn: {turn_id: "t", text_offset: 0, text: "old", frame: 1, tools: []}});
          const none = {type: "history_delta", session_id: "s", base_revision: 2,
                        history_revision: 2, messages: [], active_turn: null, queue: []};
          const more = {type: "history_delta", session_id: "s", base_revision: 2,
                        history_revision: 4, title: "T", messages: [{id: "m3", seq: 3},
                        {id: "m4", seq: 4}], queue: [],
                        active_turn: {turn_id: "u", text_offset: 0, text: "now", tools: []}};
          const turnDelta = {type: "history_delta", session_id: "s", base_revision: 4,
                             history_revision: 5, messages: [{id: "m5", seq: 5}]};
          return {
            isResume: [H.isResume(none), H.isResume(turnDelta)],
            none: [h.resume(none), h.lastAdded().length, h.turnText("t"), h.revision],
            gap: h.resume({...more, base_revision: 1}),
            more: [h.resume(more), h.lastAdded().map(m => m.id), h.revision, h.title,
                   h.turnText("u")],
            other: h.resume({...none, session_id: "x", base_revision: 4}),
          };
        }"""
    )
    assert out["isResume"] == [True, False]
    assert out["none"] == ["applied", 0, "", 2]  # no turn runs any more: its text goes
    assert out["gap"] == "gap"
    assert out["more"] == ["applied", ["m3", "m4"], 4, "T", "now"]
    assert out["other"] == "gap"
