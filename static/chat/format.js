/*
 * Pure helpers of the web chat: text, time, names and backoff. No DOM, no network, no page
 * state; every input is an argument, so the browser tests drive them directly (like
 * history.js).
 */

/** `strings[key]` (or the key itself) with `%(name)s` placeholders filled from `params`. */
export function translate(strings, key, params) {
  var text = Object.prototype.hasOwnProperty.call(strings, key) ? strings[key] : key;
  if (params) {
    text = text.replace(/%\((\w+)\)s/g, function (_m, name) {
      return params[name] == null ? "" : String(params[name]);
    });
  }
  return text;
}

export function escapeHtml(text) {
  return String(text)
    .replace(/&/g, "&amp;")
    .replace(/</g, "&lt;")
    .replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;")
    .replace(/'/g, "&#39;");
}

/**
 * While an answer streams, close what its tail left open (a code fence, `**`, `~~`, a
 * backtick) so half-written markup does not flash as raw asterisks; the final text is
 * rendered as it is.
 */
export function closeOpenMarkdown(text) {
  text = holdMarkerLine(text);
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

/** Whether a streaming answer ends inside a code fence it opened. */
export function hasOpenFence(text) {
  var fences = text.match(/^ {0,3}(```|~~~)/gm);
  return Boolean(fences) && fences.length % 2 === 1;
}

/**
 * The last line of a streaming answer is not whole yet. Made only of markdown markers so far
 * ("-", "==", "1.", "#", "|--", "> "), it could still become a list item, a rule, a heading
 * underline or a table: drawn now, "Intro\n-" shows "Intro" as a big heading for a moment.
 * Such a line waits for its next characters (inside an open code fence it is just code).
 */
export function holdMarkerLine(text) {
  var cut = text.lastIndexOf("\n");
  var last = text.slice(cut + 1);
  if (!last || !/^[\s\-=*_#>|:+\d.)`~]*$/.test(last)) {
    return text;
  }
  var fences = text.slice(0, cut + 1).match(/^ {0,3}(```|~~~)/gm);
  if (fences && fences.length % 2 === 1 && !/^ {0,3}(```|~~~)/.test(last)) {
    return text;
  }
  return text.slice(0, cut + 1);
}

// --- Time -----------------------------------------------------------------------------------

var relFormats = Object.create(null);

function relFormat(lang) {
  if (typeof Intl === "undefined" || !Intl.RelativeTimeFormat) {
    return null;
  }
  if (!relFormats[lang]) {
    relFormats[lang] = new Intl.RelativeTimeFormat(lang, { numeric: "auto", style: "short" });
  }
  return relFormats[lang];
}

/** "5 min ago" for an ISO time; `justNow` is the (translated) text under 45 seconds. */
export function relativeTime(iso, lang, justNow, now) {
  var then = Date.parse(iso);
  if (isNaN(then)) {
    return "";
  }
  var seconds = Math.round(((now == null ? Date.now() : now) - then) / 1000);
  if (seconds < 45) {
    return justNow;
  }
  var format = relFormat(lang);
  if (!format) {
    return new Date(then).toLocaleString(lang);
  }
  var minutes = Math.round(seconds / 60);
  if (minutes < 60) {
    return format.format(-minutes, "minute");
  }
  var hours = Math.round(minutes / 60);
  if (hours < 24) {
    return format.format(-hours, "hour");
  }
  var days = Math.round(hours / 24);
  if (days < 7) {
    return format.format(-days, "day");
  }
  return new Date(then).toLocaleDateString(lang, { month: "short", day: "numeric" });
}

/** The sidebar group of a dialog active at `iso`: today, yesterday, previous_7_days, older. */
export function dayGroup(iso, now) {
  var then = new Date(Date.parse(iso));
  var today = now == null ? new Date() : new Date(now);
  var startToday = new Date(today.getFullYear(), today.getMonth(), today.getDate()).getTime();
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

export function fullTime(iso, lang) {
  var then = Date.parse(iso);
  return isNaN(then) ? "" : new Date(then).toLocaleString(lang);
}

// --- Dialogs ----------------------------------------------------------------------------------

/** Whether a session id is a chat-app dialog linked to this user (not the web chat's). */
export function isLinked(sessionId) {
  return Boolean(sessionId) && String(sessionId).split(":")[0] !== "web";
}

export function platformName(channel) {
  return { telegram: "Telegram", feishu: "Feishu / Lark" }[channel] || channel;
}

export function cleanTitle(text) {
  return text.replace(/\s+/g, " ").trim();
}

/**
 * The dialog a link's fragment names, or null. A crafted link (`/#%`, which
 * decodeURIComponent refuses) is ignored rather than breaking the page (F8).
 */
export function dialogFromHash(fragment) {
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

/**
 * Milliseconds before reconnect attempt `attempt` (0-based): 1 s, 2 s, 4 s … at most 30 s,
 * each with ±25 % jitter (`random` in [0, 1)) so tabs do not stampede.
 */
export function backoffDelay(attempt, random) {
  var base = Math.min(30000, 1000 * Math.pow(2, attempt));
  return Math.min(30000, Math.round(base * (0.75 + random * 0.5)));
}
