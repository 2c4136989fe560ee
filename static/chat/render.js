/*
 * The transcript (E1, E5): committed messages (user text as plain text, answers as
 * sanitised markdown, tool chips and results), notes for stopped / failed / cut answers
 * with Retry and Continue, older pages on scroll, and the scroll position. The running
 * turn's answer is stream.js's.
 */
import { regenerateAction, userFoot, versionSwitcher } from "./branches.js";
import { attachmentsView } from "./attachments.js";
import { fullTime } from "./format.js";
import { copyText, renderMarkdownInto } from "./markdown.js";
import { history, store } from "./state.js";
import { aim, isOpen, send } from "./transport.js";
import { $, config, el, icon, LANG, randomId, t, toast } from "./ui.js";

var OLDER_PAGE = 50;
var NEAR_BOTTOM_PX = 80;
var NEAR_TOP_PX = 160;

// --- Scrolling ------------------------------------------------------------------------------

export function isNearBottom() {
  var s = $("transcript");
  return s.scrollHeight - s.scrollTop - s.clientHeight < NEAR_BOTTOM_PX;
}

export function scrollToBottom() {
  var s = $("transcript");
  s.scrollTop = s.scrollHeight;
  $("jump-latest").hidden = true;
}

/** Near the top with more history on the server: ask for the page before the oldest. */
export function maybeLoadOlder() {
  var s = $("transcript");
  if (!history.hasMore || store.older() || !isOpen()) {
    return;
  }
  if (s.scrollTop > NEAR_TOP_PX && s.scrollHeight > s.clientHeight) {
    return;
  }
  var beforeSeq = history.oldestSeq();
  if (beforeSeq == null) {
    return;
  }
  var id = randomId();
  var frame = aim({ type: "history", before_seq: beforeSeq, limit: OLDER_PAGE, client_msg_id: id });
  if (send(frame)) {
    store.setOlder({ id: id, beforeSeq: beforeSeq });
    renderOlderIndicator();
  }
}

export function onScroll() {
  $("jump-latest").hidden = isNearBottom();
  maybeLoadOlder();
}

// --- Transcript -----------------------------------------------------------------------------

/** Redraw the whole transcript from the history (the queued chips are the composer's). */
export function renderTranscript() {
  var container = $("messages");
  var frag = document.createDocumentFragment();
  store.resetAnswers();
  history.list().forEach(function (m) {
    var node = renderMessage(m);
    if (node) {
      frag.appendChild(node);
    }
  });
  container.replaceChildren(frag);
  clearTurnNote();
  var last = history.newest();
  if (last && last.role === "assistant" && !store.anyTurn()) {
    if (last.status === "cancelled") {
      showTurnNote("cancelled", t("answer_stopped"));
    } else if (last.status === "interrupted") {
      showTurnNote("failed", t("answer_interrupted"));
    }
  }
}

/** Append messages a delta added. */
export function appendMessages(added) {
  var container = $("messages");
  added.forEach(function (m) {
    var node = renderMessage(m);
    if (node) {
      container.appendChild(node);
    }
  });
}

/** An older page arrived: put it above what is shown, keeping the reader's place. */
export function prependOlder(frame) {
  var scroller = $("transcript");
  var before = scroller.scrollHeight;
  var top = scroller.scrollTop;
  var added = history.loadOlder(frame);
  var container = $("messages");
  var frag = document.createDocumentFragment();
  added.forEach(function (m) {
    var node = renderMessage(m);
    if (node) {
      frag.appendChild(node);
    }
  });
  // Older pages always precede what is shown (their seqs are lower).
  container.insertBefore(frag, container.firstChild);
  scroller.scrollTop = top + (scroller.scrollHeight - before);
  renderOlderIndicator();
  updateEmpty();
  maybeLoadOlder();
}

export function renderOlderIndicator() {
  var older = $("older");
  older.hidden = !store.older();
  older.textContent = store.older() ? t("loading_older") : "";
}

export function updateEmpty() {
  var conversational = history.list().some(function (m) {
    return m.role === "user" || m.role === "assistant";
  });
  var empty = !conversational && !store.streaming() && !store.pending().length && !history.hasMore;
  $("empty").hidden = !empty || !store.loadedOnce();
  $("empty-title").textContent = t("empty_title", { name: config.user.display_name });
  $("empty-body").textContent = t("empty_body");
  $("app").classList.toggle("is-empty", empty);
}

