/*
 * The running turn's answer as it is written (D1): one streaming bubble under the
 * transcript, repainted at most once per animation frame from the latest `turn_snapshot`
 * text (half-written markup closed, a caret at the end), with its tool chips; a
 * continuation (E5) streams right under the cut answer it goes on with. The committed
 * messages replace it when the turn's delta arrives.
 */
import { appendCaret, renderMarkdownInto } from "./markdown.js";
import { isNearBottom, scrollToBottom, toolChips, updateEmpty } from "./render.js";
import { store } from "./state.js";
import { $, announce, el, t } from "./ui.js";

/** Show the running turn's answer so far (painted once per animation frame). */
export function showStreaming(turnId, text, tools) {
  var s = store.streaming();
  if (!s || s.turnId !== turnId) {
    removeStreaming();
    var node = el("div", "msg msg-assistant msg-streaming");
    node.dataset.turn = turnId;
    node.setAttribute("aria-busy", "true");
    var toolsBox = el("div", "tool-box");
    var body = el("div", "md");
    node.appendChild(toolsBox);
    node.appendChild(body);
    if (store.isContinuing(turnId)) {
      // E5: the rest of a cut answer streams in right under it, as its continuation.
      node.classList.add("is-continuation");
      var cut = $("messages").querySelectorAll(".msg-cut");
      if (cut.length) {
        cut[cut.length - 1].classList.add("is-continuing");
      }
    }
    $("live").appendChild(node);
    s = { turnId: turnId, el: node, body: body, toolsBox: toolsBox };
    store.setStreaming(s);
    announce(t("streaming"));
    updateEmpty();
  }
  s.text = text;
  s.tools = tools || [];
  if (!s.scheduled) {
    s.scheduled = true;
    requestAnimationFrame(function () {
      s.scheduled = false;
      if (store.streaming() === s) {
        paintStreaming(s);
      }
    });
  }
}

/** A turn of the open dialog starts (or is next): the "thinking" indicator until its first
 * snapshot, unless another answer is shown streaming. */
export function showWaiting(turnId) {
  var s = store.streaming();
  if (!s) {
    showStreaming(turnId, "", []);
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

export function removeStreaming() {
  var s = store.streaming();
  if (s) {
    s.el.remove();
    store.setStreaming(null);
  }
}

/** Whether the streaming answer belongs to `turnId`. */
export function isStreaming(turnId) {
  var s = store.streaming();
  return Boolean(s) && s.turnId === turnId;
}
