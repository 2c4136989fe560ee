/*
 * Syntax highlighting of fenced code in answers (issue 54) with the vendored highlight.js
 * (static/vendor/highlight, a plain script like marked and DOMPurify: the CSP's script-src
 * 'self' holds). Only blocks that name a language highlight.js knows are coloured, never
 * guessed. While an answer streams, a block is coloured once it is closed; its colouring is
 * kept by text, so the snapshots that follow reuse it instead of colouring the whole answer
 * again. The open block at the end stays plain until its fence closes.
 *
 * highlight.js escapes the code it is given and returns `<span class="hljs-…">` markup;
 * that still goes through the page's sanitiser (`sanitize`, DOMPurify with only spans and
 * their hljs classes allowed), which hands back DOM nodes: no markup string is ever written
 * into the page.
 */

var CACHE_LIMIT = 200;
var cache = new Map(); // language + "\n" + code -> sanitised fragment of the coloured code

function languageOf(code) {
  var match = /(?:^|\s)language-([\w+#.-]+)/.exec(code.className || "");
  if (!match || !window.hljs) {
    return null;
  }
  var name = match[1].toLowerCase();
  return window.hljs.getLanguage(name) ? name : null;
}

function coloured(language, text, sanitize) {
  var key = language + "\n" + text;
  var fragment = cache.get(key);
  if (fragment === undefined) {
    try {
      var marked = window.hljs.highlight(text, { language: language, ignoreIllegals: true });
      fragment = sanitize(marked.value);
    } catch (_err) {
      fragment = null; // a grammar that fails on this input: the block stays plain
    }
    if (cache.size >= CACHE_LIMIT) {
      cache.delete(cache.keys().next().value);
    }
    cache.set(key, fragment);
  }
  return fragment;
}

/**
 * Colour the code blocks under `root`. `openLast`: the last block is still being written
 * (a streaming answer with an open fence), leave it plain. `sanitize(markup)` returns a
 * sanitised DocumentFragment.
 */
export function highlightCode(root, openLast, sanitize) {
  var blocks = root.querySelectorAll("pre > code");
  for (var i = 0; i < blocks.length; i++) {
    if (openLast && i === blocks.length - 1) {
      break;
    }
    var code = blocks[i];
    var language = languageOf(code);
    if (!language) {
      continue;
    }
    var fragment = coloured(language, code.textContent, sanitize);
    if (fragment !== null) {
      code.replaceChildren(fragment.cloneNode(true)); // the cached copy stays whole
      code.classList.add("is-highlighted");
    }
  }
}
