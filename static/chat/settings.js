/*
 * The open dialog's settings (SPEC H4, PROTOCOL "Models and dialog settings"): the model
 * picker in the header (searchable when the list is long), the settings panel with the
 * system prompt, and the tokens each answer used (under it, on hover or focus).
 *
 * The server keeps the settings per dialog: a choice goes out as a `settings` frame and
 * shows once its `session_updated` comes back; the next send asks that model. The model
 * list comes from GET /api/v1/models, the usage of an answer from GET /api/v1/turns/{id}.
 * Hooks: `settingsFrame(frame)` sees every server frame after frames.js handled it,
 * `bindSettings()` runs once (app.js).
 */
import { store } from "./state.js";
import { aim, send } from "./transport.js";
import { $, config, el, randomId, t, toast } from "./ui.js";

var CFG = config.dialog_settings || {};
var SEARCH_AFTER = CFG.search_after || 8;
var PROMPT_MAX = CFG.system_prompt_max || 20000;
var LIST_TTL_MS = 5 * 60 * 1000;

// The open dialog's settings as the server last said, and the model list.
var current = { sessionId: null, model: "", systemPrompt: "" };
var models = [];
var modelsAt = 0;
var modelsLoading = null;
// client_msg_id -> true for the `settings` frames this page sent (their errors are ours).
var asked = {};
// turn id -> {usage, model} (or null while it loads), read once per page.
var usages = {};

// --- Frames -------------------------------------------------------------------------------

/** Every server frame passes here first (frames.js); the ones about settings update the
 * header and the panel. */
export function settingsFrame(frame) {
  var opened = frame.type === "session_history" || window.ChatHistory.isResume(frame);
  if (opened && frame.model != null) {
    setCurrent(frame.session_id, frame.model, frame.system_prompt || "");
  } else if (frame.type === "sessions") {
    // A reconnect that resumes with a delta gets no `session_history`: the list's item
    // says the open dialog's model. Whether it is read-only may have changed too.
    (frame.items || []).forEach(function (item) {
      if (item.session_id === current.sessionId && item.model) {
        current.model = item.model;
      }
    });
    renderButton();
  } else if (frame.type === "session_updated" && frame.session_id === current.sessionId) {
    var changed = frame.model != null && frame.model !== current.model;
    if (frame.model != null || frame.system_prompt != null) {
      setCurrent(
        frame.session_id,
        frame.model != null ? frame.model : current.model,
        frame.system_prompt != null ? frame.system_prompt : current.systemPrompt
      );
    }
    if (frame.client_msg_id && asked[frame.client_msg_id]) {
      delete asked[frame.client_msg_id];
      toast(changed ? t("model_changed", { model: current.model }) : t("settings_saved"), "info");
    }
  } else if (frame.type === "error" && frame.client_msg_id) {
    delete asked[frame.client_msg_id]; // frames.js shows the error
  }
}

function setCurrent(sessionId, model, systemPrompt) {
  current = { sessionId: sessionId, model: model || "", systemPrompt: systemPrompt || "" };
  renderButton();
}

function renderButton() {
  var button = $("model-button");
  var readOnly = store.isReadOnly();
  $("model-name").textContent = current.model;
  button.title = t("model_for_dialog", { model: current.model });
  button.setAttribute("aria-label", t("model_for_dialog", { model: current.model }));
  button.disabled = !current.sessionId || readOnly;
  $("settings-button").disabled = !current.sessionId || readOnly;
  $("dialog-settings").hidden = !current.sessionId;
}

function sendSettings(fields) {
  var id = randomId();
  var frame = aim(Object.assign({ type: "settings", client_msg_id: id }, fields));
  if (!send(frame)) {
    toast(t("offline_cannot_send"), "error");
    return false;
  }
  asked[id] = true;
  return true;
}

// --- The model list ------------------------------------------------------------------------

function loadModels() {
  if (modelsLoading) {
    return modelsLoading;
  }
  if (models.length && Date.now() - modelsAt < LIST_TTL_MS) {
    return Promise.resolve(models);
  }
  modelsLoading = fetch(CFG.models_url, { credentials: "same-origin", headers: { Accept: "application/json" } })
    .then(function (response) {
      if (!response.ok) {
        throw new Error(String(response.status));
      }
      return response.json();
    })
    .then(function (data) {
      models = (data.items || []).map(function (item) {
        return item.id;
      });
      modelsAt = Date.now();
      return models;
    })
    .finally(function () {
      modelsLoading = null;
    });
  return modelsLoading;
}

