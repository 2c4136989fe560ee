/*
 * The web chat (SPEC E1): one page, one WebSocket (PROTOCOL.md "WebSocket: /ws/chat/").
 * Native ES modules, no build step; this entry module wires them together:
 *
 *   format.js     pure helpers (text, time, names, backoff)         no DOM
 *   history.js    the open dialog's history and snapshot rules (D2)  no DOM (window.ChatHistory)
 *   state.js      the client's state store, changed through its API  no DOM
 *   ui.js         config and translated strings, DOM helpers, toasts
 *   markdown.js   untrusted markdown -> sanitised DOM (marked + DOMPurify)
 *   transport.js  the socket: connect, backoff, send, aim at a dialog
 *   render.js     the transcript, notes, older pages, scrolling
 *   stream.js     the running turn's answer as it streams
 *   composer.js   send / stop / queued chips / read-only note
 *   header.js     title and rename, connection status, address
 *   sidebar.js    the dialog list, its menu, the phone slide-over
 *   settings.js   the dialog's model picker, settings panel and token usage (H4)
 *   frames.js     what each server frame does to the page
 *   search.js     the sidebar's search (Ctrl+K), opening a hit at its message
 *   carry.js      export, import and share links (dialog menu, sidebar)
 *   share.js      the public share page's Markdown (its own page, not this one)
 *   draft.js      a new dialog is a draft until its first message (its state)
 *   newdialog.js  "New dialog": the page empties into a draft
 *   slash.js      typed slash commands; "Send as a message" for an unknown one
 *   codehl.js     syntax highlighting of fenced code (vendored highlight.js)
 *   shortcuts.js  keyboard shortcuts and their "?" sheet
 *   theme.js      the light / dark / system theme, remembered per browser
 *
 * The server owns all state; this page mirrors it. The socket reconnects with exponential
 * backoff and jitter; the server's `sessions` + `session_history` on reopen replace the
 * state (resync). A normal turn never reloads it.
 */
import { editLastMessage } from "./branches.js";
import { bindCarry } from "./carry.js";
import { autosize, bindComposer, sendMessage, stopTurn, updateRunning } from "./composer.js";
import { dialogFromHash, isLinked } from "./format.js";
import { connectionLost, handleFrame } from "./frames.js";
import { bindHeader, renderHeader, setConnection, showCountdown } from "./header.js";
import { bindNewDialog } from "./newdialog.js";
import { onScroll } from "./render.js";
import { bindSearch, onSearchFrame } from "./search.js";
import { bindSettings } from "./settings.js";
import { bindShortcuts, onEditLast } from "./shortcuts.js";
import { bindSlash } from "./slash.js";
import { bindSidebar, closeMenu, closeSidebar, isSidebarOpen, renderSidebar } from "./sidebar.js";
import { store } from "./state.js";
import { bindTheme } from "./theme.js";
import { hasSocket, reconnectNow, start } from "./transport.js";
import { $ } from "./ui.js";

/** Esc closes what is open (menu, slide-over) first, and stops the running answer last. */
function onEscape(event) {
  if (event.key !== "Escape" || event.defaultPrevented) {
    return;
  }
  if (!$("dialog-menu").hidden) {
    closeMenu();
    return;
  }
  if (document.querySelector("dialog[open]")) {
    return; // a modal (delete confirmation, shortcuts) closes itself
  }
  if (isSidebarOpen()) {
    closeSidebar();
    $("menu-button").focus();
    return;
  }
  if (store.isRunning()) {
    event.preventDefault();
    stopTurn();
  }
}

function init() {
  bindTheme();
  bindComposer();
  bindShortcuts();
  onEditLast(editLastMessage); // ↑ in an empty composer edits your last message (H1)
  document.addEventListener("keydown", onEscape);
  bindSidebar();
  bindSearch();
  bindCarry();
  bindNewDialog();
  bindSlash(function (content) {
    return sendMessage(content, [], true);
  });
  bindHeader();
  bindSettings();
  $("reconnect-now").addEventListener("click", reconnectNow);
  $("jump-latest").addEventListener("click", function () {
    var s = $("transcript");
    s.scrollTo({ top: s.scrollHeight, behavior: "smooth" });
  });
  $("transcript").addEventListener("scroll", onScroll, { passive: true });
  window.addEventListener("resize", function () {
    closeMenu();
    autosize();
  });
  window.addEventListener("online", reconnectNow);
  document.addEventListener("visibilitychange", function () {
    if (!document.hidden && !hasSocket()) {
      reconnectNow();
    }
  });
  setInterval(function () {
    // Keep "5 min ago" honest.
    if (!document.hidden) {
      renderSidebar();
    }
  }, 60000);

  var wanted = dialogFromHash(location.hash || "");
  if (wanted && isLinked(wanted) && wanted.indexOf(":") >= 0) {
    store.wantBack(null, wanted);
  } else if (wanted) {
    store.wantBack(wanted, null);
  }
  renderHeader();
  updateRunning();
  autosize();
  start({
    onFrame: function (frame) {
      handleFrame(frame);
      onSearchFrame(frame); // search results, and the jump to a found message (H2)
    },
    onStatus: setConnection,
    onCountdown: showCountdown,
    onLost: connectionLost,
  });
  if (!window.matchMedia("(pointer: coarse)").matches) {
    $("composer-input").focus(); // not on phones: it would pop the keyboard over the page
  }
}

if (document.readyState === "loading") {
  document.addEventListener("DOMContentLoaded", init);
} else {
  init();
}
