/*
 * What each server frame does to the page (PROTOCOL.md "WebSocket: /ws/chat/"): `sessions`
 * feeds the sidebar (`unchanged` after a reconnect: the list held stays), `session_history`
 * replaces the transcript, `history_delta` appends to it through ChatHistory (history.js,
 * D2; a reconnect's resume delta also brings the running turn and the queue, "On connect"),
 * `turn_snapshot` streams the running answer (D1), `turn_updated` ends it. Unknown frames
 * are ignored.
 */
import {
  dropPending,
  dropPendingFor,
  renderPending,
  returnToComposer,
  updateReadOnly,
  updateRunning,
} from "./composer.js";
import { editRefused, restoreAnchor } from "./branches.js";
import { leaveDraft } from "./draft.js";
import { isLinked } from "./format.js";
import { renderHeader, updateHash } from "./header.js";
import {
  appendCommandLine,
  appendMessages,
  clearTurnNote,
  endContinuing,
  isNearBottom,
  maybeLoadOlder,
  prependOlder,
  refreshContinue,
  renderOlderIndicator,
  renderTranscript,
  scrollToBottom,
  showTurnNote,
  updateEmpty,
} from "./render.js";
import { settingsFrame } from "./settings.js";
import { closeSidebar, openLinked, renderSidebar } from "./sidebar.js";
import { history, store } from "./state.js";
import { typedAnswered, typedRefused } from "./slash.js";
import { isStreaming, removeStreaming, showStreaming, showWaiting } from "./stream.js";
import { askHistory, send, sendCommand } from "./transport.js";
import { $, announce, config, t, toast } from "./ui.js";

export function handleFrame(frame) {
  switch (frame.type) {
    case "sessions":
      onSessions(frame);
      break;
    case "session_history":
      onSessionHistory(frame);
      break;
    case "queued":
      onQueued(frame);
      break;
    case "history_delta":
      onDelta(frame);
      break;
    case "turn_snapshot":
      onSnapshot(frame);
      break;
    case "turn_updated":
      onTurnUpdated(frame);
      break;
    case "session_updated":
      onSessionUpdated(frame);
      break;
    case "system_notification":
      toast(frame.content, frame.level === "error" ? "error" : frame.level || "info");
      break;
    case "command_result":
      onCommandResult(frame);
      break;
    case "error":
      onError(frame);
      break;
    default:
      break; // unknown frames are ignored (PROTOCOL: clients ignore what they do not know)
  }
  settingsFrame(frame); // H4: the model picker and settings panel follow the open dialog
}

/** The socket closed: what was on its way is lost; remember the dialog to come back to. */
export function connectionLost() {
  // The server may never confirm what it did not ack; say so on those bubbles.
  store.markUnconfirmed();
  store.setOlder(null);
  store.historyArrived();
  store.setStopping(false);
  var linked = isLinked(history.sessionId);
  store.wantBack(linked ? null : history.dialogId, linked ? history.sessionId : null);
  renderPending();
  updateRunning();
}

function onSessions(frame) {
  if (!frame.unchanged) {
    store.setSessions(frame.items);
  }
  if (frame.etag) {
    store.setSessionsEtag(frame.etag);
  }
  renderSidebar();
  updateReadOnly();
}

function onSessionHistory(frame) {
  var older = store.older();
  if (older && frame.session_id === history.sessionId && isOlderPage(frame, older)) {
    store.setOlder(null);
    prependOlder(frame);
    return;
  }
  store.setOlder(null);
  store.historyArrived();
  leaveDraft();
  var switched = frame.session_id !== history.sessionId;
  history.load(frame);
  store.markLoaded();
  store.markRead(frame.session_id);
  store.resetTurns();
  if (frame.active_turn) {
    store.turnStarted(frame.active_turn.turn_id);
  }
  store.reconcilePending(frame);
  renderTranscript();
  renderPending();
  renderOlderIndicator();
  updateEmpty();
  refreshContinue();
  if (frame.active_turn) {
    var text = history.turnText(frame.active_turn.turn_id);
    showStreaming(frame.active_turn.turn_id, text, frame.active_turn.tools || []);
  } else {
    removeStreaming();
  }
  renderHeader();
  renderSidebar();
  updateReadOnly();
  updateRunning();
  updateHash();
  var anchored = restoreAnchor();
  if (switched || !anchored) {
    scrollToBottom();
  }
  maybeLoadOlder();
  if (switched) {
    closeSidebar();
    var active = document.activeElement;
    var typing = active && /^(INPUT|TEXTAREA)$/.test(active.nodeName) && active.id !== "composer-input";
    if (!typing && !window.matchMedia("(pointer: coarse)").matches) {
      $("composer-input").focus({ preventScroll: true }); // ready to type in the new dialog
    }
  }
  restoreWanted(frame);
}

