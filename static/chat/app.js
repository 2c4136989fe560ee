/*
 * The web chat (SPEC E1): one page, one WebSocket (PROTOCOL.md "WebSocket: /ws/chat/").
 *
 * - The server owns all state; this page mirrors it: `sessions` feeds the sidebar,
 *   `session_history` replaces the transcript, `history_delta` appends to it through
 *   ChatHistory (history.js, D2), `turn_snapshot` streams the running answer (D1).
 * - Model output is untrusted: markdown goes through marked, then DOMPurify with a strict
 *   allow-list, and lands in the DOM as a sanitised fragment. User text is plain text.
 * - Sidebar actions are slash commands on the socket (/new, /switch, /rename, /delete).
 * - Chat-app dialogs linked to this user (Telegram, Feishu) are listed under their platform
 *   and named by `session_id`; opening one is a `history` frame with `follow`. A read-only
 *   one shows its transcript and live answers with the composer disabled.
 * - The socket reconnects with exponential backoff and jitter; the server's `sessions` +
 *   `session_history` on reopen replace the state (resync). A normal turn never reloads it.
 */
(function () {
  "use strict";

  var config = JSON.parse(document.getElementById("chat-config").textContent);
  var STRINGS = config.strings || {};
  var LANG = config.language || document.documentElement.lang || "en";
  var CONTENT_LIMIT = config.content_limit || 65536;
  var OLDER_PAGE = 50;
  var NEAR_BOTTOM_PX = 80;
  var NEAR_TOP_PX = 160;

  /** A translated string; `%(name)s` placeholders are filled from `params`. */
  function t(key, params) {
    var text = Object.prototype.hasOwnProperty.call(STRINGS, key) ? STRINGS[key] : key;
    if (params) {
      text = text.replace(/%\((\w+)\)s/g, function (_m, name) {
        return params[name] == null ? "" : String(params[name]);
      });
    }
    return text;
  }

  function $(id) {
    return document.getElementById(id);
  }

  function el(tag, className, text) {
    var node = document.createElement(tag);
    if (className) {
      node.className = className;
    }
    if (text != null) {
      node.textContent = text;
    }
    return node;
  }

  function randomId() {
    if (window.crypto && crypto.randomUUID) {
      return crypto.randomUUID();
    }
    var bytes = new Uint8Array(16);
    crypto.getRandomValues(bytes);
    return Array.prototype.map
      .call(bytes, function (b) {
        return ("0" + b.toString(16)).slice(-2);
      })
      .join("");
  }

  var ICONS = {
    check: "M5 12.5l4.5 4.5L19 7.5",
    cross: "M7 7l10 10M17 7L7 17",
    copy: "M9 9h10v10H9zM5 15V5h10",
    retry: "M4 12a8 8 0 1 0 2.3-5.6M4 4v4h4",
    more: "M6 12h.01M12 12h.01M18 12h.01",
    tool: "M14.7 6.3a4 4 0 0 0-5.4 5.2L4 16.8 7.2 20l5.3-5.3a4 4 0 0 0 5.2-5.4l-2.5 2.5-2.5-.6-.6-2.5z",
    alert: "M12 8v5M12 16.5h.01M10.3 4.2 2.8 17.5A2 2 0 0 0 4.5 20.5h15a2 2 0 0 0 1.7-3L13.7 4.2a2 2 0 0 0-3.4 0z",
    stop: "M7 7h10v10H7z",
    next: "M5 12h12M13 6l6 6-6 6",
  };

  function icon(name) {
    var svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("viewBox", "0 0 24 24");
    svg.setAttribute("aria-hidden", "true");
    svg.setAttribute("class", "ico");
    var path = document.createElementNS("http://www.w3.org/2000/svg", "path");
    path.setAttribute("d", ICONS[name]);
    svg.appendChild(path);
    return svg;
  }

  // --- Safe markdown ------------------------------------------------------------------------

  function escapeHtml(text) {
    return String(text)
      .replace(/&/g, "&amp;")
      .replace(/</g, "&lt;")
      .replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;")
      .replace(/'/g, "&#39;");
  }

  var markdown = new window.marked.Marked({ gfm: true, breaks: true, async: false });
  markdown.use({
    renderer: {
      // Raw HTML in model output is shown as the text it is (a bare <br> excepted), so the
      // reader sees what the model wrote; DOMPurify below is the safety net either way.
      html: function (token) {
        var raw = token.text || token.raw || "";
        if (/^\s*<br\s*\/?>\s*$/i.test(raw)) {
          return "<br>";
        }
        return token.block ? "<p>" + escapeHtml(raw) + "</p>" : escapeHtml(raw);
      },
      // No remote images: an untrusted answer must not make the browser fetch URLs (tracking,
      // data leaks through query strings). The image becomes a link the reader may follow.
      image: function (token) {
        var label = t("image", { label: token.text || token.href || "" });
        return '<a href="' + escapeHtml(token.href || "") + '">' + escapeHtml(label) + "</a>";
      },
    },
  });

  var purifier = window.DOMPurify(window);
  var PURIFY_CONFIG = {
    ALLOWED_TAGS: [
      "a", "p", "br", "hr", "strong", "b", "em", "i", "del", "s", "code", "pre", "blockquote",
      "ul", "ol", "li", "h1", "h2", "h3", "h4", "h5", "h6", "table", "thead", "tbody", "tfoot",
      "tr", "th", "td", "sup", "sub", "kbd", "span", "input",
    ],
    ALLOWED_ATTR: ["href", "title", "align", "start", "colspan", "rowspan", "class", "type",
      "checked", "disabled"],
    ALLOWED_URI_REGEXP: /^(?:https?:|mailto:)/i,
    ALLOW_DATA_ATTR: false,
    ALLOW_ARIA_ATTR: false,
    RETURN_DOM_FRAGMENT: true,
  };
  purifier.addHook("uponSanitizeAttribute", function (node, data) {
    // Classes only as the language marker of code blocks (never our own UI classes).
    if (data.attrName === "class") {
      data.keepAttr = node.nodeName === "CODE" && /^language-[\w+#.-]{1,40}$/.test(data.attrValue);
    }
  });
  purifier.addHook("afterSanitizeAttributes", function (node) {
    if (node.nodeName === "A" && node.hasAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
    if (node.nodeName === "INPUT") {
      // Only GFM task-list boxes survive, and they cannot be ticked.
      if (node.getAttribute("type") !== "checkbox") {
        node.remove();
      } else {
        node.setAttribute("disabled", "");
      }
    }
  });

  /** Sanitised DOM fragment for untrusted markdown. */
  function markdownFragment(text) {
    var html = markdown.parse(text || "");
    return purifier.sanitize(html, PURIFY_CONFIG);
  }

  /**
   * While an answer streams, close what its tail left open (a code fence, `**`, `~~`, a
   * backtick) so half-written markup does not flash as raw asterisks; the final text is
   * rendered as it is.
   */
  function closeOpenMarkdown(text) {
    var fences = text.match(/^ {0,3}(```|~~~)/gm);
    if (fences && fences.length % 2 === 1) {
      return text + "\n" + fences[fences.length - 1].trim();
    }
    var tail = text.slice(text.lastIndexOf("\n\n") + 1);
    var suffix = "";
    var ticks = (tail.match(/`/g) || []).length;
    if (ticks % 2 === 1) {
      return text + "`"; // inside inline code the rest is literal
    }
    var plain = tail.replace(/`[^`]*`/g, "");
    if (((plain.match(/\*\*/g) || []).length) % 2 === 1) {
      suffix += /[^*]\*$/.test(plain) ? "*" : "**"; // "**bold*" is half-way through closing
    }
    if (((plain.match(/~~/g) || []).length) % 2 === 1) {
      suffix += "~~";
    }
    return text + suffix;
  }

  function renderMarkdownInto(container, text, streaming) {
    container.replaceChildren(markdownFragment(streaming ? closeOpenMarkdown(text) : text));
    container.querySelectorAll("table").forEach(function (table) {
      var wrap = el("div", "table-wrap");
      table.parentNode.insertBefore(wrap, table);
      wrap.appendChild(table);
    });
    if (!streaming) {
      container.querySelectorAll("pre").forEach(decorateCodeBlock);
    }
  }

  function decorateCodeBlock(pre) {
    var code = pre.querySelector("code");
    var lang = "";
    if (code) {
      var match = /language-([\w+#.-]+)/.exec(code.className);
      lang = match ? match[1] : "";
    }
    var wrap = el("div", "code-block");
    var head = el("div", "code-head");
    head.appendChild(el("span", "code-lang", lang));
    var copy = el("button", "code-copy");
    copy.type = "button";
    copy.setAttribute("aria-label", t("copy_code"));
    copy.appendChild(icon("copy"));
    copy.appendChild(el("span", null, t("copy")));
    copy.addEventListener("click", function () {
      copyText((code || pre).textContent, copy);
    });
    head.appendChild(copy);
    pre.parentNode.insertBefore(wrap, pre);
    wrap.appendChild(head);
    wrap.appendChild(pre);
  }

  function copyText(text, button) {
    var done = function () {
      var label = button.querySelector("span");
      if (!label) {
        return;
      }
      var before = label.textContent;
      label.textContent = t("copied");
      button.classList.add("copied");
      setTimeout(function () {
        label.textContent = before;
        button.classList.remove("copied");
      }, 1500);
    };
    if (navigator.clipboard && navigator.clipboard.writeText) {
      navigator.clipboard.writeText(text).then(done, function () {});
    }
  }

  /** Put the blinking caret after the last text of a rendered answer. */
  function appendCaret(root) {
    var node = root;
    for (;;) {
      var last = node.lastChild;
      while (last && last.nodeType === 3 && !last.textContent.trim()) {
        last = last.previousSibling;
      }
      if (!last || last.nodeType !== 1 || /^(BR|HR|INPUT|TABLE)$/.test(last.nodeName)) {
        break;
      }
      if (last.classList.contains("table-wrap")) {
        break;
      }
      node = last;
    }
    node.appendChild(el("span", "caret"));
  }

  // --- Time ---------------------------------------------------------------------------------

  var relFormat = window.Intl && Intl.RelativeTimeFormat
    ? new Intl.RelativeTimeFormat(LANG, { numeric: "auto", style: "short" })
    : null;

  function relativeTime(iso) {
    var then = Date.parse(iso);
    if (isNaN(then)) {
      return "";
    }
    var seconds = Math.round((Date.now() - then) / 1000);
    if (seconds < 45) {
      return t("just_now");
    }
    if (!relFormat) {
      return new Date(then).toLocaleString(LANG);
    }
    var minutes = Math.round(seconds / 60);
    if (minutes < 60) {
      return relFormat.format(-minutes, "minute");
    }
    var hours = Math.round(minutes / 60);
    if (hours < 24) {
      return relFormat.format(-hours, "hour");
    }
    var days = Math.round(hours / 24);
    if (days < 7) {
      return relFormat.format(-days, "day");
    }
    return new Date(then).toLocaleDateString(LANG, { month: "short", day: "numeric" });
  }

  function dayGroup(iso) {
    var then = new Date(Date.parse(iso));
    var now = new Date();
    var startToday = new Date(now.getFullYear(), now.getMonth(), now.getDate()).getTime();
    var time = then.getTime();
    if (isNaN(time) || time >= startToday) {
      return "today";
    }
    if (time >= startToday - 86400000) {
      return "yesterday";
    }
    if (time >= startToday - 7 * 86400000) {
      return "previous_7_days";
    }
    return "older";
  }

  function fullTime(iso) {
    var then = Date.parse(iso);
    return isNaN(then) ? "" : new Date(then).toLocaleString(LANG);
  }

  // --- State --------------------------------------------------------------------------------

  var history = new window.ChatHistory();
  var state = {
    sessions: [], // items of the last `sessions` frame, most recent first
    serverCurrent: null, // dialog id the server says is current
    unread: Object.create(null), // session_id -> true
    inflight: Object.create(null), // turn_id -> true (current dialog: running or queued)
    streaming: null, // {turnId, el, body, tools, text, scheduled}
    pending: [], // optimistic user messages: {id, sessionId, content, turnId, position, error, el}
    silent: Object.create(null), // client_msg_id of commands sent by the UI itself
    older: null, // {id, beforeSeq} while an older page is requested
    historyAsked: false, // a `history` is on its way (gap): ask once
    historyAskedAt: 0,
    stopping: false,
    wantDialog: null, // dialog to restore after a reconnect or from the URL
    wantSession: null, // linked chat-app dialog (session id) to restore the same way
    loadedOnce: false,
    menuFor: null,
    answers: Object.create(null), // message id -> {node, text} of a shown answer (continuations join it)
    continuing: Object.create(null), // turn_id -> true for a `continue` this page asked for
  };

  // --- Socket -------------------------------------------------------------------------------

  var socket = null;
  var attempt = 0;
  var reconnectTimer = null;
  var countdownTimer = null;
  var reconnectAt = 0;

  function socketUrl() {
    var scheme = location.protocol === "https:" ? "wss://" : "ws://";
    var url = scheme + location.host + config.ws_path;
    // Reopen on the dialog the reader was on (the server falls back to B1 if it is gone).
    var dialog = state.wantDialog || (isLinked(history.sessionId) ? null : history.dialogId);
    if (dialog) {
      url += "?dialog_id=" + encodeURIComponent(dialog);
    }
    return url;
  }

  function connect() {
    clearTimeout(reconnectTimer);
    clearInterval(countdownTimer);
    reconnectTimer = null;
    setConnection(attempt > 0 ? "reconnecting" : "connecting");
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
      setConnection("online");
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
      handleFrame(frame);
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
      connectionLost();
      scheduleReconnect();
    };
  }

  function scheduleReconnect() {
    // 1 s, 2 s, 4 s … at most 30 s, each with ±25 % jitter so tabs do not stampede.
    var base = Math.min(30000, 1000 * Math.pow(2, attempt));
    var delay = Math.min(30000, Math.round(base * (0.75 + Math.random() * 0.5)));
    attempt += 1;
    reconnectAt = Date.now() + delay;
    setConnection("reconnecting");
    updateCountdown();
    countdownTimer = setInterval(updateCountdown, 1000);
    reconnectTimer = setTimeout(connect, delay);
  }

  function reconnectNow() {
    if (socket) {
      return;
    }
    connect();
  }

  function isOpen() {
    return socket !== null && socket.readyState === WebSocket.OPEN;
  }

  function send(frame) {
    if (!isOpen()) {
      return false;
    }
    socket.send(JSON.stringify(frame));
    return true;
  }

  /** Whether a session id is a chat-app dialog linked to this user (not the web chat's). */
  function isLinked(sessionId) {
    return Boolean(sessionId) && String(sessionId).split(":")[0] !== "web";
  }

  /** Name the dialog a frame is about (default: the open one): a linked chat-app dialog by
   * its session id, a dialog of the web chat by its dialog id. */
  function aim(frame, item) {
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
  function sendCommand(text, silent, target) {
    var id = randomId();
    if (silent) {
      state.silent[id] = text.split(" ")[0];
    }
    var frame = { type: "send", content: text, client_msg_id: id };
    if (target) {
      aim(frame, target);
    }
    if (!send(frame)) {
      delete state.silent[id];
      toast(t("offline_cannot_send"), "error");
      return null;
    }
    return id;
  }

  /** Ask for the current dialog's history once (gap, missed snapshot). */
  function askHistory() {
    if (state.historyAsked && Date.now() - state.historyAskedAt < 10000) {
      return;
    }
    var frame = aim({ type: "history" });
    if (send(frame)) {
      state.historyAsked = true;
      state.historyAskedAt = Date.now();
    }
  }

  function connectionLost() {
    // The server may never confirm what it did not ack; say so on those bubbles.
    state.pending.forEach(function (p) {
      if (!p.turnId && !p.error) {
        p.unconfirmed = true;
      }
    });
    state.older = null;
    state.historyAsked = false;
    state.stopping = false;
    if (isLinked(history.sessionId)) {
      state.wantSession = history.sessionId;
    } else if (history.dialogId) {
      state.wantDialog = history.dialogId;
    }
    renderPending();
    updateRunning();
  }

  // --- Frames -------------------------------------------------------------------------------

  function handleFrame(frame) {
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
  }

  function onSessions(frame) {
    state.sessions = Array.isArray(frame.items) ? frame.items.slice() : [];
    state.serverCurrent = frame.current || null;
    renderSidebar();
    updateReadOnly();
  }

  function findSession(sessionId) {
    for (var i = 0; i < state.sessions.length; i++) {
      if (state.sessions[i].session_id === sessionId) {
        return state.sessions[i];
      }
    }
    return null;
  }

  function findDialog(dialogId) {
    for (var i = 0; i < state.sessions.length; i++) {
      if (state.sessions[i].dialog_id === dialogId && !isLinked(state.sessions[i].session_id)) {
        return state.sessions[i];
      }
    }
    return null;
  }

  function onSessionHistory(frame) {
    var older = state.older;
    if (older && frame.session_id === history.sessionId && isOlderPage(frame, older)) {
      state.older = null;
      prependOlder(frame);
      return;
    }
    state.older = null;
    state.historyAsked = false;
    var switched = frame.session_id !== history.sessionId;
    history.load(frame);
    state.loadedOnce = true;
    delete state.unread[frame.session_id];
    state.inflight = Object.create(null);
    state.stopping = false;
    if (frame.active_turn) {
      state.inflight[frame.active_turn.turn_id] = true;
    }
    reconcilePending(frame);
    renderTranscript();
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
    scrollToBottom();
    maybeLoadOlder();
    if (switched) {
      closeSidebar();
      var active = document.activeElement;
      var typing = active && /^(INPUT|TEXTAREA)$/.test(active.nodeName) && active.id !== "composer-input";
      if (!typing && !window.matchMedia("(pointer: coarse)").matches) {
        $("composer-input").focus({ preventScroll: true }); // ready to type in the new dialog
      }
    }
    // Restore the dialog the reader was on (after a reconnect, or from the address).
    var want = state.wantDialog;
    state.wantDialog = null;
    var wantSession = state.wantSession;
    state.wantSession = null;
    if (wantSession && wantSession !== frame.session_id && findSession(wantSession)) {
      openLinked(findSession(wantSession));
    } else if (want && want !== frame.dialog_id && findDialog(want)) {
      sendCommand("/switch " + want, true);
    }
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
    var pending = findPending(frame.client_msg_id);
    if (frame.session_id === history.sessionId && frame.turn_id && frame.mode !== "inject") {
      state.inflight[frame.turn_id] = true;
      clearTurnNote();
    }
    if (frame.mode === "continue" && frame.turn_id) {
      state.continuing[frame.turn_id] = true;
    }
    if (pending) {
      if (!frame.turn_id) {
        // An idle inject is no turn: its message arrives as a delta.
        removePending(pending);
      } else {
        pending.turnId = frame.turn_id;
        pending.position = frame.position;
        pending.unconfirmed = false;
        pending.sessionId = frame.session_id || pending.sessionId;
        renderPending();
      }
    }
    updateRunning();
  }

  function onDelta(frame) {
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
    added.forEach(function (m) {
      var src = m.source || {};
      if (m.role === "user") {
        removePendingFor(src.client_msg_id, m.turn_id);
        if (m.turn_id) {
          clearTurnNote();
        }
      }
      if (
        state.streaming &&
        m.turn_id === state.streaming.turnId &&
        (m.role === "assistant" || m.role === "tool")
      ) {
        endsStream = true;
      }
    });
    if (endsStream) {
      // The committed messages replace the streamed text (same words, now final).
      removeStreaming();
    }
    var container = $("messages");
    added.forEach(function (m) {
      var node = renderMessage(m);
      if (node) {
        container.appendChild(node);
      }
    });
    updateEmpty();
    refreshContinue();
    touchSession(frame.session_id, added);
    renderSidebar();
    if (stick) {
      scrollToBottom();
    }
  }

  function onOtherDialogActivity(frame) {
    var item = findSession(frame.session_id);
    if (!item) {
      send({ type: "sessions" }); // a dialog we do not list yet (made elsewhere)
      return;
    }
    var messages = frame.messages || [];
    var news = messages.some(function (m) {
      return m.role === "assistant" || m.role === "system";
    });
    if (news) {
      state.unread[frame.session_id] = true;
    }
    touchSession(frame.session_id, messages);
    renderSidebar();
  }

  /** Move a dialog to the top of the list with its newest activity time. */
  function touchSession(sessionId, messages) {
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
    item.last_active_at = latest || new Date().toISOString();
    state.sessions.sort(function (a, b) {
      return Date.parse(b.last_active_at) - Date.parse(a.last_active_at);
    });
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
    state.inflight[frame.turn_id] = true;
    showStreaming(frame.turn_id, result.text, result.tools);
    updateRunning();
  }

  function onTurnUpdated(frame) {
    var pending = findPending(frame.client_msg_id) || findPendingByTurn(frame.turn_id);
    if (pending) {
      removePending(pending);
    }
    if (frame.session_id !== history.sessionId) {
      var item = findSession(frame.session_id);
      if (item && frame.status === "failed") {
        state.unread[frame.session_id] = true;
        renderSidebar();
      }
      return;
    }
    delete state.inflight[frame.turn_id];
    delete state.continuing[frame.turn_id];
    document.querySelectorAll("#messages .is-continuing").forEach(function (node) {
      node.classList.remove("is-continuing");
    });
    history.endTurn(frame.turn_id);
    if (state.streaming && state.streaming.turnId === frame.turn_id) {
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
      // E5: the answer was cut or withheld; say so (the message itself carries the marker).
      showTurnNote("notice", frame.notice.message, "none");
      announce(frame.notice.message);
    } else if (frame.status === "completed") {
      announce(t("answer_done"));
    }
    if (!Object.keys(state.inflight).length) {
      state.stopping = false;
    }
    updateRunning();
    refreshContinue();
  }

  function onSessionUpdated(frame) {
    var item = findSession(frame.session_id);
    if (item && frame.title != null) {
      item.title = frame.title;
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
    var id = frame.client_msg_id;
    if (id && state.silent[id]) {
      delete state.silent[id];
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
    if (id && state.silent[id]) {
      delete state.silent[id];
      toast(frame.message, "error");
      return;
    }
    var pending = findPending(id);
    if (pending) {
      pending.error = frame.message || t("error_generic");
      renderPending();
      return;
    }
    if (state.older && id && state.older.id === id) {
      state.older = null;
      renderOlderIndicator();
    }
    toast(frame.message || t("error_generic"), "error");
  }

  // --- Pending (optimistic) user messages ---------------------------------------------------

  function findPending(clientMsgId) {
    if (!clientMsgId) {
      return null;
    }
    for (var i = 0; i < state.pending.length; i++) {
      if (state.pending[i].id === clientMsgId) {
        return state.pending[i];
      }
    }
    return null;
  }

  function findPendingByTurn(turnId) {
    if (!turnId) {
      return null;
    }
    for (var i = 0; i < state.pending.length; i++) {
      if (state.pending[i].turnId === turnId) {
        return state.pending[i];
      }
    }
    return null;
  }

  function removePending(pending) {
    state.pending = state.pending.filter(function (p) {
      return p !== pending;
    });
    renderPending();
  }

  function removePendingFor(clientMsgId, turnId) {
    var pending = findPending(clientMsgId) || findPendingByTurn(turnId);
    if (pending) {
      removePending(pending);
    }
  }

  /** After a full history load: keep what is still queued, drop what already ran. */
  function reconcilePending(frame) {
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
    state.pending = state.pending.filter(function (p) {
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
      if (q.mode === "retry" || q.mode === "continue" || q.mode === "inject") {
        state.inflight[q.turn_id] = true;
        return;
      }
      state.inflight[q.turn_id] = true;
      var p = findPending(q.client_msg_id) || findPendingByTurn(q.turn_id);
      if (!p) {
        p = { id: q.client_msg_id || "queue:" + q.turn_id, content: q.preview || "" };
        state.pending.push(p);
      }
      p.sessionId = frame.session_id;
      p.turnId = q.turn_id;
      p.position = index + (frame.active_turn ? 1 : 0);
      p.unconfirmed = false;
    });
  }

  function renderPending() {
    var container = $("pending");
    container.replaceChildren();
    state.pending.forEach(function (p) {
      if (p.sessionId && history.sessionId && p.sessionId !== history.sessionId) {
        return;
      }
      var node = el("div", "msg msg-user msg-pending");
      node.dataset.clientMsgId = p.id;
      var bubble = el("div", "bubble", p.content);
      node.appendChild(bubble);
      var meta = el("div", "pending-meta");
      if (p.error || p.unconfirmed) {
        node.classList.add("msg-failed");
        meta.appendChild(icon("alert"));
        meta.appendChild(
          el("span", "pending-error", p.error ? t("not_sent", { message: p.error }) : t("not_confirmed"))
        );
        meta.appendChild(actionButton(p.unconfirmed ? t("resend") : t("edit"), function () {
          removePending(p);
          if (p.unconfirmed) {
            sendMessage(p.content);
          } else {
            var input = $("composer-input");
            input.value = p.content;
            autosize();
            updateSendButton();
            input.focus();
          }
        }));
        meta.appendChild(actionButton(t("dismiss"), function () {
          removePending(p);
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

  function actionButton(label, onClick, className) {
    var button = el("button", "link-btn" + (className ? " " + className : ""), label);
    button.type = "button";
    button.addEventListener("click", onClick);
    return button;
  }

  // --- Transcript rendering -----------------------------------------------------------------

  function renderTranscript() {
    var container = $("messages");
    var frag = document.createDocumentFragment();
    state.answers = Object.create(null);
    history.list().forEach(function (m) {
      var node = renderMessage(m);
      if (node) {
        frag.appendChild(node);
      }
    });
    container.replaceChildren(frag);
    clearTurnNote();
    var last = history.newest();
    if (last && last.role === "assistant" && !Object.keys(state.inflight).length) {
      if (last.status === "cancelled") {
        showTurnNote("cancelled", t("answer_stopped"));
      } else if (last.status === "interrupted") {
        showTurnNote("failed", t("answer_interrupted"));
      }
    }
    renderPending();
    renderOlderIndicator();
    updateEmpty();
    refreshContinue();
  }

  function prependOlder(frame) {
    var scroller = $("transcript");
    var before = scroller.scrollHeight;
    var top = scroller.scrollTop;
    var added = history.loadOlder(frame);
    var container = $("messages");
    var frag = document.createDocumentFragment();
    added.forEach(function (m) {
      var node = renderMessage(m);
      if (node) {
        frag.appendChild(node);
      }
    });
    // Older pages always precede what is shown (their seqs are lower).
    container.insertBefore(frag, container.firstChild);
    scroller.scrollTop = top + (scroller.scrollHeight - before);
    renderOlderIndicator();
    updateEmpty();
    maybeLoadOlder();
  }

  function renderOlderIndicator() {
    var older = $("older");
    older.hidden = !state.older;
    older.textContent = state.older ? t("loading_older") : "";
  }

  function updateEmpty() {
    var conversational = history.list().some(function (m) {
      return m.role === "user" || m.role === "assistant";
    });
    var empty = !conversational && !state.streaming && !state.pending.length && !history.hasMore;
    $("empty").hidden = !empty || !state.loadedOnce;
    $("empty-title").textContent = t("empty_title", { name: config.user.display_name });
    $("empty-body").textContent = t("empty_body");
    $("app").classList.toggle("is-empty", empty);
  }

  function renderMessage(m) {
    var source = m.source || {};
    var node;
    if (m.role === "user") {
      node = el("div", "msg msg-user");
      var bubble = el("div", "bubble", m.content || "");
      node.appendChild(bubble);
      if (source.kind === "steer" || source.kind === "inject") {
        node.appendChild(el("span", "msg-tag", t(source.kind === "steer" ? "steer" : "context")));
      }
    } else if (m.role === "assistant") {
      if (joinContinuation(m)) {
        return null;
      }
      node = el("div", "msg msg-assistant");
      var hasText = Boolean(m.content && m.content.trim());
      if (Array.isArray(m.tool_calls) && m.tool_calls.length) {
        node.appendChild(toolChips(m.tool_calls.map(function (call) {
          var fn = call.function || {};
          return { name: fn.name || call.name || "tool", status: "ok" };
        })));
      }
      if (hasText) {
        var body = el("div", "md");
        renderMarkdownInto(body, m.content, false);
        node.appendChild(body);
      } else if (m.status === "cancelled") {
        node.appendChild(el("p", "md muted", t("stopped_before_text")));
      }
      var foot = el("div", "msg-foot");
      if (m.status === "cancelled" || m.status === "interrupted") {
        node.classList.add("msg-partial");
        foot.appendChild(
          el("span", "msg-status", t(m.status === "cancelled" ? "status_stopped" : "status_interrupted"))
        );
      }
      if (m.status === "truncated" || m.status === "filtered") {
        markCut(node, foot, m);
      }
      if (hasText) {
        foot.appendChild(messageActions(m));
      }
      if (hasText && !(Array.isArray(m.tool_calls) && m.tool_calls.length)) {
        state.answers[m.id] = { node: node, text: m.content };
      }
      if (foot.firstChild) {
        node.appendChild(foot);
      }
    } else if (m.role === "tool") {
      node = el("div", "msg msg-tool");
      var details = el("details", "tool-result");
      var summary = el("summary");
      summary.appendChild(icon("tool"));
      summary.appendChild(el("span", null, t("tool_result", { name: m.tool_name || "tool" })));
      details.appendChild(summary);
      var content = m.content || "";
      details.appendChild(el("pre", null, content.length > 4000 ? content.slice(0, 4000) + "…" : content));
      node.appendChild(details);
    } else if (m.role === "system") {
      node = el("div", "msg msg-system");
      node.appendChild(el("div", "system-note", m.content || ""));
    } else {
      return null;
    }
    node.dataset.id = m.id;
    node.dataset.seq = m.seq;
    if (m.turn_id) {
      node.dataset.turn = m.turn_id;
    }
    if (m.created_at) {
      node.title = fullTime(m.created_at);
    }
    return node;
  }

  // --- Cut answers and Continue (E5) -------------------------------------------------------

  /** A continuation (source.continues) is shown as part of the answer it goes on with: the
   * shown node is rebuilt from the joined text, with the newest part's status. */
  function joinContinuation(m) {
    var target = (m.source || {}).continues;
    var entry = target && state.answers[target];
    if (!entry || !entry.node.parentNode) {
      return false;
    }
    var joined = Object.assign({}, m, {
      content: entry.text + (m.content || ""),
      source: Object.assign({}, m.source, { continues: null }),
    });
    var node = renderMessage(joined);
    node.classList.add("msg-continued");
    entry.node.replaceWith(node);
    state.answers[target] = state.answers[m.id];
    return true;
  }

  function markCut(node, foot, m) {
    var truncated = m.status === "truncated";
    node.classList.add("msg-cut");
    node.dataset.status = m.status;
    var marker = el("span", "msg-status msg-cut-marker");
    marker.appendChild(icon(truncated ? "more" : "alert"));
    marker.appendChild(el("span", null, t(truncated ? "status_truncated" : "status_filtered")));
    foot.appendChild(marker);
    if (truncated) {
      var button = el("button", "btn btn-small continue-btn");
      button.type = "button";
      button.appendChild(icon("next"));
      button.appendChild(el("span", null, t("continue")));
      button.addEventListener("click", function () {
        continueAnswer(button);
      });
      button.dataset.id = m.id;
      foot.appendChild(button);
    }
  }

  function continueAnswer(button) {
    if (send(aim({ type: "continue", client_msg_id: randomId() }))) {
      button.hidden = true;
      clearTurnNote();
    } else {
      toast(t("offline_cannot_send"), "error");
    }
  }

  /** Continue is offered on the newest answer only, while nothing runs. */
  function refreshContinue() {
    var last = history.newest();
    var running = isRunning();
    document.querySelectorAll("#messages .continue-btn").forEach(function (button) {
      button.hidden = running || !last || last.status !== "truncated" || button.dataset.id !== last.id;
    });
  }

  function messageActions(m) {
    var bar = el("div", "msg-actions");
    var copy = el("button", "msg-action");
    copy.type = "button";
    copy.setAttribute("aria-label", t("copy"));
    copy.appendChild(icon("copy"));
    copy.appendChild(el("span", null, t("copy")));
    copy.addEventListener("click", function () {
      copyText(m.content || "", copy);
    });
    bar.appendChild(copy);
    return bar;
  }

  function toolChips(tools) {
    var row = el("div", "tool-chips");
    tools.forEach(function (tool) {
      var status = tool.status || "running";
      var chip = el("span", "chip tool-chip tool-" + status);
      chip.dataset.status = status;
      if (status === "running") {
        chip.appendChild(el("span", "spinner"));
      } else {
        chip.appendChild(icon(status === "ok" ? "check" : "cross"));
      }
      chip.appendChild(el("span", "tool-name", tool.name || "tool"));
      var label = status === "ok" ? t("tool_ok") : status === "error" ? t("tool_error") : t("tool_running");
      chip.appendChild(el("span", "tool-state", label));
      row.appendChild(chip);
    });
    return row;
  }

  function appendCommandLine(command, content) {
    var line = el("div", "msg msg-command");
    line.appendChild(el("div", "command-note", content || ""));
    line.dataset.command = command || "";
    var stick = isNearBottom();
    $("messages").appendChild(line);
    if (stick) {
      scrollToBottom();
    }
  }

  // --- Turn notes (stopped / failed, with Retry) --------------------------------------------

  function clearTurnNote() {
    document.querySelectorAll("#messages .turn-note").forEach(function (node) {
      node.remove();
    });
  }

  function showTurnNote(kind, text, action) {
    clearTurnNote();
    var note = el("div", "turn-note turn-" + kind);
    note.setAttribute("role", "status");
    note.appendChild(icon(kind === "failed" || kind === "notice" ? "alert" : "stop"));
    note.appendChild(el("span", "turn-note-text", text));
    if (action === "none") {
      // A completed answer that is not whole: no Retry; Continue is on the answer itself.
      var stick0 = isNearBottom();
      $("messages").appendChild(note);
      if (stick0) {
        scrollToBottom();
      }
      return;
    }
    var retry = el("button", "btn btn-small retry-btn");
    retry.type = "button";
    retry.appendChild(icon("retry"));
    retry.appendChild(el("span", null, t("retry")));
    retry.addEventListener("click", function () {
      var id = randomId();
      if (send(aim({ type: "retry", client_msg_id: id }))) {
        note.remove();
      } else {
        toast(t("offline_cannot_send"), "error");
      }
    });
    note.appendChild(retry);
    var stick = isNearBottom();
    $("messages").appendChild(note);
    if (stick) {
      scrollToBottom();
    }
  }

  // --- Streaming answer ---------------------------------------------------------------------

  function showStreaming(turnId, text, tools) {
    var s = state.streaming;
    if (!s || s.turnId !== turnId) {
      removeStreaming();
      var node = el("div", "msg msg-assistant msg-streaming");
      node.dataset.turn = turnId;
      node.setAttribute("aria-busy", "true");
      var toolsBox = el("div", "tool-box");
      var body = el("div", "md");
      node.appendChild(toolsBox);
      node.appendChild(body);
      if (state.continuing[turnId]) {
        // E5: the rest of a cut answer streams in right under it, as its continuation.
        node.classList.add("is-continuation");
        var cut = $("messages").querySelectorAll(".msg-cut");
        if (cut.length) {
          cut[cut.length - 1].classList.add("is-continuing");
        }
      }
      $("live").appendChild(node);
      s = state.streaming = { turnId: turnId, el: node, body: body, toolsBox: toolsBox };
      announce(t("streaming"));
      updateEmpty();
    }
    s.text = text;
    s.tools = tools || [];
    if (!s.scheduled) {
      s.scheduled = true;
      requestAnimationFrame(function () {
        s.scheduled = false;
        if (state.streaming === s) {
          paintStreaming(s);
        }
      });
    }
  }

  function paintStreaming(s) {
    var stick = isNearBottom();
    if (s.tools && s.tools.length) {
      s.toolsBox.replaceChildren(toolChips(s.tools));
    } else {
      s.toolsBox.replaceChildren();
    }
    if (s.text) {
      renderMarkdownInto(s.body, s.text, true);
      appendCaret(s.body);
      s.el.classList.remove("is-thinking");
    } else {
      s.body.replaceChildren(thinkingDots());
      s.el.classList.add("is-thinking");
    }
    if (stick) {
      scrollToBottom();
    }
  }

  function thinkingDots() {
    var box = el("div", "thinking");
    box.setAttribute("aria-label", t("thinking"));
    for (var i = 0; i < 3; i++) {
      box.appendChild(el("span", "dot"));
    }
    return box;
  }

  function removeStreaming() {
    if (state.streaming) {
      state.streaming.el.remove();
      state.streaming = null;
    }
  }

  function announce(text) {
    $("live-status").textContent = text;
  }

  // --- Running state / Stop -----------------------------------------------------------------

  function isRunning() {
    return Object.keys(state.inflight).length > 0 || Boolean(state.streaming);
  }

  function updateRunning() {
    var running = isRunning();
    var stop = $("stop-button");
    stop.hidden = !running || currentReadOnly();
    stop.disabled = state.stopping;
    stop.querySelector(".stop-label").textContent = state.stopping ? t("stopping") : t("stop");
    stop.setAttribute("aria-label", state.stopping ? t("stopping") : t("stop") + " (Esc)");
    $("app").classList.toggle("is-running", running);
    $("composer-hint").textContent = running ? t("esc_to_stop") + " · " + t("hint") : t("hint");
  }

  function stopTurn() {
    if (!isRunning() || state.stopping || currentReadOnly()) {
      return;
    }
    // Answered by a `command_result` ("Stopped the running answer."): the UI shows the
    // outcome itself (the turn ends as cancelled), so the answer stays silent.
    var id = randomId();
    var frame = aim({ type: "stop", client_msg_id: id });
    state.silent[id] = "/stop";
    if (send(frame)) {
      state.stopping = true;
      updateRunning();
      // If the server had nothing left to stop, do not keep "Stopping…" forever.
      setTimeout(function () {
        if (state.stopping) {
          state.stopping = false;
          updateRunning();
        }
      }, 8000);
    }
  }

  // --- Header, connection, hash -------------------------------------------------------------

  function currentTitle() {
    return history.title || (history.dialogId ? history.dialogId : "");
  }

  function renderHeader() {
    var title = currentTitle();
    $("chat-title").textContent = title || "\u00a0";
    document.title = title ? title + " · " + t("app_name") : t("app_name");
  }

  function setConnection(status) {
    var app = $("app");
    app.dataset.conn = status;
    var label = status === "online" ? t("connected") : status === "reconnecting" ? t("reconnecting") : t("connecting");
    $("conn-label").textContent = label;
    $("conn-status").title = label;
    var banner = $("conn-banner");
    banner.hidden = status !== "reconnecting";
    if (status !== "reconnecting") {
      clearInterval(countdownTimer);
    }
    updateSendButton();
  }

  function updateCountdown() {
    var seconds = Math.max(0, Math.ceil((reconnectAt - Date.now()) / 1000));
    $("conn-banner-text").textContent = t("reconnecting_in", { seconds: seconds });
  }

  function updateHash() {
    if (!history.dialogId) {
      return;
    }
    var name = isLinked(history.sessionId) ? history.sessionId : history.dialogId;
    var hash = "#" + encodeURIComponent(name);
    if (location.hash !== hash) {
      window.history.replaceState(null, "", location.pathname + location.search + hash);
    }
  }

  // --- Sidebar ------------------------------------------------------------------------------

  function renderSidebar() {
    var list = $("dialog-list");
    if (list.querySelector(".dialog-rename")) {
      return; // never pull the field from under the reader's fingers; redrawn when done
    }
    var frag = document.createDocumentFragment();
    var currentGroup = null;
    var ul = null;
    if (!state.sessions.length) {
      frag.appendChild(el("p", "dialog-empty", state.loadedOnce ? t("no_dialogs") : ""));
    }
    function startGroup(label, className) {
      frag.appendChild(el("h2", "dialog-group" + (className ? " " + className : ""), label));
      ul = el("ul", "dialog-group-list");
      ul.setAttribute("role", "list");
      frag.appendChild(ul);
    }
    var linked = [];
    state.sessions.forEach(function (item) {
      if (isLinked(item.session_id)) {
        linked.push(item);
        return;
      }
      var group = dayGroup(item.last_active_at);
      if (group !== currentGroup) {
        currentGroup = group;
        startGroup(t(group));
      }
      ul.appendChild(dialogItem(item));
    });
    // Linked chat-app dialogs: one group per platform, after the web chat's own.
    currentGroup = null;
    linked.forEach(function (item) {
      if (item.channel !== currentGroup) {
        currentGroup = item.channel;
        startGroup(t("linked_group", { platform: platformName(item.channel) }), "dialog-group-linked");
      }
      ul.appendChild(dialogItem(item));
    });
    list.replaceChildren(frag);
    var anyUnread = state.sessions.some(function (item) {
      return state.unread[item.session_id] && item.session_id !== history.sessionId;
    });
    $("menu-unread").hidden = !anyUnread;
  }

  function dialogItem(item) {
    var li = el("li", "dialog-item");
    li.dataset.dialogId = item.dialog_id;
    li.dataset.sessionId = item.session_id;
    var isCurrent = item.session_id === history.sessionId;
    var unread = Boolean(state.unread[item.session_id]) && !isCurrent;
    li.classList.toggle("is-current", isCurrent);
    li.classList.toggle("is-unread", unread);

    var open = el("button", "dialog-open");
    open.type = "button";
    if (isCurrent) {
      open.setAttribute("aria-current", "true");
    }
    var title = el("span", "dialog-title", item.title || item.dialog_id);
    var meta = el("span", "dialog-meta");
    var when = el("time", "dialog-time", relativeTime(item.last_active_at));
    when.dateTime = item.last_active_at;
    when.title = fullTime(item.last_active_at);
    meta.appendChild(when);
    if (item.read_only) {
      meta.appendChild(el("span", "dialog-badge", t("read_only")));
    }
    open.appendChild(title);
    open.appendChild(meta);
    if (unread) {
      var dot = el("span", "unread-dot");
      dot.setAttribute("role", "img");
      dot.setAttribute("aria-label", t("unread"));
      open.appendChild(dot);
    }
    open.addEventListener("click", function () {
      switchTo(item);
    });
    li.appendChild(open);
    if (item.read_only) {
      return li; // nothing to rename or delete
    }

    var more = el("button", "icon-btn dialog-more");
    more.type = "button";
    more.setAttribute("aria-label", t("options_for", { title: item.title || item.dialog_id }));
    more.setAttribute("aria-haspopup", "menu");
    more.setAttribute("aria-expanded", "false");
    more.appendChild(icon("more"));
    more.addEventListener("click", function (event) {
      event.stopPropagation();
      openMenu(item, more);
    });
    li.appendChild(more);
    return li;
  }

  function switchTo(item) {
    closeMenu();
    if (item.session_id === history.sessionId) {
      closeSidebar();
      return;
    }
    if (isLinked(item.session_id) ? openLinked(item) : sendCommand("/switch " + item.dialog_id, true)) {
      $("app").classList.add("is-switching");
      setTimeout(function () {
        $("app").classList.remove("is-switching");
      }, 400);
    }
  }

  /** Open a linked chat-app dialog (/switch only knows the web chat's): its history, and
   * its live answers from now on. */
  function openLinked(item) {
    var id = randomId();
    if (!send({ type: "history", session_id: item.session_id, follow: true, client_msg_id: id })) {
      toast(t("offline_cannot_send"), "error");
      return false;
    }
    return true;
  }

  function platformName(channel) {
    return { telegram: "Telegram", feishu: "Feishu / Lark" }[channel] || channel;
  }

  function currentReadOnly() {
    var item = findSession(history.sessionId);
    return Boolean(item && item.read_only);
  }

  /** A read-only linked dialog can be followed, not written to: the composer says so. */
  function updateReadOnly() {
    var item = findSession(history.sessionId);
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

  function newDialog() {
    closeMenu();
    if (sendCommand("/new", true)) {
      closeSidebar();
      $("composer-input").focus();
    }
  }

  function openMenu(item, anchor) {
    var menu = $("dialog-menu");
    if (state.menuFor && state.menuFor.item.session_id === item.session_id && !menu.hidden) {
      closeMenu();
      return;
    }
    closeMenu();
    state.menuFor = { item: item, anchor: anchor };
    anchor.setAttribute("aria-expanded", "true");
    menu.hidden = false;
    var rect = anchor.getBoundingClientRect();
    var width = menu.offsetWidth;
    menu.style.top = Math.min(window.innerHeight - menu.offsetHeight - 8, rect.bottom + 4) + "px";
    menu.style.left = Math.max(8, Math.min(window.innerWidth - width - 8, rect.right - width)) + "px";
    menu.querySelector(".menu-item").focus();
  }

  function closeMenu() {
    var menu = $("dialog-menu");
    if (state.menuFor) {
      state.menuFor.anchor.setAttribute("aria-expanded", "false");
    }
    state.menuFor = null;
    menu.hidden = true;
  }

  function menuAction(action) {
    var target = state.menuFor;
    closeMenu();
    if (!target) {
      return;
    }
    if (action === "rename") {
      startRename(target.item);
    } else if (action === "delete") {
      confirmDelete(target.item);
    }
  }

  /** Run a command on one dialog of the list (`dialog_id` picks it; no switch needed). */
  function commandOn(item, text) {
    sendCommand(text, true, item);
  }

  function cleanTitle(text) {
    return text.replace(/\s+/g, " ").trim();
  }

  function startRename(item) {
    var li = document.querySelector('.dialog-item[data-session-id="' + cssEscape(item.session_id) + '"]');
    if (!li) {
      return;
    }
    openSidebarIfMobile();
    var input = el("input", "dialog-rename");
    input.type = "text";
    input.value = item.title || "";
    input.maxLength = 200;
    input.setAttribute("aria-label", t("rename_label"));
    li.replaceChildren(input);
    input.focus();
    input.select();
    var done = false;
    function finish(commit) {
      if (done) {
        return;
      }
      done = true;
      var title = cleanTitle(input.value);
      input.remove();
      if (commit && title && title !== item.title) {
        item.title = title; // optimistic; `session_updated` brings the stored title
        commandOn(item, "/rename " + title);
      }
      renderSidebar();
    }
    input.addEventListener("keydown", function (event) {
      if (event.key === "Enter") {
        event.preventDefault();
        finish(true);
      } else if (event.key === "Escape") {
        event.preventDefault();
        event.stopPropagation();
        finish(false);
      }
    });
    input.addEventListener("blur", function () {
      finish(true);
    });
  }

  function renameCurrentFromHeader() {
    if (!history.sessionId || currentReadOnly()) {
      return;
    }
    var heading = $("chat-title");
    var input = el("input", "title-rename");
    input.type = "text";
    input.value = history.title || "";
    input.maxLength = 200;
    input.setAttribute("aria-label", t("rename_label"));
    heading.hidden = true;
    heading.parentNode.appendChild(input);
    input.focus();
    input.select();
    var done = false;
    function finish(commit) {
      if (done) {
        return;
      }
      done = true;
      var title = cleanTitle(input.value);
      input.remove();
      heading.hidden = false;
      if (commit && title && title !== history.title) {
        history.title = title;
        renderHeader();
        sendCommand("/rename " + title, true, {
          session_id: history.sessionId,
          dialog_id: history.dialogId,
        });
      }
    }
    input.addEventListener("keydown", function (event) {
      if (event.key === "Enter") {
        event.preventDefault();
        finish(true);
      } else if (event.key === "Escape") {
        event.preventDefault();
        event.stopPropagation();
        finish(false);
      }
    });
    input.addEventListener("blur", function () {
      finish(true);
    });
  }

  function confirmDelete(item) {
    var dialog = $("confirm-dialog");
    $("confirm-body").textContent = t("delete_body", { title: item.title || item.dialog_id });
    dialog.returnValue = "";
    dialog.onclose = function () {
      if (dialog.returnValue === "confirm") {
        commandOn(item, "/delete");
      }
    };
    dialog.showModal();
    $("confirm-cancel").focus();
  }

  function cssEscape(value) {
    return window.CSS && CSS.escape ? CSS.escape(value) : String(value).replace(/["\\]/g, "\\$&");
  }

  // --- Mobile slide-over --------------------------------------------------------------------

  function isNarrow() {
    return window.matchMedia("(max-width: 768px)").matches;
  }

  function openSidebar() {
    $("app").classList.add("sidebar-open");
    $("scrim").hidden = false;
    $("menu-button").setAttribute("aria-expanded", "true");
    var current = document.querySelector(".dialog-item.is-current .dialog-open");
    (current || $("new-dialog")).focus();
  }

  function openSidebarIfMobile() {
    if (isNarrow()) {
      $("app").classList.add("sidebar-open");
      $("scrim").hidden = false;
      $("menu-button").setAttribute("aria-expanded", "true");
    }
  }

  function closeSidebar() {
    if (!$("app").classList.contains("sidebar-open")) {
      return;
    }
    $("app").classList.remove("sidebar-open");
    $("scrim").hidden = true;
    $("menu-button").setAttribute("aria-expanded", "false");
  }

  // --- Scrolling ----------------------------------------------------------------------------

  function isNearBottom() {
    var s = $("transcript");
    return s.scrollHeight - s.scrollTop - s.clientHeight < NEAR_BOTTOM_PX;
  }

  function scrollToBottom() {
    var s = $("transcript");
    s.scrollTop = s.scrollHeight;
    $("jump-latest").hidden = true;
  }

  function maybeLoadOlder() {
    var s = $("transcript");
    if (!history.hasMore || state.older || !isOpen()) {
      return;
    }
    if (s.scrollTop > NEAR_TOP_PX && s.scrollHeight > s.clientHeight) {
      return;
    }
    var beforeSeq = history.oldestSeq();
    if (beforeSeq == null) {
      return;
    }
    var id = randomId();
    var frame = aim({ type: "history", before_seq: beforeSeq, limit: OLDER_PAGE, client_msg_id: id });
    if (send(frame)) {
      state.older = { id: id, beforeSeq: beforeSeq };
      renderOlderIndicator();
    }
  }

  function onScroll() {
    $("jump-latest").hidden = isNearBottom();
    maybeLoadOlder();
  }

  // --- Composer -----------------------------------------------------------------------------

  function autosize() {
    var input = $("composer-input");
    input.style.height = "auto";
    var max = Math.max(120, Math.round(window.innerHeight * 0.4));
    input.style.height = Math.min(input.scrollHeight, max) + "px";
    input.style.overflowY = input.scrollHeight > max ? "auto" : "hidden";
  }

  function updateSendButton() {
    var input = $("composer-input");
    $("send-button").disabled = !input.value.trim() || !isOpen() || input.disabled;
  }

  function sendMessage(content) {
    if (!isOpen()) {
      toast(t("offline_cannot_send"), "error");
      return false;
    }
    var id = randomId();
    var frame = aim({ type: "send", content: content, client_msg_id: id });
    state.pending.push({ id: id, sessionId: history.sessionId, content: content, turnId: null });
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
    if (!trimmed) {
      return;
    }
    if (!isOpen()) {
      toast(t("offline_cannot_send"), "error");
      return;
    }
    if (currentReadOnly()) {
      return;
    }
    var length = window.ChatHistory.codePointLength(content);
    if (length > CONTENT_LIMIT) {
      toast(t("too_long", { n: length, limit: CONTENT_LIMIT }), "error");
      return;
    }
    if (trimmed.charAt(0) === "/") {
      // Slash commands go to the server as they are (B3); it answers each one.
      if (!sendCommand(trimmed, false)) {
        return;
      }
    } else if (!sendMessage(content)) {
      return;
    }
    input.value = "";
    autosize();
    updateSendButton();
  }

  // --- Toasts -------------------------------------------------------------------------------

  function toast(text, level) {
    if (!text) {
      return;
    }
    var box = $("toasts");
    var node = el("div", "toast toast-" + (level || "info"));
    node.setAttribute("role", level === "error" ? "alert" : "status");
    node.appendChild(el("span", "toast-text", text));
    var close = el("button", "icon-btn toast-close");
    close.type = "button";
    close.setAttribute("aria-label", t("close"));
    close.appendChild(icon("cross"));
    close.addEventListener("click", function () {
      node.remove();
    });
    node.appendChild(close);
    box.appendChild(node);
    while (box.children.length > 4) {
      box.firstChild.remove();
    }
    setTimeout(function () {
      node.classList.add("leaving");
      setTimeout(function () {
        node.remove();
      }, 300);
    }, level === "error" ? 8000 : 5000);
  }

  // --- Wiring -------------------------------------------------------------------------------

  // The dialog a link's fragment names, or null. A crafted link (`/#%`, which
  // decodeURIComponent refuses) is ignored rather than breaking the page (F8).
  function dialogFromHash(fragment) {
    var text;
    try {
      text = decodeURIComponent(fragment.replace(/^#/, ""));
    } catch (err) {
      return null;
    }
    // A dialog id, or the session id of a linked chat-app dialog (channel:chat:dialog).
    return /^[A-Za-z0-9_.-]{1,64}$/.test(text) || /^[A-Za-z0-9_.-]{1,64}(:[A-Za-z0-9_.-]{1,64}){2}$/.test(text)
      ? text
      : null;
  }

  function init() {
    var input = $("composer-input");
    $("composer").addEventListener("submit", function (event) {
      event.preventDefault();
      submitComposer();
    });
    input.addEventListener("input", function () {
      autosize();
      updateSendButton();
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
    document.addEventListener("keydown", function (event) {
      if (event.key !== "Escape" || event.defaultPrevented) {
        return;
      }
      if (!$("dialog-menu").hidden) {
        closeMenu();
        return;
      }
      if ($("confirm-dialog").open) {
        return;
      }
      if ($("app").classList.contains("sidebar-open")) {
        closeSidebar();
        $("menu-button").focus();
        return;
      }
      if (isRunning()) {
        event.preventDefault();
        stopTurn();
      }
    });
    $("stop-button").addEventListener("click", stopTurn);
    $("new-dialog").addEventListener("click", newDialog);
    $("menu-button").addEventListener("click", openSidebar);
    $("sidebar-close").addEventListener("click", closeSidebar);
    $("scrim").addEventListener("click", closeSidebar);
    $("reconnect-now").addEventListener("click", reconnectNow);
    $("jump-latest").addEventListener("click", function () {
      var s = $("transcript");
      s.scrollTo({ top: s.scrollHeight, behavior: "smooth" });
    });
    $("transcript").addEventListener("scroll", onScroll, { passive: true });
    $("chat-title").addEventListener("click", renameCurrentFromHeader);
    $("chat-title").addEventListener("keydown", function (event) {
      if (event.key === "Enter" || event.key === " ") {
        event.preventDefault();
        renameCurrentFromHeader();
      }
    });
    $("dialog-menu").addEventListener("click", function (event) {
      var item = event.target.closest(".menu-item");
      if (item) {
        menuAction(item.dataset.action);
      }
    });
    $("dialog-menu").addEventListener("keydown", function (event) {
      var items = Array.prototype.slice.call($("dialog-menu").querySelectorAll(".menu-item"));
      var index = items.indexOf(document.activeElement);
      if (event.key === "ArrowDown" || event.key === "ArrowUp") {
        event.preventDefault();
        var next = (index + (event.key === "ArrowDown" ? 1 : -1) + items.length) % items.length;
        items[next].focus();
      } else if (event.key === "Tab") {
        closeMenu();
      }
    });
    document.addEventListener("click", function (event) {
      if (!$("dialog-menu").hidden && !event.target.closest("#dialog-menu")) {
        closeMenu();
      }
    });
    window.addEventListener("resize", function () {
      closeMenu();
      autosize();
    });
    window.addEventListener("online", reconnectNow);
    document.addEventListener("visibilitychange", function () {
      if (!document.hidden && !socket) {
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
      state.wantSession = wanted;
    } else if (wanted) {
      state.wantDialog = wanted;
    }
    renderHeader();
    updateRunning();
    autosize();
    connect();
    if (!window.matchMedia("(pointer: coarse)").matches) {
      input.focus(); // not on phones: it would pop the keyboard over the page
    }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", init);
  } else {
    init();
  }
})();
