/*
 * Search in the sidebar (SPEC H2): Ctrl+K / ⌘K focuses the box; typing asks the server
 * (`search` -> `search_results`, PROTOCOL "Search, export, import") and the hits replace the
 * dialog list while the box holds a query; a hit opens its dialog scrolled to the message,
 * highlighted (older pages are fetched until it is loaded). Arrow keys move between hits,
 * Esc clears the search.
 */
import { maybeLoadOlder } from "./render.js";
import { closeSidebar } from "./sidebar.js";
import { history, store } from "./state.js";
import { send, sendCommand } from "./transport.js";
import { $, cssEscape, el, randomId, t } from "./ui.js";

var DEBOUNCE_MS = 200;
var JUMP_PAGES_MAX = 50;
var FLASH_MS = 4000;

var timer = null;
var lastId = null;
var jump = null; // {sessionId, seq, pages}

/** The snippet as [{text, mark}] pieces; `highlights` are [start, end) code point spans. */
export function snippetPieces(snippet, highlights) {
  var chars = Array.from(snippet || "");
  var pieces = [];
  var at = 0;
  (highlights || []).forEach(function (span) {
    var start = Math.max(at, Math.min(span[0], chars.length));
    var end = Math.max(start, Math.min(span[1], chars.length));
    if (start > at) {
      pieces.push({ text: chars.slice(at, start).join(""), mark: false });
    }
    if (end > start) {
      pieces.push({ text: chars.slice(start, end).join(""), mark: true });
    }
    at = end;
  });
  if (at < chars.length) {
    pieces.push({ text: chars.slice(at).join(""), mark: false });
  }
  return pieces;
}

function showing(on) {
  $("search-results").hidden = !on;
  $("dialog-list").hidden = on;
}

function ask(query) {
  lastId = randomId();
  send({ type: "search", q: query, client_msg_id: lastId });
}

function onInput() {
  clearTimeout(timer);
  var query = $("search-input").value.trim();
  if (!query) {
    lastId = null;
    showing(false);
    return;
  }
  timer = setTimeout(function () {
    ask(query);
  }, DEBOUNCE_MS);
}

function clearSearch() {
  $("search-input").value = "";
  onInput();
}

function hitButton(hit) {
  var button = el("button", "search-hit");
  button.type = "button";
  button.dataset.sessionId = hit.session_id;
  if (hit.seq != null) {
    button.dataset.seq = hit.seq;
  }
  button.appendChild(el("span", "search-hit-title", hit.title || hit.dialog_id));
  var snippet = el("span", "search-hit-snippet");
  var who = hit.role === "title" ? "search_in_title" : hit.role === "user" ? "search_you" : "search_assistant";
  snippet.appendChild(document.createTextNode(t(who) + ": "));
  snippetPieces(hit.snippet, hit.highlights).forEach(function (piece) {
    snippet.appendChild(piece.mark ? el("mark", null, piece.text) : document.createTextNode(piece.text));
  });
  button.appendChild(snippet);
  button.addEventListener("click", function () {
    openHit(hit);
  });
  return button;
}

function renderResults(frame) {
  var box = $("search-results");
  var items = frame.items || [];
  var summary = el(
    "p",
    "search-summary",
    items.length ? t("search_count", { n: frame.count != null ? frame.count : items.length }) : t("search_no_results")
  );
  summary.setAttribute("role", "status");
  var list = el("ul", "search-list");
  list.setAttribute("role", "list");
  items.forEach(function (hit) {
    var li = el("li");
    li.appendChild(hitButton(hit));
    list.appendChild(li);
  });
  box.replaceChildren(summary, list);
  showing(true);
}

/** A frame from the server: the answer to the newest search only (older ones are stale). */
export function onSearchFrame(frame) {
  if (frame.type === "search_results" && frame.client_msg_id === lastId && $("search-input").value.trim()) {
    renderResults(frame);
  }
  tryJump();
}

function openHit(hit) {
  jump = hit.seq != null ? { sessionId: hit.session_id, seq: hit.seq, pages: 0 } : null;
  if (hit.session_id === history.sessionId) {
    closeSidebar();
    tryJump();
    return;
  }
  sendCommand("/switch " + hit.dialog_id, true);
}

function messageNode(seq) {
  var exact = document.querySelector('#messages [data-seq="' + cssEscape(String(seq)) + '"]');
  if (exact) {
    return exact;
  }
  // A continuation is drawn inside the answer it continues: the last message before it.
  var oldest = history.oldestSeq();
  if (oldest == null || oldest > seq) {
    return null;
  }
  var before = null;
  document.querySelectorAll("#messages [data-seq]").forEach(function (node) {
    if (Number(node.dataset.seq) <= seq) {
      before = node;
    }
  });
  return before;
}

function flash(node) {
  node.classList.add("msg-found");
  node.scrollIntoView({ block: "center" });
  setTimeout(function () {
    node.classList.remove("msg-found");
  }, FLASH_MS);
}

/** Scroll to the hit's message once its dialog is open and the message loaded. */
function tryJump() {
  if (!jump || history.sessionId !== jump.sessionId) {
    return;
  }
  var node = messageNode(jump.seq);
  if (node) {
    jump = null;
    flash(node);
    return;
  }
  if (history.hasMore && jump.pages < JUMP_PAGES_MAX) {
    if (!store.older()) {
      jump.pages += 1;
      $("transcript").scrollTop = 0;
      maybeLoadOlder();
    }
    return;
  }
  jump = null;
}

function hits() {
  return Array.prototype.slice.call(document.querySelectorAll("#search-results .search-hit"));
}

function onKeys(event) {
  var all = hits();
  var index = all.indexOf(document.activeElement);
  if (event.key === "ArrowDown" || event.key === "ArrowUp") {
    if (!all.length) {
      return;
    }
    event.preventDefault();
    var step = event.key === "ArrowDown" ? 1 : -1;
    if (index < 0) {
      (step > 0 ? all[0] : all[all.length - 1]).focus();
    } else if (index + step < 0) {
      $("search-input").focus();
    } else {
      all[Math.min(all.length - 1, index + step)].focus();
    }
  } else if (event.key === "Escape" && $("search-input").value) {
    event.preventDefault(); // the page's Esc (stop, close) waits for the next press
    clearSearch();
    $("search-input").focus();
  } else if (event.key === "Enter" && event.target === $("search-input") && all.length) {
    event.preventDefault();
    all[0].click();
  }
}

function isShortcut(event) {
  return (event.ctrlKey || event.metaKey) && !event.altKey && (event.key === "k" || event.key === "K");
}

export function focusSearch() {
  var app = $("app");
  if (window.matchMedia("(max-width: 768px)").matches && !app.classList.contains("sidebar-open")) {
    $("menu-button").click();
  }
  $("search-input").focus();
  $("search-input").select();
}

export function bindSearch() {
  $("search-input").addEventListener("input", onInput);
  $("sidebar").addEventListener("keydown", onKeys);
  document.addEventListener("keydown", function (event) {
    if (isShortcut(event)) {
      event.preventDefault();
      focusSearch();
    }
  });
  // A dialog list redrawn under the results (a new message elsewhere) stays hidden.
  showing(false);
}