// --- The picker ----------------------------------------------------------------------------

function isPickerOpen() {
  return !$("model-picker").hidden;
}

function openPicker() {
  loadModels().then(
    function () {
      showPicker();
    },
    function () {
      toast(t("models_unavailable"), "error");
    }
  );
}

function showPicker() {
  var picker = $("model-picker");
  var button = $("model-button");
  var search = $("model-search");
  search.value = "";
  search.hidden = models.length <= SEARCH_AFTER;
  renderOptions("");
  picker.hidden = false;
  var box = button.getBoundingClientRect();
  var width = picker.offsetWidth;
  picker.style.top = Math.round(box.bottom + 4) + "px";
  picker.style.left = Math.round(Math.max(8, Math.min(box.left, window.innerWidth - width - 8))) + "px";
  button.setAttribute("aria-expanded", "true");
  if (!search.hidden) {
    search.focus();
  } else {
    focusOption(selectedIndex());
  }
}

function closePicker(refocus) {
  if (!isPickerOpen()) {
    return;
  }
  $("model-picker").hidden = true;
  $("model-button").setAttribute("aria-expanded", "false");
  if (refocus) {
    $("model-button").focus();
  }
}

function options() {
  return Array.prototype.slice.call($("model-list").querySelectorAll(".model-option"));
}

function selectedIndex() {
  var all = options();
  for (var i = 0; i < all.length; i++) {
    if (all[i].dataset.model === current.model) {
      return i;
    }
  }
  return 0;
}

function renderOptions(query) {
  var list = $("model-list");
  list.textContent = "";
  var words = query.toLowerCase().split(/\s+/).filter(Boolean);
  var shown = models.filter(function (name) {
    var lower = name.toLowerCase();
    return words.every(function (w) {
      return lower.indexOf(w) >= 0;
    });
  });
  shown.forEach(function (name) {
    var option = el("button", "model-option", name);
    option.type = "button";
    option.setAttribute("role", "option");
    option.dataset.model = name;
    option.tabIndex = -1;
    option.setAttribute("aria-selected", name === current.model ? "true" : "false");
    option.addEventListener("click", function () {
      pick(name);
    });
    list.appendChild(option);
  });
  var empty = $("model-empty");
  empty.hidden = shown.length > 0;
  empty.textContent = t("no_models_match");
}

function focusOption(index) {
  var all = options();
  if (!all.length) {
    return;
  }
  var i = (index + all.length) % all.length;
  all.forEach(function (option, j) {
    option.tabIndex = j === i ? 0 : -1;
  });
  all[i].focus();
}

function pick(name) {
  closePicker(true);
  if (name === current.model) {
    return;
  }
  sendSettings({ model: name });
}

function onPickerKey(event) {
  var all = options();
  var at = all.indexOf(document.activeElement);
  if (event.key === "Escape") {
    // Close the picker only: not the answer that may be running (app.js's Esc).
    event.preventDefault();
    event.stopPropagation();
    closePicker(true);
  } else if (event.key === "ArrowDown") {
    event.preventDefault();
    focusOption(at < 0 ? 0 : at + 1);
  } else if (event.key === "ArrowUp") {
    event.preventDefault();
    focusOption(at < 0 ? all.length - 1 : at - 1);
  } else if (event.key === "Home" && at >= 0) {
    event.preventDefault();
    focusOption(0);
  } else if (event.key === "End" && at >= 0) {
    event.preventDefault();
    focusOption(all.length - 1);
  } else if (event.key === "Enter" && event.target === $("model-search") && all.length) {
    event.preventDefault();
    pick(all[0].dataset.model);
  } else if (event.key === "Tab") {
    closePicker(false);
  }
}

// --- The settings panel --------------------------------------------------------------------

function openPanel() {
  var dialog = $("settings-dialog");
  var area = $("settings-prompt");
  area.value = current.systemPrompt;
  $("settings-model").textContent = t("model_for_dialog", { model: current.model });
  renderCount();
  dialog.returnValue = "";
  dialog.showModal();
  area.focus();
}

