/*
 * Safe markdown (E1). Model output is untrusted: it goes through marked, then DOMPurify with
 * a strict allow-list, and lands in the DOM as a sanitised fragment. No remote images, raw
 * HTML shown as text, links open in a new tab without the opener.
 */
import { highlightCode } from "./codehl.js";
import { closeOpenMarkdown, escapeHtml, hasOpenFence, holdMarkerLine } from "./format.js";
import { el, icon, t } from "./ui.js";

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
  // Classes only as the language marker of code blocks and highlight.js's token classes
  // (never our own UI classes).
  if (data.attrName === "class") {
    data.keepAttr =
      (node.nodeName === "CODE" && /^language-[\w+#.-]{1,40}$/.test(data.attrValue)) ||
      (node.nodeName === "SPAN" && /^hljs-[\w-]+( [\w-]+)*$/.test(data.attrValue));
  }
});

// The coloured code highlight.js returns: spans with its classes around text, nothing else.
var CODE_CONFIG = {
  ALLOWED_TAGS: ["span"],
  ALLOWED_ATTR: ["class"],
  ALLOW_DATA_ATTR: false,
  RETURN_DOM_FRAGMENT: true,
};

function sanitizeCode(html) {
  return purifier.sanitize(html, CODE_CONFIG);
}
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

/** Replace `container`'s children with the rendered answer (a streaming one with its open
 * markup closed; a final one with code blocks that have a copy button). */
export function renderMarkdownInto(container, text, streaming) {
  container.replaceChildren(markdownFragment(streaming ? closeOpenMarkdown(text) : text));
  highlightCode(container, streaming && hasOpenFence(holdMarkerLine(text)), sanitizeCode);
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

export function copyText(text, button) {
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
export function appendCaret(root) {
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
