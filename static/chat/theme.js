/*
 * Light, dark or the system's theme (issue 54), remembered per browser (localStorage). The
 * sheets keep their `prefers-color-scheme: dark` rules; a chosen theme switches those rules
 * (and the code colours' sheets) on or off through the CSSOM, so no colour is written twice.
 */
import { $ } from "./ui.js";

var KEY = "chat-theme";
var DARK = "(prefers-color-scheme: dark)";
var LIGHT = "(prefers-color-scheme: light)";
var CHOICES = ["system", "light", "dark"];

export function storedTheme() {
  var value = null;
  try {
    value = window.localStorage.getItem(KEY);
  } catch (_err) {
    value = null; // storage refused (private mode): the system's theme
  }
  return CHOICES.indexOf(value) >= 0 ? value : "system";
}

function darkRules(sheet) {
  var rules;
  try {
    rules = sheet.cssRules;
  } catch (_err) {
    return []; // not ours (another origin): nothing to switch
  }
  var found = [];
  for (var i = 0; i < rules.length; i++) {
    var rule = rules[i];
    if (rule.media && rule.media.mediaText === DARK) {
      found.push(rule);
    }
  }
  return found;
}

var switched = []; // the dark rules found once: their media text is ours to set

/** Apply `theme` ("system", "light" or "dark") to the page. */
export function applyTheme(theme) {
  if (!switched.length) {
    for (var i = 0; i < document.styleSheets.length; i++) {
      switched = switched.concat(darkRules(document.styleSheets[i]));
    }
  }
  var media = theme === "dark" ? "all" : theme === "light" ? "not all" : DARK;
  switched.forEach(function (rule) {
    rule.media.mediaText = media;
  });
  document.querySelectorAll("link[data-code-theme]").forEach(function (link) {
    var dark = link.dataset.codeTheme === "dark";
    if (theme === "system") {
      link.media = dark ? DARK : LIGHT;
    } else {
      link.media = (theme === "dark") === dark ? "all" : "not all";
    }
  });
  var scheme = theme === "system" ? "light dark" : theme;
  document.documentElement.style.colorScheme = scheme;
  document.documentElement.dataset.theme = theme;
  var meta = document.querySelector('meta[name="color-scheme"]');
  if (meta) {
    meta.content = scheme;
  }
}

/** Wire the theme picker and apply the remembered theme. */
export function bindTheme() {
  var select = $("theme-select");
  var theme = storedTheme();
  applyTheme(theme);
  select.value = theme;
  select.addEventListener("change", function () {
    var value = CHOICES.indexOf(select.value) >= 0 ? select.value : "system";
    try {
      window.localStorage.setItem(KEY, value);
    } catch (_err) {
      // Not remembered; still applied to this page.
    }
    applyTheme(value);
  });
}