/** Restore the dialog the reader was on (after a reconnect, or from the address). */
function restoreWanted(frame) {
  var want = store.takeWanted();
  if (want.session && want.session !== frame.session_id && store.findSession(want.session)) {
    openLinked(store.findSession(want.session));
  } else if (want.dialog && want.dialog !== frame.dialog_id && store.findDialog(want.dialog)) {
    sendCommand("/switch " + want.dialog, true);
  }
}

/**
 * The reconnect's answer when this page held the open dialog (PROTOCOL "On connect"): what
 * came after the revision it held (most often nothing), the running turn and the queue. The
 * transcript stays as it is; what is new is appended, and the turn's state is the server's.
 */
function onResume(frame) {
  store.setOlder(null);
  store.historyArrived();
  if (history.resume(frame) !== "applied") {
    askHistory(); // not the revision this page shows: load the page once
    return;
  }
  var added = history.lastAdded();
  var stick = isNearBottom();
  store.markRead(frame.session_id);
  store.resetTurns();
  if (frame.active_turn) {
    store.turnStarted(frame.active_turn.turn_id);
  } else {
    removeStreaming(); // a turn that ended meanwhile: its messages are in this delta
  }
  store.reconcilePending(frame);
  appendMessages(added);
  renderPending();
  updateEmpty();
  refreshContinue();
  if (frame.active_turn) {
    var turnId = frame.active_turn.turn_id;
    showStreaming(turnId, history.turnText(turnId), frame.active_turn.tools || []);
  }
  store.touchSession(frame.session_id, added);
  renderHeader();
  renderSidebar();
  updateReadOnly();
  updateRunning();
  if (stick) {
    scrollToBottom();
  }
  restoreWanted(frame);
}

function isOlderPage(frame, older) {
  if (frame.client_msg_id && frame.client_msg_id === older.id) {
    return true;
  }
  var messages = frame.messages || [];
  if (!messages.length) {
    return !frame.active_turn && frame.history_revision === history.revision;
  }
  return messages[messages.length - 1].seq < older.beforeSeq;
}

function onQueued(frame) {
  var pending = store.findPending(frame.client_msg_id);
  if (frame.session_id === history.sessionId && frame.turn_id && frame.mode !== "inject") {
    store.turnStarted(frame.turn_id);
    clearTurnNote();
  }
  if (frame.mode === "continue" && frame.turn_id) {
    store.markContinuing(frame.turn_id);
  }
  if (frame.session_id === history.sessionId && frame.turn_id && !frame.position) {
    // Nothing ahead: the answer starts now; show it is coming before its first token.
    showWaiting(frame.turn_id);
  }
  if (pending) {
    if (!frame.turn_id) {
      // An idle inject is no turn: its message arrives as a delta.
      dropPending(pending);
    } else {
      store.pendingQueued(pending, frame);
      renderPending();
    }
  }
  updateRunning();
}

function onDelta(frame) {
  if (window.ChatHistory.isResume(frame)) {
    onResume(frame);
    return;
  }
  if (frame.session_id !== history.sessionId) {
    onOtherDialogActivity(frame);
    return;
  }
  var verdict = history.applyDelta(frame);
  if (verdict === "gap") {
    askHistory();
    return;
  }
  if (verdict !== "applied") {
    return;
  }
  var added = history.lastAdded();
  var stick = isNearBottom();
  var endsStream = false;
  var streaming = store.streaming();
  added.forEach(function (m) {
    var src = m.source || {};
    if (m.role === "user") {
      dropPendingFor(src.client_msg_id, m.turn_id);
      if (m.turn_id) {
        clearTurnNote();
      }
    }
    if (streaming && m.turn_id === streaming.turnId && (m.role === "assistant" || m.role === "tool")) {
      endsStream = true;
    }
  });
  if (endsStream) {
    // The committed messages replace the streamed text (same words, now final).
    removeStreaming();
  }
  appendMessages(added);
  added.forEach(function (m) {
    if (m.role === "user" && m.turn_id && store.isTurnLive(m.turn_id)) {
      showWaiting(m.turn_id); // the turn started: the indicator until its first snapshot
    }
  });
  updateEmpty();
  refreshContinue();
  store.touchSession(frame.session_id, added);
  renderSidebar();
  if (stick) {
    scrollToBottom();
  }
}

