/*
 * The header: the open dialog's title (click to rename), the connection's status with the
 * reconnect banner, and the address's fragment naming the open dialog.
 */
import { isDraft } from "./draft.js";
import { cleanTitle, isLinked } from "./format.js";
import { updateSendButton } from "./composer.js";
import { history, store } from "./state.js";
import { sendCommand } from "./transport.js";
import { $, el, t } from "./ui.js";

function currentTitle() {
  if (isDraft()) {
    return t("new_dialog");
  }
  return history.title || (history.dialogId ? history.dialogId : "");
}

export function renderHeader() {
  var title = currentTitle();
  $("chat-title").textContent = title || "\u00a0";
  document.title = title ? title + " · " + t("app_name") : t("app_name");
}

export function setConnection(status) {
  var app = $("app");
  app.dataset.conn = status;
  var label = status === "online" ? t("connected") : status === "reconnecting" ? t("reconnecting") : t("connecting");
  $("conn-label").textContent = label;
  $("conn-status").title = label;
  $("conn-banner").hidden = status !== "reconnecting";
  updateSendButton();
}

export function showCountdown(seconds) {
  $("conn-banner-text").textContent = t("reconnecting_in", { seconds: seconds });
}

/** The address names the open dialog, so a reload or a shared link comes back to it. */
export function updateHash() {
  if (!history.dialogId) {
    return;
  }
  var name = isLinked(history.sessionId) ? history.sessionId : history.dialogId;
  var hash = "#" + encodeURIComponent(name);
  if (location.hash !== hash) {
    window.history.replaceState(null, "", location.pathname + location.search + hash);
  }
}

export function renameCurrentFromHeader() {
  if (!history.sessionId || store.isReadOnly()) {
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

/** Wire the title: click, Enter or Space renames the open dialog. */
export function bindHeader() {
  $("chat-title").addEventListener("click", renameCurrentFromHeader);
  $("chat-title").addEventListener("keydown", function (event) {
    if (event.key === "Enter" || event.key === " ") {
      event.preventDefault();
      renameCurrentFromHeader();
    }
  });
}
