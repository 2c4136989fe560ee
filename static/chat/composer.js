/*
 * The composer (E1): Enter sends, Shift+Enter adds a line, slash commands go as they are
 * (B3), Stop / Esc ends the running answer, a read-only linked dialog disables it with a
 * note. A sent message shows at once as a pending bubble with its queue chip until the
 * server's delta brings the stored one (or says why it was not sent).
 */
import {
  attachmentsBusy,
  attachmentsView,
  bindAttachments,
  clearAttachments,
  readyAttachments,
  restoreAttachments,
} from "./attachments.js";
import { draftAllows, isDraft, openDraft } from "./draft.js";
import { platformName } from "./format.js";
import { clearTurnNote, scrollToBottom, updateEmpty } from "./render.js";
import { hideOffer, rememberTyped } from "./slash.js";
import { history, store } from "./state.js";
import { aim, isOpen, send, sendCommand } from "./transport.js";
import { $, actionButton, config, el, icon, randomId, t, toast } from "./ui.js";

var CONTENT_LIMIT = config.content_limit || 65536;

// --- Pending (optimistic) user messages and their queue chips -------------------------------

export function renderPending() {
  var container = $("pending");
  container.replaceChildren();
  store.pending().forEach(function (p) {
    if (p.sessionId && history.sessionId && p.sessionId !== history.sessionId) {
      return;
    }
    var node = el("div", "msg msg-user msg-pending");
    node.dataset.clientMsgId = p.id;
    if (p.attachments && p.attachments.length) {
      node.appendChild(attachmentsView(p.attachments));
    }
    if (p.content) {
      node.appendChild(el("div", "bubble", p.content));
    }
    var meta = el("div", "pending-meta");
    if (p.error || p.unconfirmed) {
      node.classList.add("msg-failed");
      meta.appendChild(icon("alert"));
      meta.appendChild(
        el("span", "pending-error", p.error ? t("not_sent", { message: p.error }) : t("not_confirmed"))
      );
      meta.appendChild(actionButton(p.unconfirmed ? t("resend") : t("edit"), function () {
        dropPending(p);
        if (p.unconfirmed) {
          sendMessage(p.content, p.attachments);
        } else {
          var input = $("composer-input");
          input.value = p.content;
          restoreAttachments(p.attachments);
          autosize();
          updateSendButton();
          input.focus();
        }
      }));
      meta.appendChild(actionButton(t("dismiss"), function () {
        dropPending(p);
      }));
    } else {
      var chip = el("span", "chip chip-queued");
      if (!p.turnId) {
        chip.textContent = t("sending");
      } else if (p.position > 0) {
        chip.textContent = t("queued_ahead", { n: p.position });
      } else {
        chip.textContent = t("starting");
      }
      meta.appendChild(chip);
    }
    node.appendChild(meta);
    container.appendChild(node);
  });
}

export function dropPending(pending) {
  store.removePending(pending);
  renderPending();
}

var lastReturnNotice = 0;

/** A queued message the server dropped unsent (Stop drops the queue, C6): its text comes
 * back to the composer (after what is typed there), and the user is told. */
export function returnToComposer(pending) {
  dropPending(pending);
  var text = pending.content || "";
  var files = pending.attachments || [];
  if (!text.trim() && !files.length) {
    return;
  }
  if (files.length) {
    restoreAttachments(files); // H3: its files come back as chips too
  }
  var input = $("composer-input");
  if (text.trim()) {
    input.value = input.value.trim() ? input.value.replace(/\s+$/, "") + "\n\n" + text : text;
  }
  autosize();
  updateSendButton();
  if (Date.now() - lastReturnNotice > 1000) {
    lastReturnNotice = Date.now(); // one notice for a queue dropped at once
    toast(t("queued_returned"), "info");
  }
}

/** The stored message (or the turn's end) replaces its pending bubble. */
export function dropPendingFor(clientMsgId, turnId) {
  var pending = store.findPending(clientMsgId) || store.findPendingByTurn(turnId);
  if (pending) {
    dropPending(pending);
  }
}

// --- Sending --------------------------------------------------------------------------------

export function autosize() {
  var input = $("composer-input");
  input.style.height = "auto";
  var max = Math.max(120, Math.round(window.innerHeight * 0.4));
  input.style.height = Math.min(input.scrollHeight, max) + "px";
  input.style.overflowY = input.scrollHeight > max ? "auto" : "hidden";
}

export function updateSendButton() {
  var input = $("composer-input");
  var filled = input.value.trim() || readyAttachments().length;
  $("send-button").disabled = !filled || attachmentsBusy() || !isOpen() || input.disabled;
}

/** Send `content` with the uploaded `attachments` (H3) as a message; `literal`: even when it
 * starts with `/` (PROTOCOL `send`). The first message of a draft dialog makes the dialog
 * first (draft.js). */
