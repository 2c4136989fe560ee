/*
 * A new dialog of the web chat is a draft until its first message (issue 54): "New dialog"
 * stores nothing, it only empties the page; clicking it again keeps the same draft. The
 * first message makes the dialog (`/new`, silent) and goes into it: frames of one socket are
 * handled in order, so the send lands in the new dialog (PROTOCOL). Chat apps and the
 * terminal keep `/new` as it is; typed in the web chat it still makes a dialog at once.
 */
import { renderPending, updateReadOnly, updateRunning } from "./composer.js";
import { renderHeader } from "./header.js";
import { clearTurnNote, renderOlderIndicator, renderTranscript, updateEmpty } from "./render.js";
import { closeSidebar, renderSidebar } from "./sidebar.js";
import { history, store } from "./state.js";
import { removeStreaming } from "./stream.js";
import { sendCommand } from "./transport.js";
import { $ } from "./ui.js";

var draft = false;

// Commands that do not act on the open dialog make sense in a draft (it has none yet).
var DRAFT_COMMANDS = ["new", "switch", "sessions", "help"];

export function isDraft() {
  return draft;
}

/** Show an empty draft dialog (or keep the one shown), ready to type in. */
export function startDraft() {
  closeSidebar();
  if (!draft) {
    draft = true;
    history.reset();
    store.resetTurns();
    store.setOlder(null);
    removeStreaming();
    renderTranscript();
    clearTurnNote();
    renderPending();
    renderOlderIndicator();
    updateEmpty();
    renderHeader();
    renderSidebar();
    updateReadOnly();
    updateRunning();
    if (location.hash) {
      window.history.replaceState(null, "", location.pathname + location.search);
    }
  }
  $("composer-input").focus();
}

/** A `session_history` arrived: the page shows a stored dialog again. */
export function leaveDraft() {
  draft = false;
}

/** Make the draft's dialog before its first message goes (false: offline). */
export function openDraft() {
  return Boolean(sendCommand("/new", true));
}

export function draftAllows(commandLine) {
  var name = commandLine.trim().slice(1).split(/\s+/)[0].toLowerCase();
  return DRAFT_COMMANDS.indexOf(name) >= 0;
}