function renderMessage(m) {
  var source = m.source || {};
  var node;
  if (m.role === "user") {
    node = el("div", "msg msg-user");
    if (m.attachments && m.attachments.length) {
      node.appendChild(attachmentsView(m.attachments)); // H3
    }
    if (m.content || !(m.attachments && m.attachments.length)) {
      node.appendChild(el("div", "bubble", m.content || ""));
    }
    if (source.kind === "steer" || source.kind === "inject") {
      node.appendChild(el("span", "msg-tag", t(source.kind === "steer" ? "steer" : "context")));
    }
    // Copy your own words (issue 54), their versions and Edit (H1).
    node.appendChild(userFoot(m, node, m.content ? messageActions(m) : null));
  } else if (m.role === "assistant") {
    if (joinContinuation(m)) {
      return null;
    }
    node = renderAnswer(m);
  } else if (m.role === "tool") {
    node = el("div", "msg msg-tool");
    var details = el("details", "tool-result");
    var summary = el("summary");
    summary.appendChild(icon("tool"));
    summary.appendChild(el("span", null, t("tool_result", { name: m.tool_name || "tool" })));
    details.appendChild(summary);
    var content = m.content || "";
    details.appendChild(el("pre", null, content.length > 4000 ? content.slice(0, 4000) + "…" : content));
    node.appendChild(details);
  } else if (m.role === "system") {
    node = el("div", "msg msg-system");
    node.appendChild(el("div", "system-note", m.content || ""));
  } else {
    return null;
  }
  node.dataset.id = m.id;
  node.dataset.seq = m.seq;
  if (m.turn_id) {
    node.dataset.turn = m.turn_id;
  }
  if (m.created_at) {
    node.title = fullTime(m.created_at, LANG);
  }
  return node;
}

function renderAnswer(m) {
  var node = el("div", "msg msg-assistant");
  var hasText = Boolean(m.content && m.content.trim());
  var calls = Array.isArray(m.tool_calls) && m.tool_calls.length;
  if (calls) {
    node.appendChild(toolChips(m.tool_calls.map(function (call) {
      var fn = call.function || {};
      return { name: fn.name || call.name || "tool", status: "ok" };
    })));
  }
  if (hasText) {
    var body = el("div", "md");
    renderMarkdownInto(body, m.content, false);
    node.appendChild(body);
  } else if (m.status === "cancelled") {
    node.appendChild(el("p", "md muted", t("stopped_before_text")));
  }
  var foot = el("div", "msg-foot");
  var versions = versionSwitcher(m);
  if (versions) {
    foot.appendChild(versions);
  }
  if (m.status === "cancelled" || m.status === "interrupted") {
    node.classList.add("msg-partial");
    foot.appendChild(
      el("span", "msg-status", t(m.status === "cancelled" ? "status_stopped" : "status_interrupted"))
    );
  }
  if (m.status === "truncated" || m.status === "filtered") {
    markCut(node, foot, m);
  }
  if (hasText) {
    var actions = messageActions(m);
    actions.appendChild(regenerateAction(m)); // H1
    foot.appendChild(actions);
  }
  if (hasText && !calls) {
    store.setAnswer(m.id, { node: node, text: m.content });
  }
  if (foot.firstChild) {
    node.appendChild(foot);
  }
  return node;
}

// --- Cut answers and Continue (E5) ----------------------------------------------------------

/** A continuation (source.continues) is shown as part of the answer it goes on with: the
 * shown node is rebuilt from the joined text, with the newest part's status. */
function joinContinuation(m) {
  var target = (m.source || {}).continues;
  var entry = target && store.answer(target);
  if (!entry || !entry.node.parentNode) {
    return false;
  }
  var joined = Object.assign({}, m, {
    content: entry.text + (m.content || ""),
    source: Object.assign({}, m.source, { continues: null }),
  });
  var node = renderMessage(joined);
  node.classList.add("msg-continued");
  entry.node.replaceWith(node);
  store.setAnswer(target, store.answer(m.id));
  return true;
}

