/*
 * Versions of a message (H1): the "‹ 2/3 ›" switcher on a message whose parent has several
 * children (`siblings`), Edit on the user's own messages (in place: Enter saves and sends as
 * a new version, Escape cancels) and Regenerate on answers. Switching sends `branch`; the
 * server answers with the new path's `session_history`, and the view keeps the switched
 * message where the reader had it (`restoreAnchor`). ↑ in an empty composer opens the last
 * editable message's editor (`editLastMessage`, wired to shortcuts.js by app.js).
 */
import { store } from "./state.js";
import { aim, send } from "./transport.js";
import { $, el, icon, randomId, t, toast } from "./ui.js";

// The message a switch was made on and where it stood on the screen, until its history comes.
var anchor = null;
// Edits sent and not yet shown by a `session_history`: client_msg_id -> how to undo the view.
var sentEdits = new Map();
// A shown user message with Edit -> how to open its editor (`opener` gets the focus back).
var editors = new WeakMap();

function sendOrWarn(frame) {
  if (send(aim(frame))) {
    return true;
  }
  toast(t("offline_cannot_send"), "error");
  return false;
}

/** "‹ n/total ›" for a message with siblings; null for one without. */
export function versionSwitcher(m) {
  var kin = Array.isArray(m.siblings) ? m.siblings : [];
  var at = kin.indexOf(m.seq);
  if (kin.length < 2 || at < 0) {
    return null;
  }
  var nav = el("div", "versions");
  nav.setAttribute("role", "group");
  nav.setAttribute("aria-label", t("version_of", { n: at + 1, total: kin.length }));
  function step(label, to, text) {
    var button = el("button", "version-step", text);
    button.type = "button";
    button.setAttribute("aria-label", label);
    button.disabled = to < 0 || to >= kin.length;
    button.addEventListener("click", function () {
      switchTo(button, kin[to]);
    });
    return button;
  }
  nav.appendChild(step(t("previous_version"), at - 1, "‹"));
  nav.appendChild(el("span", "version-count", at + 1 + "/" + kin.length));
  nav.appendChild(step(t("next_version"), at + 1, "›"));
  return nav;
}

function switchTo(button, seq) {
  var node = button.closest(".msg");
  var top = node ? node.getBoundingClientRect().top : null;
  if (sendOrWarn({ type: "branch", seq: seq, client_msg_id: randomId() })) {
    anchor = { seq: seq, top: top, focus: button.getAttribute("aria-label") };
  }
}

/** An edit the server refused (`error` with its client_msg_id): the message shows its text
 * again. True when `id` was such an edit (the caller still shows the error). */
export function editRefused(id) {
  var undo = id && sentEdits.get(id);
  if (!undo) {
    return false;
  }
  sentEdits.delete(id);
  undo();
  return true;
}

/** After a `session_history`: put the message a switch was made on back where it stood (and
 * keep the keyboard on its switcher). False when no switch is waiting (the caller scrolls as
 * usual). */
export function restoreAnchor() {
  sentEdits.clear(); // the transcript was drawn again from the server's view
  var wanted = anchor;
  anchor = null;
  if (!wanted) {
    return false;
  }
  var node = document.querySelector('#messages .msg[data-seq="' + wanted.seq + '"]');
  if (!node) {
    return false;
  }
  if (wanted.top != null) {
    $("transcript").scrollTop += node.getBoundingClientRect().top - wanted.top;
  }
  var again = node.querySelector('.version-step[aria-label="' + wanted.focus + '"]');
  if (again && !again.disabled) {
    again.focus({ preventScroll: true });
  } else {
    var count = node.querySelector(".version-step:not([disabled])");
    if (count) {
      count.focus({ preventScroll: true });
    }
  }
  return true;
}

function action(name, label, onClick) {
  var button = el("button", "msg-action");
  button.type = "button";
  button.setAttribute("aria-label", label);
  button.appendChild(icon(name));
  button.appendChild(el("span", null, label));
  button.addEventListener("click", onClick);
  return button;
}

