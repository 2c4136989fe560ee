/*
 * What every part of the page shares: the server's config (json_script "chat-config", with
 * the translated strings of this request), `t`, and small DOM helpers (elements, icons,
 * toasts, the screen-reader line).
 */
import { translate } from "./format.js";

export var config = JSON.parse(document.getElementById("chat-config").textContent);
var STRINGS = config.strings || {};
export var LANG = config.language || document.documentElement.lang || "en";

/** A translated string; `%(name)s` placeholders are filled from `params`. */
export function t(key, params) {
  return translate(STRINGS, key, params);
}

export function $(id) {
  return document.getElementById(id);
}

export function el(tag, className, text) {
  var node = document.createElement(tag);
  if (className) {
    node.className = className;
  }
  if (text != null) {
    node.textContent = text;
  }
  return node;
}

export function randomId() {
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
  edit: "M4 20h4L19 9l-4-4L4 16zM14 6l4 4",
};

export function icon(name) {
  var svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("aria-hidden", "true");
  svg.setAttribute("class", "ico");
  var path = document.createElementNS("http://www.w3.org/2000/svg", "path");
  path.setAttribute("d", ICONS[name]);
  svg.appendChild(path);
  return svg;
}

export function actionButton(label, onClick, className) {
  var button = el("button", "link-btn" + (className ? " " + className : ""), label);
  button.type = "button";
  button.addEventListener("click", onClick);
  return button;
}

export function cssEscape(value) {
  return window.CSS && CSS.escape ? CSS.escape(value) : String(value).replace(/["\\]/g, "\\$&");
}

/** Say something to screen readers (the polite live region). */
export function announce(text) {
  $("live-status").textContent = text;
}

export function toast(text, level) {
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