function renderCount() {
  var n = $("settings-prompt").value.length;
  var count = $("settings-count");
  count.textContent = t("prompt_count", { n: n, max: PROMPT_MAX });
  count.classList.toggle("is-over", n > PROMPT_MAX);
  $("settings-save").disabled = n > PROMPT_MAX;
}

function onPanelClose() {
  var dialog = $("settings-dialog");
  $("settings-button").focus();
  if (dialog.returnValue !== "save") {
    return;
  }
  var value = $("settings-prompt").value;
  if (value.length > PROMPT_MAX) {
    toast(t("prompt_too_long"), "error");
    return;
  }
  if (value.trim() !== current.systemPrompt) {
    sendSettings({ system_prompt: value });
  }
}

// --- Usage under each answer ---------------------------------------------------------------

function formatNumber(n) {
  return Number(n || 0).toLocaleString(config.language || undefined);
}

function usageLine(turn) {
  var usage = turn.usage;
  var line = !usage || !(usage.prompt_tokens || usage.completion_tokens)
    ? t("usage_unavailable")
    : t("usage_line", {
        prompt: formatNumber(usage.prompt_tokens),
        cached: formatNumber(usage.cached_tokens),
        completion: formatNumber(usage.completion_tokens),
      });
  return turn.model ? line + " · " + turn.model : line;
}

function showUsage(button) {
  var turn = button.dataset.turn;
  var line = button.parentNode.querySelector(".msg-usage");
  if (usages[turn] !== undefined) {
    if (usages[turn] !== null) {
      line.textContent = usageLine(usages[turn]);
      line.hidden = false;
    }
    return;
  }
  usages[turn] = null;
  fetch(CFG.turns_url + encodeURIComponent(turn), {
    credentials: "same-origin",
    headers: { Accept: "application/json" },
  })
    .then(function (response) {
      return response.ok ? response.json() : null;
    })
    .then(
      function (data) {
        if (!data || data.status === "queued" || data.status === "running") {
          delete usages[turn];
          return;
        }
        usages[turn] = { usage: data.usage || {}, model: data.model || "" };
        line.textContent = usageLine(usages[turn]);
        line.hidden = false;
      },
      function () {
        delete usages[turn];
      }
    );
}

/** Each answer that ends a turn gets a "Tokens" button: hover, focus or click shows what the
 * model reported for that turn. */
function decorateAnswers() {
  var nodes = document.querySelectorAll("#messages .msg-assistant[data-turn]");
  var last = {};
  nodes.forEach(function (node) {
    last[node.dataset.turn] = node;
  });
  Object.keys(last).forEach(function (turn) {
    var bar = last[turn].querySelector(".msg-actions");
    if (!bar || bar.querySelector(".usage-btn")) {
      return;
    }
    var button = el("button", "msg-action usage-btn", t("usage"));
    button.type = "button";
    button.dataset.turn = turn;
    button.setAttribute("aria-label", t("usage_label"));
    var line = el("span", "msg-usage");
    line.hidden = true;
    line.setAttribute("role", "status");
    ["mouseenter", "focus", "click"].forEach(function (kind) {
      button.addEventListener(kind, function () {
        showUsage(button);
      });
    });
    bar.appendChild(button);
    bar.appendChild(line);
  });
}

// --- Wiring --------------------------------------------------------------------------------

export function bindSettings() {
  $("model-button").addEventListener("click", function () {
    if (isPickerOpen()) {
      closePicker(true);
    } else {
      openPicker();
    }
  });
  $("model-picker").addEventListener("keydown", onPickerKey);
  $("model-search").addEventListener("input", function () {
    renderOptions($("model-search").value);
  });
  document.addEventListener("pointerdown", function (event) {
    if (isPickerOpen() && !$("model-picker").contains(event.target) && !$("model-button").contains(event.target)) {
      closePicker(false);
    }
  });
  window.addEventListener("resize", function () {
    closePicker(false);
  });
  $("settings-button").addEventListener("click", openPanel);
  $("settings-prompt").addEventListener("input", renderCount);
  var dialog = $("settings-dialog");
  dialog.addEventListener("close", onPanelClose);
  dialog.addEventListener("keydown", function (event) {
    if (event.key === "Escape") {
      // The panel closes itself; the running answer goes on.
      event.stopPropagation();
    }
  });
  new MutationObserver(decorateAnswers).observe($("messages"), { childList: true, subtree: true });
  decorateAnswers();
  renderButton();
}