function onOtherDialogActivity(frame) {
  var item = store.findSession(frame.session_id);
  if (!item) {
    send({ type: "sessions" }); // a dialog we do not list yet (made elsewhere)
    return;
  }
  var messages = frame.messages || [];
  var news = messages.some(function (m) {
    return m.role === "assistant" || m.role === "system";
  });
  if (news) {
    store.markUnread(frame.session_id);
  }
  store.touchSession(frame.session_id, messages);
  renderSidebar();
}

function onSnapshot(frame) {
  if (frame.session_id !== history.sessionId) {
    return;
  }
  var result = history.applySnapshot(frame);
  if (result.status === "gap") {
    askHistory();
    return;
  }
  if (result.status !== "applied") {
    return;
  }
  store.turnStarted(frame.turn_id);
  showStreaming(frame.turn_id, result.text, result.tools);
  updateRunning();
}

function onTurnUpdated(frame) {
  var pending = store.findPending(frame.client_msg_id) || store.findPendingByTurn(frame.turn_id);
  if (pending && frame.status === "cancelled" && frame.reason === "dropped") {
    returnToComposer(pending); // never stored: its text must not vanish (issue 54)
  } else if (pending) {
    dropPending(pending);
  }
  if (frame.session_id !== history.sessionId) {
    var item = store.findSession(frame.session_id);
    if (item && frame.status === "failed") {
      store.markUnread(frame.session_id);
      renderSidebar();
    }
    return;
  }
  store.turnEnded(frame.turn_id);
  endContinuing();
  history.endTurn(frame.turn_id);
  if (isStreaming(frame.turn_id)) {
    removeStreaming();
  }
  if (frame.status === "cancelled" && frame.reason !== "dropped" && frame.reason !== "stale") {
    showTurnNote("cancelled", t("answer_stopped"));
  } else if (frame.status === "failed") {
    var message = frame.error && frame.error.message;
    showTurnNote(
      "failed",
      message ? t("answer_failed", { message: message }) : t("answer_failed_generic")
    );
  }
  if (frame.status === "completed" && frame.notice && frame.notice.message) {
    // E5: the answer was cut or withheld; say so (the message itself carries the marker),
    // in the page's language (the server's words are in the language of the turn's worker).
    var key = "notice_" + frame.notice.kind;
    var notice = Object.prototype.hasOwnProperty.call(config.strings || {}, key)
      ? t(key)
      : frame.notice.message;
    showTurnNote("notice", notice, "none");
    announce(notice);
  } else if (frame.status === "completed") {
    announce(t("answer_done"));
  }
  updateRunning();
  refreshContinue();
}

function onSessionUpdated(frame) {
  if (frame.title != null) {
    store.setTitle(frame.session_id, frame.title);
  }
  if (frame.session_id === history.sessionId) {
    if (frame.title != null) {
      history.title = frame.title;
      renderHeader();
    }
    if (frame.compacted_through != null) {
      appendCommandLine("compact", t("compacted"));
    }
  }
  renderSidebar();
}

function onCommandResult(frame) {
  typedAnswered(frame.client_msg_id);
  if (store.takeSilent(frame.client_msg_id)) {
    if (frame.ok === false) {
      toast(frame.content, "error");
    }
    return;
  }
  if (frame.ok === false) {
    toast(frame.content, "error");
    return;
  }
  if (["new", "switch", "delete"].indexOf(frame.command) >= 0) {
    // These replace the transcript; a line in it would vanish at once.
    toast(frame.content, "info");
    return;
  }
  appendCommandLine(frame.command, frame.content);
}

function onError(frame) {
  var id = frame.client_msg_id;
  editRefused(id);
  if (store.takeSilent(id)) {
    toast(frame.message, "error");
    return;
  }
  if (typedRefused(id, frame)) {
    return;
  }
  var pending = store.findPending(id);
  if (pending) {
    store.pendingFailed(pending, frame.message || t("error_generic"));
    renderPending();
    return;
  }
  var older = store.older();
  if (older && id && older.id === id) {
    store.setOlder(null);
    renderOlderIndicator();
  }
  toast(frame.message || t("error_generic"), "error");
}
