/*
 * The web chat's history state (SPEC D2) as a small pure module: no DOM, no network.
 *
 * It holds one dialog's messages (by id, ordered by seq) and its `history_revision`, decides
 * whether a `history_delta` applies, and assembles streaming answers from `turn_snapshot`
 * frames (`known[:text_offset] + text`, offsets in Unicode code points; PROTOCOL.md).
 *
 * The caller (app.js) acts on the verdicts: "gap" means "ask the server for `history` once".
 * Exposed as `window.ChatHistory` (and `module.exports` where there is one) so the page can
 * use it without a build step and tests can drive it through `page.evaluate`.
 */
(function (root, factory) {
  "use strict";
  var api = factory();
  if (typeof module === "object" && module.exports) {
    module.exports = api;
  }
  root.ChatHistory = api;
})(typeof globalThis !== "undefined" ? globalThis : this, function () {
  "use strict";

  /** Number of Unicode code points in a string (what the server's offsets count). */
  function codePointLength(text) {
    var n = 0;
    for (var i = 0; i < text.length; i++) {
      var c = text.charCodeAt(i);
      // A high surrogate followed by a low one is a single code point.
      if (c >= 0xd800 && c <= 0xdbff && i + 1 < text.length) {
        var d = text.charCodeAt(i + 1);
        if (d >= 0xdc00 && d <= 0xdfff) {
          i++;
        }
      }
      n++;
    }
    return n;
  }

  /** The first `count` code points of `text`. */
  function codePointSlice(text, count) {
    if (count <= 0) {
      return "";
    }
    var n = 0;
    for (var i = 0; i < text.length; i++) {
      if (n === count) {
        return text.slice(0, i);
      }
      var c = text.charCodeAt(i);
      if (c >= 0xd800 && c <= 0xdbff && i + 1 < text.length) {
        var d = text.charCodeAt(i + 1);
        if (d >= 0xdc00 && d <= 0xdfff) {
          i++;
        }
      }
      n++;
    }
    return text;
  }

  function bySeq(a, b) {
    return a.seq - b.seq;
  }

  /**
   * One dialog's history as this client knows it.
   * @constructor
   */
  function ChatHistory() {
    this.reset();
  }

  ChatHistory.prototype.reset = function () {
    this.sessionId = null;
    this.dialogId = null;
    this.title = "";
    this.revision = 0;
    this.hasMore = false;
    this.messages = []; // ordered by seq
    this.byId = Object.create(null);
    this.turns = Object.create(null); // turn_id -> {text, length, tools, frame}
  };

  /**
   * Replace the whole state with a `session_history` frame (first load, reconnect, switch,
   * gap). Its `active_turn` (a full snapshot, offset 0) seeds the streaming text.
   * Returns the messages now held.
   */
  ChatHistory.prototype.load = function (frame) {
    this.reset();
    this.sessionId = frame.session_id || null;
    this.dialogId = frame.dialog_id || null;
    this.title = frame.title || "";
    this.revision = Number(frame.history_revision) || 0;
    this.hasMore = Boolean(frame.has_more);
    this._insert(frame.messages || []);
    if (frame.active_turn) {
      this.applySnapshot(frame.active_turn);
    }
    return this.messages.slice();
  };

  /**
   * Merge an older page (a `session_history` answering `history` with `before_seq`).
   * The revision does not change: older messages are not news. Returns the added messages,
   * oldest first.
   */
  ChatHistory.prototype.loadOlder = function (frame) {
    this.hasMore = Boolean(frame.has_more);
    return this._insert(frame.messages || []);
  };

  /**
   * Apply a `history_delta` (D2). Returns
   *   "applied":   its new messages were added (those already held, by id, are skipped);
   *   "duplicate": nothing new (`history_revision` <= revision);
   *   "gap":       messages are missing between our revision and the delta's base: the
   *                caller asks for the history once.
   * A delta whose base is below our revision but whose revision is above it overlaps what a
   * fresh `session_history` already brought; its unseen messages are news, so it applies.
   */
  ChatHistory.prototype.applyDelta = function (delta) {
    var base = Number(delta.base_revision);
    var next = Number(delta.history_revision);
    if (next <= this.revision) {
      return "duplicate";
    }
    if (base > this.revision) {
      return "gap";
    }
    this._insert(delta.messages || []);
    this.revision = next;
    return "applied";
  };

  /**
   * Apply the `history_delta` a reconnect is answered with when this client said what it
   * holds (PROTOCOL "On connect"; it carries `active_turn`): what came after our revision,
   * often nothing, and the running turn. Returns
   *   "applied": its messages were added (`lastAdded`), the revision, title and the running
   *              turn's text replaced by the server's;
   *   "gap":     it is not about this dialog at our revision: the caller asks for the history.
   */
  ChatHistory.prototype.resume = function (delta) {
    if (delta.session_id !== this.sessionId || Number(delta.base_revision) !== this.revision) {
      return "gap";
    }
    this._insert(delta.messages || []);
    this.revision = Number(delta.history_revision) || this.revision;
    if (typeof delta.title === "string") {
      this.title = delta.title;
    }
    this.turns = Object.create(null);
    if (delta.active_turn) {
      this.applySnapshot(delta.active_turn);
    }
    return "applied";
  };

  /** Whether a frame is a reconnect's resume (`resume`), not a turn's delta. */
  ChatHistory.isResume = function (frame) {
    return frame.type === "history_delta" && Object.prototype.hasOwnProperty.call(frame, "active_turn");
  };

  /** Messages of the last `applyDelta`/`load`/`resume` that were new (set by `_insert`). */
  ChatHistory.prototype.lastAdded = function () {
    return this._lastAdded ? this._lastAdded.slice() : [];
  };

  ChatHistory.prototype._insert = function (messages) {
    var added = [];
    for (var i = 0; i < messages.length; i++) {
      var m = messages[i];
      if (!m || m.id == null || this.byId[m.id]) {
        continue;
      }
      this.byId[m.id] = m;
      added.push(m);
    }
    if (added.length) {
      var last = this.messages.length ? this.messages[this.messages.length - 1].seq : -Infinity;
      added.sort(bySeq);
      if (added[0].seq > last) {
        this.messages = this.messages.concat(added); // the usual case: news at the end
      } else {
        this.messages = this.messages.concat(added).sort(bySeq);
      }
    }
    this._lastAdded = added;
    return added;
  };

  ChatHistory.prototype.has = function (id) {
    return Boolean(this.byId[id]);
  };

  ChatHistory.prototype.get = function (id) {
    return this.byId[id] || null;
  };

  ChatHistory.prototype.list = function () {
    return this.messages.slice();
  };

  ChatHistory.prototype.oldestSeq = function () {
    return this.messages.length ? this.messages[0].seq : null;
  };

  ChatHistory.prototype.newest = function () {
    return this.messages.length ? this.messages[this.messages.length - 1] : null;
  };

  /**
   * Assemble a streaming answer from a `turn_snapshot` (latest wins). Returns
   *   {status: "applied", text, tools, turnId}: the full answer so far;
   *   {status: "gap"}:   the frame starts beyond the text we have (we missed a frame or
   *                      joined mid-turn): ask for the history, whose `active_turn` is full;
   *   {status: "stale"}: an older frame than one already applied.
   */
  ChatHistory.prototype.applySnapshot = function (frame) {
    var turnId = frame.turn_id;
    var offset = Number(frame.text_offset) || 0;
    var tail = frame.text || "";
    var state = this.turns[turnId];
    if (!state) {
      state = { text: "", length: 0, tools: [], frame: -1 };
    }
    var number = typeof frame.frame === "number" ? frame.frame : null;
    if (number !== null && number < state.frame) {
      return { status: "stale", turnId: turnId };
    }
    if (offset > state.length) {
      return { status: "gap", turnId: turnId };
    }
    var text = offset === state.length ? state.text + tail : codePointSlice(state.text, offset) + tail;
    state.text = text;
    state.length = offset + codePointLength(tail);
    state.tools = Array.isArray(frame.tools) ? frame.tools.slice() : state.tools;
    if (number !== null) {
      state.frame = Math.max(state.frame, number);
    }
    this.turns[turnId] = state;
    return { status: "applied", text: text, tools: state.tools.slice(), turnId: turnId };
  };

  /** The streaming text known for a turn ("" when none). */
  ChatHistory.prototype.turnText = function (turnId) {
    var state = this.turns[turnId];
    return state ? state.text : "";
  };

  /** Forget a turn's streaming state once it ended (its messages arrive as a delta). */
  ChatHistory.prototype.endTurn = function (turnId) {
    delete this.turns[turnId];
  };

  ChatHistory.codePointLength = codePointLength;
  ChatHistory.codePointSlice = codePointSlice;
  return ChatHistory;
});