function markCut(node, foot, m) {
  var truncated = m.status === "truncated";
  node.classList.add("msg-cut");
  node.dataset.status = m.status;
  var marker = el("span", "msg-status msg-cut-marker");
  marker.appendChild(icon(truncated ? "more" : "alert"));
  marker.appendChild(el("span", null, t(truncated ? "status_truncated" : "status_filtered")));
  foot.appendChild(marker);
  if (truncated) {
    var button = el("button", "btn btn-small continue-btn");
    button.type = "button";
    button.appendChild(icon("next"));
    button.appendChild(el("span", null, t("continue")));
    button.addEventListener("click", function () {
      continueAnswer(button);
    });
    button.dataset.id = m.id;
    foot.appendChild(button);
  }
}

function continueAnswer(button) {
  if (send(aim({ type: "continue", client_msg_id: randomId() }))) {
    button.hidden = true;
    clearTurnNote();
  } else {
    toast(t("offline_cannot_send"), "error");
  }
}

/** Continue is offered on the newest answer only, while nothing runs. */
export function refreshContinue() {
  var last = history.newest();
  var running = store.isRunning();
  document.querySelectorAll("#messages .continue-btn").forEach(function (button) {
    button.hidden = running || !last || last.status !== "truncated" || button.dataset.id !== last.id;
  });
}

/** The cut answer a continuation streams under stops looking "continuing". */
export function endContinuing() {
  document.querySelectorAll("#messages .is-continuing").forEach(function (node) {
    node.classList.remove("is-continuing");
  });
}

function messageActions(m) {
  var bar = el("div", "msg-actions");
  var copy = el("button", "msg-action");
  copy.type = "button";
  copy.setAttribute("aria-label", t("copy"));
  copy.appendChild(icon("copy"));
  copy.appendChild(el("span", null, t("copy")));
  copy.addEventListener("click", function () {
    copyText(m.content || "", copy);
  });
  bar.appendChild(copy);
  return bar;
}

export function toolChips(tools) {
  var row = el("div", "tool-chips");
  tools.forEach(function (tool) {
    var status = tool.status || "running";
    var chip = el("span", "chip tool-chip tool-" + status);
    chip.dataset.status = status;
    if (status === "running") {
      chip.appendChild(el("span", "spinner"));
    } else {
      chip.appendChild(icon(status === "ok" ? "check" : "cross"));
    }
    chip.appendChild(el("span", "tool-name", tool.name || "tool"));
    var label = status === "ok" ? t("tool_ok") : status === "error" ? t("tool_error") : t("tool_running");
    chip.appendChild(el("span", "tool-state", label));
    row.appendChild(chip);
  });
  return row;
}

/** A line in the transcript for a command's answer (/help, /compact, …). */
export function appendCommandLine(command, content) {
  var line = el("div", "msg msg-command");
  line.appendChild(el("div", "command-note", content || ""));
  line.dataset.command = command || "";
  appendSticky(line);
}

function appendSticky(node) {
  var stick = isNearBottom();
  $("messages").appendChild(node);
  if (stick) {
    scrollToBottom();
  }
}

// --- Turn notes (stopped / failed, with Retry) ----------------------------------------------

export function clearTurnNote() {
  document.querySelectorAll("#messages .turn-note").forEach(function (node) {
    node.remove();
  });
}

export function showTurnNote(kind, text, action) {
  clearTurnNote();
  var note = el("div", "turn-note turn-" + kind);
  note.setAttribute("role", "status");
  note.appendChild(icon(kind === "failed" || kind === "notice" ? "alert" : "stop"));
  note.appendChild(el("span", "turn-note-text", text));
  if (action === "none") {
    // A completed answer that is not whole: no Retry; Continue is on the answer itself.
    appendSticky(note);
    return;
  }
  var retry = el("button", "btn btn-small retry-btn");
  retry.type = "button";
  retry.appendChild(icon("retry"));
  retry.appendChild(el("span", null, t("retry")));
  retry.addEventListener("click", function () {
    var id = randomId();
    if (send(aim({ type: "retry", client_msg_id: id }))) {
      note.remove();
    } else {
      toast(t("offline_cannot_send"), "error");
    }
  });
  note.appendChild(retry);
  appendSticky(note);
}
