/*
 * The client's state (SPEC E1, D2): what this page knows besides the open dialog's history
 * (history.js). No DOM and no network: the other modules read and change it only through
 * the store's methods, so every change has a name.
 *
 * `createStore(history)` makes a fresh store (the tests make their own); the page uses the
 * one `store` below with its one `history`.
 */
import { isLinked } from "./format.js";

export function createStore(history) {
  var sessions = []; // items of the last `sessions` frame, most recent first
  var sessionsEtag = null; // the `etag` of the last `sessions` frame (sent back on reconnect)
  var unread = Object.create(null); // session_id -> true
  var inflight = Object.create(null); // turn_id -> true (open dialog: running or queued)
  var continuing = Object.create(null); // turn_id -> true for a `continue` this page asked for
  var pending = []; // optimistic user messages: {id, sessionId, content, turnId, position, error, unconfirmed}
  var silent = Object.create(null); // client_msg_id of commands sent by the UI itself
  var answers = Object.create(null); // message id -> {node, text} of a shown answer
  var streaming = null; // {turnId, el, body, toolsBox, text, tools, scheduled}
  var older = null; // {id, beforeSeq} while an older page is requested
  var historyAskedAt = null; // when a `history` was asked for a gap (ask once)
  var stopping = false;
  var want = { dialog: null, session: null }; // dialog to restore (reconnect, address)
  var loadedOnce = false;
  var menuFor = null; // {item, anchor} of the open dialog menu

  function findPending(clientMsgId) {
    if (!clientMsgId) {
      return null;
    }
    for (var i = 0; i < pending.length; i++) {
      if (pending[i].id === clientMsgId) {
        return pending[i];
      }
    }
    return null;
  }

  function findPendingByTurn(turnId) {
    if (!turnId) {
      return null;
    }
    for (var i = 0; i < pending.length; i++) {
      if (pending[i].turnId === turnId) {
        return pending[i];
      }
    }
    return null;
  }

  function findSession(sessionId) {
    for (var i = 0; i < sessions.length; i++) {
      if (sessions[i].session_id === sessionId) {
        return sessions[i];
      }
    }
    return null;
  }

  return {
    history: history,

    // --- the dialog list ------------------------------------------------------------------
    setSessions: function (items) {
      sessions = Array.isArray(items) ? items.slice() : [];
    },
    sessions: function () {
      return sessions;
    },
    /** The list as the last `sessions` frame with items said it, by its `etag`. */
    setSessionsEtag: function (etag) {
      sessionsEtag = etag || null;
    },
    sessionsEtag: function () {
      return sessionsEtag;
    },
    findSession: findSession,
    /** A dialog of the web chat by its dialog id (linked chat-app dialogs excluded). */
    findDialog: function (dialogId) {
      for (var i = 0; i < sessions.length; i++) {
        if (sessions[i].dialog_id === dialogId && !isLinked(sessions[i].session_id)) {
          return sessions[i];
        }
      }
      return null;
    },
    setTitle: function (sessionId, title) {
      var item = findSession(sessionId);
      if (item) {
        item.title = title;
      }
    },
    /** Move a dialog to the top of the list with its newest activity time. */
    touchSession: function (sessionId, messages, nowIso) {
      var item = findSession(sessionId);
      if (!item) {
        return;
      }
      var latest = item.last_active_at;
      (messages || []).forEach(function (m) {
        if (m.created_at && (!latest || Date.parse(m.created_at) > Date.parse(latest))) {
          latest = m.created_at;
        }
      });
      item.last_active_at = latest || nowIso || new Date().toISOString();
      sessions.sort(function (a, b) {
        return Date.parse(b.last_active_at) - Date.parse(a.last_active_at);
      });
    },
    /** The open dialog is a read-only linked chat-app dialog. */
    isReadOnly: function () {
      var item = findSession(history.sessionId);
      return Boolean(item && item.read_only);
    },

    markUnread: function (sessionId) {
      unread[sessionId] = true;
    },
    markRead: function (sessionId) {
      delete unread[sessionId];
    },
    /** Unread, and not the open dialog. */
    isUnread: function (sessionId) {
      return Boolean(unread[sessionId]) && sessionId !== history.sessionId;
    },
    anyUnread: function () {
      return sessions.some(function (item) {
        return unread[item.session_id] && item.session_id !== history.sessionId;
      });
    },

    // --- turns of the open dialog ---------------------------------------------------------
    resetTurns: function () {
      inflight = Object.create(null);
      stopping = false;
    },
    turnStarted: function (turnId) {
      inflight[turnId] = true;
    },
    turnEnded: function (turnId) {
      delete inflight[turnId];
      delete continuing[turnId];
      if (!Object.keys(inflight).length) {
        stopping = false;
      }
    },
    /** The turn is queued or running in the open dialog. */
    isTurnLive: function (turnId) {
      return Boolean(inflight[turnId]);
    },
    anyTurn: function () {
      return Object.keys(inflight).length > 0;
    },
    isRunning: function () {
      return Object.keys(inflight).length > 0 || Boolean(streaming);
    },
    markContinuing: function (turnId) {
      continuing[turnId] = true;
    },
    isContinuing: function (turnId) {
      return Boolean(continuing[turnId]);
    },
    streaming: function () {
      return streaming;
    },
    setStreaming: function (value) {
      streaming = value;
    },
    isStopping: function () {
      return stopping;
    },
    setStopping: function (value) {
      stopping = value;
    },

    // --- answers shown (a continuation joins the answer it goes on with) ------------------
    resetAnswers: function () {
      answers = Object.create(null);
    },
    answer: function (messageId) {
      return answers[messageId] || null;
    },
    setAnswer: function (messageId, entry) {
      answers[messageId] = entry;
    },

    // --- optimistic user messages ---------------------------------------------------------
    pending: function () {
      return pending;
    },
    addPending: function (entry) {
      pending.push(entry);
    },
    findPending: findPending,
    findPendingByTurn: findPendingByTurn,
    removePending: function (entry) {
      pending = pending.filter(function (p) {
        return p !== entry;
      });
    },
    /** The server queued a pending message as `frame.turn_id` at `frame.position`. */
    pendingQueued: function (entry, frame) {
      entry.turnId = frame.turn_id;
      entry.position = frame.position;
      entry.unconfirmed = false;
      entry.sessionId = frame.session_id || entry.sessionId;
    },
    /** The server refused a pending message (it shows why, with Edit and Dismiss). */
    pendingFailed: function (entry, message) {
      entry.error = message;
    },
    /** The server may never confirm what it did not ack: mark those after a lost socket. */
    markUnconfirmed: function () {
      pending.forEach(function (p) {
        if (!p.turnId && !p.error) {
          p.unconfirmed = true;
        }
      });
    },
    /** After a full history load: keep what is still queued, drop what already ran. */
    reconcilePending: function (frame) {
      var queue = Array.isArray(frame.queue) ? frame.queue : [];
      var inHistory = Object.create(null);
      history.list().forEach(function (m) {
        var src = m.source || {};
        if (src.client_msg_id) {
          inHistory[src.client_msg_id] = true;
        }
        if (m.role === "user" && m.turn_id) {
          inHistory["turn:" + m.turn_id] = true;
        }
      });
      pending = pending.filter(function (p) {
        if (p.sessionId && p.sessionId !== frame.session_id) {
          return !p.turnId && !p.unconfirmed; // belongs to another dialog; drop when settled
        }
        if (inHistory[p.id] || (p.turnId && inHistory["turn:" + p.turnId])) {
          return false;
        }
        if (p.turnId) {
          return queue.some(function (q) {
            return q.turn_id === p.turnId;
          });
        }
        return true;
      });
      queue.forEach(function (q, index) {
        inflight[q.turn_id] = true;
        // H1: an edit shows in place, a regenerate under its message; neither is a new bubble.
        var inPlace = q.mode === "edit" || q.mode === "regenerate";
        if (q.mode === "retry" || q.mode === "continue" || q.mode === "inject" || inPlace) {
          return;
        }
        var p = findPending(q.client_msg_id) || findPendingByTurn(q.turn_id);
        if (!p) {
          p = { id: q.client_msg_id || "queue:" + q.turn_id, content: q.preview || "" };
          pending.push(p);
        }
        p.sessionId = frame.session_id;
        p.turnId = q.turn_id;
        p.position = index + (frame.active_turn ? 1 : 0);
        p.unconfirmed = false;
      });
    },

    // --- commands the UI sent itself (their answers stay silent) --------------------------
    markSilent: function (clientMsgId, command) {
      silent[clientMsgId] = command;
    },
    /** Whether `clientMsgId` was a silent command; it is forgotten either way. */
    takeSilent: function (clientMsgId) {
      if (clientMsgId && silent[clientMsgId]) {
        delete silent[clientMsgId];
        return true;
      }
      return false;
    },

    // --- requests on their way ------------------------------------------------------------
    older: function () {
      return older;
    },
    setOlder: function (value) {
      older = value;
    },
    /** A `history` for a gap is asked once (again only after 10 s without an answer). */
    mayAskHistory: function (now) {
      return historyAskedAt === null || now - historyAskedAt >= 10000;
    },
    historyAsked: function (now) {
      historyAskedAt = now;
    },
    historyArrived: function () {
      historyAskedAt = null;
    },

    // --- where to go back to --------------------------------------------------------------
    /** Remember the dialog to restore (a dialog id, or a linked chat-app session id). */
    wantBack: function (dialogId, sessionId) {
      if (sessionId) {
        want.session = sessionId;
      } else if (dialogId) {
        want.dialog = dialogId;
      }
    },
    wantedDialog: function () {
      return want.dialog;
    },
    /** The dialog to restore, forgotten once taken: {dialog, session}. */
    takeWanted: function () {
      var taken = want;
      want = { dialog: null, session: null };
      return taken;
    },
    loadedOnce: function () {
      return loadedOnce;
    },
    markLoaded: function () {
      loadedOnce = true;
    },
    menuFor: function () {
      return menuFor;
    },
    setMenuFor: function (value) {
      menuFor = value;
    },
  };
}

export var history = new window.ChatHistory();
export var store = createStore(history);
