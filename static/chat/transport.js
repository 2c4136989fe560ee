/*
 * The one WebSocket (PROTOCOL.md "WebSocket: /ws/chat/"): connect, reconnect with
 * exponential backoff and jitter, and send frames aimed at a dialog. On reopen the page says
 * what it holds (the dialog, its revision and newest message, the list's etag: "On
 * connect"), so the server sends only what changed (`sessions` `unchanged`, a resume
 * `history_delta`) or, when it cannot, `sessions` + `session_history` that replace the
 * state (resync); this module only hands frames to the `onFrame` given to `start` and
 * reports the connection's status.
 */
import { backoffDelay, isLinked } from "./format.js";
import { history, store } from "./state.js";
import { config, randomId, t, toast } from "./ui.js";

var socket = null;
var attempt = 0;
var reconnectTimer = null;
var countdownTimer = null;
var reconnectAt = 0;
var hooks = { onFrame: null, onStatus: null, onCountdown: null, onLost: null };

/** Open the socket. `handlers`: onFrame(frame), onStatus("connecting" | "online" |
 * "reconnecting"), onCountdown(seconds until the next try), onLost() when it closes. */
export function start(handlers) {
  hooks = handlers;
  connect();
}

function setStatus(status) {
  if (status !== "reconnecting") {
    clearInterval(countdownTimer);
  }
  hooks.onStatus(status);
}

function socketUrl() {
  var scheme = location.protocol === "https:" ? "wss://" : "ws://";
  var url = scheme + location.host + config.ws_path;
  var params = [];
  // Reopen on the dialog the reader was on (the server falls back to B1 if it is gone).
  var held = isLinked(history.sessionId) ? null : history.dialogId;
  var dialog = store.wantedDialog() || held;
  if (dialog) {
    params.push("dialog_id=" + encodeURIComponent(dialog));
  }
  if (dialog && dialog === held && store.loadedOnce()) {
    // What this page shows of it: the server sends only what came after.
    params.push("since=" + history.revision);
    var newest = history.newest();
    if (newest) {
      params.push("last_id=" + encodeURIComponent(newest.id));
    }
  }
  if (store.sessionsEtag()) {
    params.push("sessions_etag=" + encodeURIComponent(store.sessionsEtag()));
  }
  return params.length ? url + "?" + params.join("&") : url;
}

function connect() {
  clearTimeout(reconnectTimer);
  clearInterval(countdownTimer);
  reconnectTimer = null;
  setStatus(attempt > 0 ? "reconnecting" : "connecting");
  var ws;
  try {
    ws = new WebSocket(socketUrl());
  } catch (_err) {
    scheduleReconnect();
    return;
  }
  socket = ws;
  ws.onopen = function () {
    if (socket !== ws) {
      return;
    }
    setStatus("online");
  };
  ws.onmessage = function (event) {
    if (socket !== ws) {
      return;
    }
    var frame;
    try {
      frame = JSON.parse(event.data);
    } catch (_err) {
      return;
    }
    attempt = 0; // a working connection resets the backoff
    hooks.onFrame(frame);
  };
  ws.onclose = function (event) {
    if (socket !== ws) {
      return;
    }
    socket = null;
    if (event.code === 4401) {
      // Signed out (or the session expired): go to the login page, then come back.
      location.assign(config.login_url + "?next=" + encodeURIComponent(location.pathname));
      return;
    }
    hooks.onLost();
    scheduleReconnect();
  };
}

function countdown() {
  hooks.onCountdown(Math.max(0, Math.ceil((reconnectAt - Date.now()) / 1000)));
}

function scheduleReconnect() {
  var delay = backoffDelay(attempt, Math.random());
  attempt += 1;
  reconnectAt = Date.now() + delay;
  setStatus("reconnecting");
  countdown();
  countdownTimer = setInterval(countdown, 1000);
  reconnectTimer = setTimeout(connect, delay);
}

/** Try now instead of waiting for the backoff (a no-op while a socket exists). */
export function reconnectNow() {
  if (socket) {
    return;
  }
  connect();
}

export function hasSocket() {
  return socket !== null;
}

export function isOpen() {
  return socket !== null && socket.readyState === WebSocket.OPEN;
}

export function send(frame) {
  if (!isOpen()) {
    return false;
  }
  socket.send(JSON.stringify(frame));
  return true;
}

/** Name the dialog a frame is about (default: the open one): a linked chat-app dialog by
 * its session id, a dialog of the web chat by its dialog id. */
export function aim(frame, item) {
  var sessionId = item ? item.session_id : history.sessionId;
  var dialogId = item ? item.dialog_id : history.dialogId;
  if (isLinked(sessionId)) {
    frame.session_id = sessionId;
  } else if (dialogId) {
    frame.dialog_id = dialogId;
  }
  return frame;
}

/** A slash command; `silent` ones come from the UI and show only their errors. A
 * `target` ({session_id, dialog_id}) aims it at that dialog instead of the current one
 * (/rename, /delete). */
export function sendCommand(text, silent, target) {
  var id = randomId();
  if (silent) {
    store.markSilent(id, text.split(" ")[0]);
  }
  var frame = { type: "send", content: text, client_msg_id: id };
  if (target) {
    aim(frame, target);
  }
  if (!send(frame)) {
    store.takeSilent(id);
    toast(t("offline_cannot_send"), "error");
    return null;
  }
  return id;
}

/** Ask for the open dialog's history once (gap, missed snapshot). */
export function askHistory() {
  if (!store.mayAskHistory(Date.now())) {
    return;
  }
  if (send(aim({ type: "history" }))) {
    store.historyAsked(Date.now());
  }
}