export function sendMessage(content, attachments, literal) {
  if (!isOpen()) {
    toast(t("offline_cannot_send"), "error");
    return false;
  }
  if (isDraft() && !openDraft()) {
    return false;
  }
  var id = randomId();
  var frame = aim({ type: "send", content: content, client_msg_id: id });
  if (literal) {
    frame.literal = true;
  }
  var refs = attachments || [];
  if (refs.length) {
    // H3: the uploaded files go with the send by id.
    frame.attachments = refs.map(function (ref) {
      return ref.file_id;
    });
  }
  store.addPending({
    id: id,
    sessionId: history.sessionId,
    content: content,
    attachments: refs,
    turnId: null,
  });
  send(frame);
  clearTurnNote();
  renderPending();
  updateEmpty();
  scrollToBottom();
  return true;
}

function submitComposer() {
  var input = $("composer-input");
  var content = input.value;
  var trimmed = content.trim();
  var attachments = readyAttachments();
  if (attachmentsBusy()) {
    toast(t("attach_wait"), "error");
    return;
  }
  if (!trimmed && !attachments.length) {
    return;
  }
  if (!isOpen()) {
    toast(t("offline_cannot_send"), "error");
    return;
  }
  if (store.isReadOnly()) {
    return;
  }
  var length = window.ChatHistory.codePointLength(content);
  if (length > CONTENT_LIMIT) {
    toast(t("too_long", { n: length, limit: CONTENT_LIMIT }), "error");
    return;
  }
  if (trimmed.charAt(0) === "/" && !attachments.length) {
    // Slash commands go to the server as they are (B3); it answers each one. The text stays
    // in the composer until it does: an unknown command offers to send it as a message.
    if (isDraft() && !draftAllows(trimmed)) {
      toast(t("draft_command"), "info");
      return;
    }
    var commandId = sendCommand(trimmed, false);
    if (commandId) {
      rememberTyped(commandId, content);
    }
    return;
  } else if (!sendMessage(trimmed ? content : "", attachments, trimmed.charAt(0) === "/")) {
    // With files attached, a leading "/" is text, not a command.
    return;
  }
  clearAttachments();
  hideOffer();
  input.value = "";
  autosize();
  updateSendButton();
}

// --- Running state / Stop -------------------------------------------------------------------

export function updateRunning() {
  var running = store.isRunning();
  var stopping = store.isStopping();
  var stop = $("stop-button");
  stop.hidden = !running || store.isReadOnly();
  stop.disabled = stopping;
  stop.querySelector(".stop-label").textContent = stopping ? t("stopping") : t("stop");
  stop.setAttribute("aria-label", stopping ? t("stopping") : t("stop") + " (Esc)");
  $("app").classList.toggle("is-running", running);
  $("composer-hint").textContent = running ? t("esc_to_stop") + " · " + t("hint") : t("hint");
}

export function stopTurn() {
  if (!store.isRunning() || store.isStopping() || store.isReadOnly()) {
    return;
  }
  // Answered by a `command_result` ("Stopped the running answer."): the UI shows the
  // outcome itself (the turn ends as cancelled), so the answer stays silent.
  var id = randomId();
  var frame = aim({ type: "stop", client_msg_id: id });
  store.markSilent(id, "/stop");
  if (send(frame)) {
    store.setStopping(true);
    updateRunning();
    // If the server had nothing left to stop, do not keep "Stopping…" forever.
    setTimeout(function () {
      if (store.isStopping()) {
        store.setStopping(false);
        updateRunning();
      }
    }, 8000);
  }
}

/** A read-only linked dialog can be followed, not written to: the composer says so. */
export function updateReadOnly() {
  var item = store.findSession(history.sessionId);
  var readOnly = Boolean(item && item.read_only);
  var input = $("composer-input");
  var note = $("composer-readonly");
  if (!input.dataset.placeholder) {
    input.dataset.placeholder = input.placeholder;
  }
  input.disabled = readOnly;
  input.placeholder = readOnly ? t("read_only_placeholder") : input.dataset.placeholder;
  note.hidden = !readOnly;
  note.textContent = readOnly ? t("read_only_note", { platform: platformName(item.channel) }) : "";
  $("app").classList.toggle("is-read-only", readOnly);
  updateSendButton();
  updateRunning();
}

/** Wire the form: Enter sends (never during IME composition), typing resizes the box. */
export function bindComposer() {
  var input = $("composer-input");
  $("composer").addEventListener("submit", function (event) {
    event.preventDefault();
    submitComposer();
  });
  input.addEventListener("input", function () {
    autosize();
    updateSendButton();
    hideOffer();
  });
  input.addEventListener("keydown", function (event) {
    // IME composition (Chinese, Japanese…) uses Enter to pick characters: never send then.
    if (event.isComposing || event.keyCode === 229) {
      return;
    }
    if (event.key === "Enter" && !event.shiftKey && !event.altKey && !event.ctrlKey && !event.metaKey) {
      event.preventDefault();
      submitComposer();
    }
  });
  $("stop-button").addEventListener("click", stopTurn);
  bindAttachments(updateSendButton);
}
