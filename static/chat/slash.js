/*
 * Slash commands typed in the composer (B3, issue 54). The text stays in the composer until
 * the server answers: a command's result clears it; an unknown command ("/usr/bin/python
 * crashes on start") leaves it there with "Send as a message", which sends it as a message
 * with `literal: true` (PROTOCOL `send`).
 */
import { $, el, t } from "./ui.js";

var typed = Object.create(null); // client_msg_id -> the composer's text when it was sent
var sendLiteral = null; // (content) -> whether it was sent: given by app.js (composer's)

/** `send(content)` sends a message with `literal: true`; true when it went. */
export function bindSlash(send) {
  sendLiteral = send;
}

/** Empty the composer as typing would (its `input` handler resizes and updates Send). */
function clearComposer() {
  var input = $("composer-input");
  input.value = "";
  input.dispatchEvent(new Event("input"));
}

export function rememberTyped(clientMsgId, text) {
  typed[clientMsgId] = text;
}

function take(clientMsgId) {
  if (!clientMsgId || !Object.prototype.hasOwnProperty.call(typed, clientMsgId)) {
    return null;
  }
  var text = typed[clientMsgId];
  delete typed[clientMsgId];
  return text;
}

/** A typed command was answered: the composer is cleared (unless edited since). */
export function typedAnswered(clientMsgId) {
  var text = take(clientMsgId);
  if (text === null) {
    return;
  }
  if ($("composer-input").value === text) {
    clearComposer();
  }
  hideOffer();
}

/** A typed command was refused. An unknown one keeps its text and offers to send it as a
 * message (true: handled); other refusals are shown as usual (false). */
export function typedRefused(clientMsgId, frame) {
  var text = take(clientMsgId);
  if (text === null) {
    return false;
  }
  if (frame.code !== "unknown_command") {
    return false;
  }
  showOffer(frame.message || "", text);
  return true;
}

function showOffer(message, text) {
  var box = $("composer-offer");
  box.replaceChildren();
  box.appendChild(el("span", "composer-offer-text", message));
  var send = el("button", "btn btn-small composer-offer-send", t("send_as_message"));
  send.type = "button";
  send.addEventListener("click", function () {
    var input = $("composer-input");
    var content = input.value.trim() ? input.value : text;
    if (sendLiteral && sendLiteral(content)) {
      clearComposer();
      hideOffer();
      input.focus();
    }
  });
  var dismiss = el("button", "link-btn composer-offer-dismiss", t("dismiss"));
  dismiss.type = "button";
  dismiss.addEventListener("click", function () {
    hideOffer();
    $("composer-input").focus();
  });
  box.appendChild(send);
  box.appendChild(dismiss);
  box.hidden = false;
}

export function hideOffer() {
  var box = $("composer-offer");
  if (box && !box.hidden) {
    box.hidden = true;
    box.replaceChildren();
  }
}
