/*
 * Export, import and share links in the web chat (SPEC H2; PROTOCOL "Search, export,
 * import"): the dialog menu's "Export as JSON / Markdown" (a download of the REST export)
 * and "Share…" (a dialog listing the dialog's links: create, copy, revoke), and the
 * sidebar's "Import a dialog…" (a file picker; the new dialog opens when it is in).
 */
import { copyText } from "./markdown.js";
import { sendCommand } from "./transport.js";
import { $, config, el, t, toast } from "./ui.js";

var API = "/api/v1";

function call(method, path, body) {
  var headers = { "X-CSRFToken": config.csrf_token, Accept: "application/json" };
  if (body != null) {
    headers["Content-Type"] = "application/json";
  }
  return fetch(API + path, { method: method, headers: headers, body: body, credentials: "same-origin" }).then(
    function (response) {
      if (response.status === 204) {
        return null;
      }
      return response.json().then(
        function (data) {
          if (!response.ok) {
            throw new Error((data && data.message) || response.statusText);
          }
          return data;
        },
        function () {
          throw new Error(response.statusText || String(response.status));
        }
      );
    }
  );
}

function exportDialog(item, format) {
  var link = el("a");
  link.href = API + "/sessions/" + encodeURIComponent(item.session_id) + "/export?format=" + format;
  link.download = "";
  link.hidden = true;
  document.body.appendChild(link);
  link.click();
  link.remove();
}

// --- Share links ----------------------------------------------------------------------------

var shareTarget = null;

function absolute(url) {
  return new URL(url, location.origin).href;
}

function shareRow(share) {
  var li = el("li", "share-row");
  var input = el("input", "share-url");
  input.type = "text";
  input.readOnly = true;
  input.value = absolute(share.url);
  input.setAttribute("aria-label", t("share_copy"));
  var copy = el("button", "btn btn-small", t("share_copy"));
  copy.type = "button";
  copy.addEventListener("click", function () {
    copyText(input.value, copy);
  });
  var revoke = el("button", "btn btn-small", t("share_revoke"));
  revoke.type = "button";
  revoke.addEventListener("click", function () {
    call("DELETE", "/shares/" + encodeURIComponent(share.share_id)).then(function () {
      toast(t("share_revoked"), "info");
      loadShares();
    }, failed);
  });
  li.appendChild(input);
  li.appendChild(copy);
  li.appendChild(revoke);
  return li;
}

function failed(error) {
  toast(t("share_failed", { message: error.message }), "error");
}

function loadShares(focusFirst) {
  if (!shareTarget) {
    return Promise.resolve();
  }
  var sessionId = shareTarget.session_id;
  return call("GET", "/shares").then(function (items) {
    var mine = (items || []).filter(function (share) {
      return share.session_id === sessionId;
    });
    var list = $("share-list");
    list.replaceChildren.apply(list, mine.map(shareRow));
    $("share-about").textContent = mine.length ? "" : t("share_none");
    if (focusFirst && mine.length) {
      list.querySelector(".share-url").select();
    }
  }, failed);
}

function openShare(item) {
  shareTarget = item;
  $("share-list").replaceChildren();
  $("share-about").textContent = "";
  $("share-dialog").showModal();
  $("share-create").focus();
  loadShares(false);
}

function createShare() {
  if (!shareTarget) {
    return;
  }
  call("POST", "/sessions/" + encodeURIComponent(shareTarget.session_id) + "/share").then(function () {
    toast(t("share_made"), "info");
    return loadShares(true);
  }, failed);
}

// --- Import ---------------------------------------------------------------------------------

function importFile(file) {
  toast(t("importing"), "info");
  call("POST", "/sessions/import", file).then(
    function (session) {
      toast(t("import_done", { title: session.title }), "info");
      sendCommand("/switch " + session.dialog_id, true);
    },
    function (error) {
      toast(t("import_failed", { message: error.message }), "error");
    }
  );
}

/** The dialog menu's actions of this module; false for one it does not know. */
export function carryAction(action, item) {
  if (action === "export-json" || action === "export-markdown") {
    exportDialog(item, action === "export-json" ? "json" : "markdown");
  } else if (action === "share") {
    openShare(item);
  } else {
    return false;
  }
  return true;
}

export function bindCarry() {
  $("share-create").addEventListener("click", createShare);
  $("share-dialog").addEventListener("close", function () {
    shareTarget = null;
  });
  $("import-button").addEventListener("click", function () {
    $("import-file").click();
  });
  $("import-file").addEventListener("change", function () {
    var file = $("import-file").files[0];
    $("import-file").value = "";
    if (file) {
      importFile(file);
    }
  });
}
