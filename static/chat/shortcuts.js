/*
 * Keyboard shortcuts (issue 54) and the "?" sheet that lists them. Ctrl/⌘+Shift+O starts a
 * new dialog, ↑ in an empty composer edits your last message (when the page offers editing:
 * `onEditLast`), "?" opens the sheet. The sheet also lists the shortcuts other modules own:
 * Ctrl/⌘+K for the dialog search (search.js, when the page has the box), Esc to stop the
 * running answer (app.js). Single keys act only when no field has the focus, so typing is
 * never taken.
 */
import { startDraft } from "./newdialog.js";
import { $, el, t } from "./ui.js";

var editLast = null; // a function given by the part of the page that edits messages

/** Let ↑ in an empty composer edit the last message: `handler()` returns true when it did. */
export function onEditLast(handler) {
  editLast = handler;
}

function searchBox() {
  return document.getElementById("search-input");
}

var MAC = /Mac|iPhone|iPad/.test(navigator.platform || "");
var MOD = MAC ? "⌘" : "Ctrl";

function rows() {
  var list = [
    { keys: [MOD, "Shift", "O"], label: t("shortcut_new_dialog") },
  ];
  if (searchBox()) {
    list.push({ keys: [MOD, "K"], label: t("shortcut_search") });
  }
  list.push({ keys: ["Enter"], label: t("shortcut_send") });
  list.push({ keys: ["Shift", "Enter"], label: t("shortcut_new_line") });
  if (editLast) {
    list.push({ keys: ["↑"], label: t("shortcut_edit_last") });
  }
  list.push({ keys: ["Esc"], label: t("shortcut_stop") });
  list.push({ keys: ["?"], label: t("shortcut_help") });
  return list;
}

export function openShortcuts() {
  var dialog = $("shortcuts-dialog");
  var table = $("shortcuts-list");
  table.replaceChildren();
  rows().forEach(function (row) {
    var dt = el("dt", "shortcut-keys");
    row.keys.forEach(function (key, index) {
      if (index) {
        dt.appendChild(document.createTextNode(" + "));
      }
      dt.appendChild(el("kbd", null, key));
    });
    table.appendChild(dt);
    table.appendChild(el("dd", "shortcut-label", row.label));
  });
  if (!dialog.open) {
    dialog.showModal();
  }
}

function typingIn(target) {
  return (
    target &&
    (/^(INPUT|TEXTAREA|SELECT)$/.test(target.nodeName) || target.isContentEditable)
  );
}

function onKey(event) {
  if (event.defaultPrevented || event.isComposing) {
    return;
  }
  var mod = MAC ? event.metaKey : event.ctrlKey;
  var key = (event.key || "").toLowerCase();
  if (mod && event.shiftKey && !event.altKey && key === "o") {
    event.preventDefault();
    startDraft();
    return;
  }
  if (event.key === "ArrowUp" && !mod && !event.shiftKey && !event.altKey && editLast) {
    var input = $("composer-input");
    if (event.target === input && !input.value && editLast()) {
      event.preventDefault();
    }
    return;
  }
  if (event.key === "?" && !mod && !event.altKey && !typingIn(event.target)) {
    if (document.querySelector("dialog[open]")) {
      return;
    }
    event.preventDefault();
    openShortcuts();
  }
}

export function bindShortcuts() {
  document.addEventListener("keydown", onKey);
  $("shortcuts-button").addEventListener("click", openShortcuts);
}
