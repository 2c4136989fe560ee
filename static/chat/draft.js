/*
 * A new dialog of the web chat is a draft until its first message (issue 54): "New dialog"
 * stores nothing, it only empties the page (newdialog.js); clicking it again keeps the same
 * draft. The first message makes the dialog (`/new`, silent) and goes into it: frames of one
 * socket are handled in order, so the send lands in the new dialog (PROTOCOL). Chat apps and
 * the terminal keep `/new` as it is; typed in the web chat it still makes a dialog at once.
 * This module holds the draft's state only.
 */
import { sendCommand } from "./transport.js";

var draft = false;

// Commands that do not act on the open dialog make sense in a draft (it has none yet).
var DRAFT_COMMANDS = ["new", "switch", "sessions", "help"];

export function isDraft() {
  return draft;
}

/** The page now shows a draft (true when it did not already). */
export function enterDraft() {
  var entered = !draft;
  draft = true;
  return entered;
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