/** Regenerate, on an answer (also a completed one). */
export function regenerateAction(m) {
  var button = action("retry", t("regenerate"), function () {
    if (sendOrWarn({ type: "regenerate", seq: m.seq, client_msg_id: randomId() })) {
      button.disabled = true;
    }
  });
  button.classList.add("regenerate-btn");
  return button;
}

/** The foot of a user message: its versions, then its actions (`bar`, e.g. Copy) with Edit
 * for a message with text. */
export function userFoot(m, node, bar) {
  var foot = el("div", "msg-foot msg-user-foot");
  var versions = versionSwitcher(m);
  if (versions) {
    foot.appendChild(versions);
  }
  bar = bar || el("div", "msg-actions");
  if (m.content) {
    var edit = action("edit", t("edit"), function () {
      openEditor(m, node, edit);
    });
    edit.classList.add("edit-btn");
    bar.appendChild(edit);
    editors.set(node, function (opener) {
      openEditor(m, node, opener);
    });
  }
  foot.appendChild(bar);
  return foot;
}

/** ↑ in an empty composer: open the editor of the newest user message of the shown branch
 * that can be edited (committed, with text, in a dialog you may write to). False when there
 * is none, so the key does what it always does. */
export function editLastMessage() {
  if (store.isReadOnly()) {
    return false;
  }
  var nodes = document.querySelectorAll("#messages .msg-user");
  for (var i = nodes.length - 1; i >= 0; i--) {
    var node = nodes[i];
    var open = editors.get(node);
    if (node.classList.contains("msg-pending") || !open) {
      continue;
    }
    var box = node.querySelector(".edit-input");
    if (!box) {
      open($("composer-input")); // Escape gives the composer its focus back
      box = node.querySelector(".edit-input");
    }
    if (!box) {
      return false;
    }
    node.scrollIntoView({ block: "nearest" });
    box.focus({ preventScroll: true });
    return true;
  }
  return false;
}

function openEditor(m, node, opener) {
  var bubble = node.querySelector(".bubble");
  if (!bubble || node.querySelector(".edit-box")) {
    return;
  }
  var box = el("div", "edit-box");
  var area = el("textarea", "edit-input");
  area.value = m.content || "";
  area.rows = Math.min(10, Math.max(2, area.value.split("\n").length));
  area.setAttribute("aria-label", t("edit_label"));
  var hint = el("div", "edit-hint", t("edit_hint"));
  var buttons = el("div", "edit-buttons");
  var cancel = el("button", "btn btn-small edit-cancel", t("cancel"));
  cancel.type = "button";
  var save = el("button", "btn btn-small edit-save", t("save_and_send"));
  save.type = "button";
  buttons.appendChild(cancel);
  buttons.appendChild(save);
  box.appendChild(area);
  box.appendChild(buttons);
  box.appendChild(hint);
  bubble.hidden = true;
  node.classList.add("is-editing");
  bubble.after(box);

  function close() {
    box.remove();
    bubble.hidden = false;
    node.classList.remove("is-editing");
    opener.focus({ preventScroll: true });
  }
  function submit() {
    var text = area.value;
    if (!text.trim()) {
      return;
    }
    if (text === m.content) {
      close();
      return;
    }
    var id = randomId();
    if (sendOrWarn({ type: "edit", seq: m.seq, content: text, client_msg_id: id })) {
      bubble.textContent = text;
      node.classList.add("msg-pending");
      sentEdits.set(id, function () {
        bubble.textContent = m.content || "";
        node.classList.remove("msg-pending");
      });
      close();
    }
  }
  cancel.addEventListener("click", close);
  save.addEventListener("click", submit);
  area.addEventListener("keydown", function (event) {
    if (event.key === "Escape") {
      event.preventDefault();
      event.stopPropagation();
      close();
    } else if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      submit();
    }
  });
  area.focus();
  area.setSelectionRange(area.value.length, area.value.length);
}
