"""The web chat's pure modules, run in the page itself (E1, D1, D2): history.js's revision and
snapshot rules, and the pure helpers and state store of the ES modules, imported by the
browser exactly as the page imports them."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

from __future__ import annotations

import pytest

from tests.browser import (  # noqa: F401 - the shared fixtures
    Tab,
    browser,
    context,
    model,
    served,
    tab,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


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


# The page's own modules, imported by the browser from the server as the page imports them.
FORMAT_JS_CHECKS = """
async () => {
  const f = await import("/static/chat/format.js");
  const out = {};
  const strings = {hello: "Hello, %(name)s!", plain: "Plain"};
  out.translate = [f.translate(strings, "hello", {name: "Ada"}),
                   f.translate(strings, "hello", {}), f.translate(strings, "plain"),
                   f.translate(strings, "missing_key"), f.translate(strings, "toString")];
  out.escape = f.escapeHtml(`<a href="x">&'</a>`);
  out.close = [f.closeOpenMarkdown("Some **bold"), f.closeOpenMarkdown("Some **bold*"),
               f.closeOpenMarkdown("a `code"), f.closeOpenMarkdown("~~gone"),
               f.closeOpenMarkdown("```py\\nx = 1"), f.closeOpenMarkdown("Done **well**."),
               f.closeOpenMarkdown("**old**\\n\\nnew `x` and *y*")];
  out.hash = ["#d1a2b3c4", "#web%3Au%3Ad1", "#telegram:42:d9", "%", "#%E0%A4%A", "#a/b",
              "#" + "x".repeat(65), "#a:b", ""].map(f.dialogFromHash);
  out.linked = [null, "", "web:1:d", "telegram:42:d", "feishu:oc_1:d"].map(f.isLinked);
  out.platform = ["telegram", "feishu", "matrix"].map(f.platformName);
  out.title = f.cleanTitle("  A  title\\n with\\tgaps  ");
  const now = new Date(2026, 5, 15, 12, 0, 0).getTime();
  const hour = 3600000;
  const at = (days, hours) => new Date(now - days * 24 * hour - (hours || 0) * hour).toISOString();
  out.groups = [at(0), at(0, 11.9), at(1), at(3), at(6), at(8), "not a date"]
    .map(iso => f.dayGroup(iso, now));
  out.relative = [f.relativeTime(new Date(now - 10000).toISOString(), "en", "just now", now),
                  f.relativeTime(new Date(now - 5 * 60000).toISOString(), "en", "just now", now),
                  f.relativeTime(new Date(now - 3 * 3600000).toISOString(), "en", "just now", now),
                  f.relativeTime("garbage", "en", "just now", now)];
  out.backoff = [f.backoffDelay(0, 0), f.backoffDelay(0, 0.5), f.backoffDelay(0, 0.999999),
                 f.backoffDelay(1, 0.5), f.backoffDelay(4, 0.5), f.backoffDelay(5, 0.999999),
                 f.backoffDelay(40, 0)];
  return out;
}
"""


def test_format_module_logic(tab: Tab) -> None:
    # covers: E1, F5 (translated strings), F8 (crafted links)
    out = tab.page.evaluate(FORMAT_JS_CHECKS)

    assert out["translate"] == ["Hello, Ada!", "Hello, !", "Plain", "missing_key", "toString"]
    assert out["escape"] == "&lt;a href=&quot;x&quot;&gt;&amp;&#39;&lt;/a&gt;"
    # Half-written markup is closed while an answer streams; whole markup is left alone.
    assert out["close"] == [
        "Some **bold**",
        "Some **bold**",
        "a `code`",
        "~~gone~~",
        "```py\nx = 1\n```",
        "Done **well**.",
        "**old**\n\nnew `x` and *y*",
    ]
    assert out["hash"] == [
        "d1a2b3c4",
        "web:u:d1",
        "telegram:42:d9",
        None,
        None,
        None,
        None,
        None,
        None,
    ]
    assert out["linked"] == [False, False, False, True, True]
    assert out["platform"] == ["Telegram", "Feishu / Lark", "matrix"]
    assert out["title"] == "A title with gaps"
    assert out["groups"] == [
        "today",
        "today",
        "yesterday",
        "previous_7_days",
        "previous_7_days",
        "older",
        "today",
    ]
    assert out["relative"] == ["just now", "5 min. ago", "3 hr. ago", ""]
    # 1 s, 2 s, 4 s … doubled per attempt, ±25 % jitter, never past 30 s.
    assert out["backoff"] == [750, 1000, 1250, 2000, 16000, 30000, 22500]


STATE_JS_CHECKS = """
async () => {
  const {createStore} = await import("/static/chat/state.js");
  const out = {};
  const h = new window.ChatHistory();
  const s = createStore(h);

  // The dialog list: found by session id; by dialog id only among the web chat's own.
  s.setSessions([
    {session_id: "web:1:a", dialog_id: "a", title: "A", last_active_at: "2026-01-01T10:00:00Z"},
    {session_id: "telegram:9:a", dialog_id: "a", title: "TG", read_only: true,
     last_active_at: "2026-01-01T09:00:00Z"},
    {session_id: "web:1:b", dialog_id: "b", title: "B", last_active_at: "2026-01-01T08:00:00Z"},
  ]);
  out.findDialog = s.findDialog("a").session_id;
  out.findSession = s.findSession("telegram:9:a").title;
  out.missing = [s.findSession("web:1:zz"), s.findDialog("zz")];
  s.touchSession("web:1:b", [{created_at: "2026-01-01T11:00:00Z"}, {}]);
  out.touched = s.sessions().map(i => i.dialog_id + "@" + i.last_active_at.slice(11, 16));
  s.setTitle("web:1:b", "Renamed");
  out.renamed = s.findSession("web:1:b").title;

  // Read-only and unread follow the open dialog.
  h.load({session_id: "telegram:9:a", dialog_id: "a", history_revision: 1, messages: []});
  out.readOnly = s.isReadOnly();
  s.markUnread("telegram:9:a");
  s.markUnread("web:1:b");
  out.unread = [s.isUnread("telegram:9:a"), s.isUnread("web:1:b"), s.anyUnread()];
  s.markRead("web:1:b");
  out.afterRead = [s.isUnread("web:1:b"), s.anyUnread()];

  // Turns: running while one is in flight or an answer streams; Stop ends with the last.
  out.idle = s.isRunning();
  s.turnStarted("t1");
  s.turnStarted("t2");
  s.setStopping(true);
  s.turnEnded("t1");
  out.oneLeft = [s.isRunning(), s.isStopping()];
  s.turnEnded("t2");
  out.allDone = [s.isRunning(), s.isStopping(), s.anyTurn()];
  s.setStreaming({turnId: "t3"});
  out.streaming = s.isRunning();
  s.setStreaming(null);
  s.markContinuing("t4");
  s.turnStarted("t4");
  out.continuing = s.isContinuing("t4");
  s.turnEnded("t4");
  out.continuingEnded = s.isContinuing("t4");

  // A silent command's answer is recognised once.
  s.markSilent("c1", "/switch");
  out.silent = [s.takeSilent("c1"), s.takeSilent("c1"), s.takeSilent(null)];

  // A gap asks for history once per 10 s, and again as soon as a history arrived.
  out.ask = [s.mayAskHistory(1000)];
  s.historyAsked(1000);
  out.ask.push(s.mayAskHistory(5000), s.mayAskHistory(11000));
  s.historyArrived();
  out.ask.push(s.mayAskHistory(5000));

  // Where to go back to: a linked session wins over a dialog id; taken once.
  s.wantBack("b", null);
  out.wantDialog = s.wantedDialog();
  s.wantBack(null, "telegram:9:a");
  out.wanted = [s.takeWanted(), s.takeWanted()];

  // Pending messages after a full history load (web dialog "b").
  const p = createStore(h);
  h.load({session_id: "web:1:b", dialog_id: "b", history_revision: 5, messages: [
    {id: "m1", seq: 1, role: "user", content: "ran", source: {client_msg_id: "ran"}},
    {id: "m2", seq: 2, role: "user", content: "by turn", turn_id: "tdone"},
  ]});
  p.addPending({id: "ran", sessionId: "web:1:b", content: "ran", turnId: "t0"});
  p.addPending({id: "byturn", sessionId: "web:1:b", content: "by turn", turnId: "tdone"});
  p.addPending({id: "queued", sessionId: "web:1:b", content: "queued", turnId: "tq"});
  p.addPending({id: "vanished", sessionId: "web:1:b", content: "gone", turnId: "tgone"});
  p.addPending({id: "unsent", sessionId: "web:1:b", content: "unsent", turnId: null});
  p.addPending({id: "elsewhere", sessionId: "web:1:a", content: "other", turnId: "tx"});
  p.addPending({id: "elsewhere-unacked", sessionId: "web:1:a", content: "other", turnId: null});
  p.reconcilePending({session_id: "web:1:b", active_turn: {turn_id: "trun"}, queue: [
    {turn_id: "tq", client_msg_id: "queued", mode: "normal"},
    {turn_id: "tnew", client_msg_id: "from-another-tab", mode: "normal", preview: "hi"},
    {turn_id: "tretry", mode: "retry"},
  ]});
  out.reconciled = p.pending().map(e => [e.id, e.content, e.turnId || null, e.position ?? null]);
  out.reconciledRunning = [p.anyTurn(), p.isRunning()];
  const queued = p.findPendingByTurn("tq");
  out.byTurn = queued.id;
  p.pendingQueued(p.findPending("unsent"), {turn_id: "tu", position: 2, session_id: "web:1:b"});
  p.pendingFailed(p.findPending("from-another-tab"), "too fast");
  const failed = p.findPending("from-another-tab");
  out.updated = [p.findPending("unsent").turnId, p.findPending("unsent").position, failed.error];
  p.removePending(queued);
  p.addPending({id: "late", sessionId: "web:1:b", content: "late", turnId: null});
  p.markUnconfirmed();
  out.afterLoss = p.pending().map(e => [e.id, Boolean(e.unconfirmed)]);
  return out;
}
"""


def test_state_store_logic(tab: Tab) -> None:
    # covers: E1, D2, D3 (the client's state, changed through the store's API)
    out = tab.page.evaluate(STATE_JS_CHECKS)

    assert out["findDialog"] == "web:1:a"
    assert out["findSession"] == "TG"
    assert out["missing"] == [None, None]
    assert out["touched"] == ["b@11:00", "a@10:00", "a@09:00"]
    assert out["renamed"] == "Renamed"
    assert out["readOnly"] is True
    assert out["unread"] == [False, True, True]  # the open dialog is never unread
    assert out["afterRead"] == [False, False]
    assert out["idle"] is False
    assert out["oneLeft"] == [True, True]
    assert out["allDone"] == [False, False, False]
    assert out["streaming"] is True
    assert out["continuing"] is True
    assert out["continuingEnded"] is False
    assert out["silent"] == [True, False, False]
    assert out["ask"] == [True, False, True, True]
    assert out["wantDialog"] == "b"
    assert out["wanted"] == [
        {"dialog": "b", "session": "telegram:9:a"},
        {"dialog": None, "session": None},
    ]
    # Ran already (by message id or turn) or no longer queued: gone. Still queued: kept
    # with its place behind the running turn. Queued from elsewhere: shown from its
    # preview. Not yet acknowledged: kept. Another dialog's: kept only while unsettled.
    assert out["reconciled"] == [
        ["queued", "queued", "tq", 1],
        ["unsent", "unsent", None, None],
        ["elsewhere-unacked", "other", None, None],
        ["from-another-tab", "hi", "tnew", 2],
    ]
    assert out["reconciledRunning"] == [True, True]
    assert out["byTurn"] == "queued"
    assert out["updated"] == ["tu", 2, "too fast"]
    assert out["afterLoss"] == [
        ["unsent", False],
        ["elsewhere-unacked", True],
        ["from-another-tab", False],
        ["late", True],
    ]
