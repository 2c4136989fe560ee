/*
 * The dialog list (E1, B1-B3): the web chat's dialogs grouped by day, then the chat-app
 * dialogs linked to this user (Telegram, Feishu) under their platform with a read-only
 * badge where they cannot be written to; unread marks; new / switch / rename / delete as
 * silent slash commands; the slide-over on a phone.
 */
import { carryAction } from "./carry.js";
import { isDraft } from "./draft.js";
import { cleanTitle, dayGroup, fullTime, isLinked, platformName, relativeTime } from "./format.js";
import { history, store } from "./state.js";
import { send, sendCommand } from "./transport.js";
import { $, cssEscape, el, icon, LANG, randomId, t, toast } from "./ui.js";

export function renderSidebar() {
  var list = $("dialog-list");
  if (list.querySelector(".dialog-rename")) {
    return; // never pull the field from under the reader's fingers; redrawn when done
  }
  var sessions = store.sessions();
  var frag = document.createDocumentFragment();
  var currentGroup = null;
  var ul = null;
  if (isDraft()) {
    frag.appendChild(draftItem());
  } else if (!sessions.length) {
    frag.appendChild(el("p", "dialog-empty", store.loadedOnce() ? t("no_dialogs") : ""));
  }
  function startGroup(label, className) {
    frag.appendChild(el("h2", "dialog-group" + (className ? " " + className : ""), label));
    ul = el("ul", "dialog-group-list");
    ul.setAttribute("role", "list");
    frag.appendChild(ul);
  }
  var linked = [];
  sessions.forEach(function (item) {
    if (isLinked(item.session_id)) {
      linked.push(item);
      return;
    }
    var group = dayGroup(item.last_active_at);
    if (group !== currentGroup) {
      currentGroup = group;
      startGroup(t(group));
    }
    ul.appendChild(dialogItem(item));
  });
  // Linked chat-app dialogs: one group per platform, after the web chat's own.
  currentGroup = null;
  linked.forEach(function (item) {
    if (item.channel !== currentGroup) {
      currentGroup = item.channel;
      // The user's own API and terminal dialogs, then linked chat apps (issue 54).
      var own = item.channel === "api" || item.channel === "cli";
      startGroup(
        own ? t("channel_" + item.channel) : t("linked_group", { platform: platformName(item.channel) }),
        "dialog-group-linked"
      );
    }
    ul.appendChild(dialogItem(item));
  });
  list.replaceChildren(frag);
  $("menu-unread").hidden = !store.anyUnread();
}

/** The draft dialog on top of the list (stored with its first message, issue 54). */
function draftItem() {
  var ul = el("ul", "dialog-group-list");
  ul.setAttribute("role", "list");
  var li = el("li", "dialog-item is-current is-draft");
  var open = el("button", "dialog-open");
  open.type = "button";
  open.setAttribute("aria-current", "true");
  open.appendChild(el("span", "dialog-title", t("new_dialog")));
  var meta = el("span", "dialog-meta");
  meta.appendChild(el("span", "dialog-time", t("draft_unsaved")));
  open.appendChild(meta);
  open.addEventListener("click", function () {
    closeSidebar();
    $("composer-input").focus();
  });
  li.appendChild(open);
  ul.appendChild(li);
  return ul;
}

function dialogItem(item) {
  var li = el("li", "dialog-item");
  li.dataset.dialogId = item.dialog_id;
  li.dataset.sessionId = item.session_id;
  var isCurrent = item.session_id === history.sessionId;
  var unread = store.isUnread(item.session_id);
  li.classList.toggle("is-current", isCurrent);
  li.classList.toggle("is-unread", unread);

  var open = el("button", "dialog-open");
  open.type = "button";
  if (isCurrent) {
    open.setAttribute("aria-current", "true");
  }
  var title = el("span", "dialog-title", item.title || item.dialog_id);
  var meta = el("span", "dialog-meta");
  var when = el("time", "dialog-time", relativeTime(item.last_active_at, LANG, t("just_now")));
  when.dateTime = item.last_active_at;
  when.title = fullTime(item.last_active_at, LANG);
  meta.appendChild(when);
  if (item.read_only) {
    meta.appendChild(el("span", "dialog-badge", t("read_only")));
  }
  open.appendChild(title);
  open.appendChild(meta);
  if (unread) {
    var dot = el("span", "unread-dot");
    dot.setAttribute("role", "img");
    dot.setAttribute("aria-label", t("unread"));
    open.appendChild(dot);
  }
  open.addEventListener("click", function () {
    switchTo(item);
  });
  li.appendChild(open);
  if (item.read_only) {
    return li; // nothing to rename or delete
  }

  var more = el("button", "icon-btn dialog-more");
  more.type = "button";
  more.setAttribute("aria-label", t("options_for", { title: item.title || item.dialog_id }));
  more.setAttribute("aria-haspopup", "menu");
  more.setAttribute("aria-expanded", "false");
  more.appendChild(icon("more"));
  more.addEventListener("click", function (event) {
    event.stopPropagation();
    openMenu(item, more);
  });
  li.appendChild(more);
  return li;
}

function switchTo(item) {
  closeMenu();
  if (item.session_id === history.sessionId) {
    closeSidebar();
    return;
  }
  if (isLinked(item.session_id) ? openLinked(item) : sendCommand("/switch " + item.dialog_id, true)) {
    $("app").classList.add("is-switching");
    setTimeout(function () {
      $("app").classList.remove("is-switching");
    }, 400);
  }
}

/** Open a linked chat-app dialog (/switch only knows the web chat's): its history, and
 * its live answers from now on. */
export function openLinked(item) {
  var id = randomId();
  if (!send({ type: "history", session_id: item.session_id, follow: true, client_msg_id: id })) {
    toast(t("offline_cannot_send"), "error");
    return false;
  }
  return true;
}

// --- The dialog menu: rename, delete --------------------------------------------------------

function openMenu(item, anchor) {
  var menu = $("dialog-menu");
  var open = store.menuFor();
  if (open && open.item.session_id === item.session_id && !menu.hidden) {
    closeMenu();
    return;
  }
  closeMenu();
  store.setMenuFor({ item: item, anchor: anchor });
  anchor.setAttribute("aria-expanded", "true");
  menu.hidden = false;
  var rect = anchor.getBoundingClientRect();
  var width = menu.offsetWidth;
  menu.style.top = Math.min(window.innerHeight - menu.offsetHeight - 8, rect.bottom + 4) + "px";
  menu.style.left = Math.max(8, Math.min(window.innerWidth - width - 8, rect.right - width)) + "px";
  menu.querySelector(".menu-item").focus();
}

export function closeMenu() {
  var menu = $("dialog-menu");
  var open = store.menuFor();
  if (open) {
    open.anchor.setAttribute("aria-expanded", "false");
  }
  store.setMenuFor(null);
  menu.hidden = true;
}

function menuAction(action) {
  var target = store.menuFor();
  closeMenu();
  if (!target) {
    return;
  }
  if (action === "rename") {
    startRename(target.item);
  } else if (action === "delete") {
    confirmDelete(target.item);
  } else {
    carryAction(action, target.item); // export, share (H2)
  }
}

/** Run a command on one dialog of the list (`dialog_id` picks it; no switch needed). */
function commandOn(item, text) {
  sendCommand(text, true, item);
}

function startRename(item) {
  var li = document.querySelector('.dialog-item[data-session-id="' + cssEscape(item.session_id) + '"]');
  if (!li) {
    return;
  }
  openSidebarIfMobile();
  var input = el("input", "dialog-rename");
  input.type = "text";
  input.value = item.title || "";
  input.maxLength = 200;
  input.setAttribute("aria-label", t("rename_label"));
  li.replaceChildren(input);
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
    if (commit && title && title !== item.title) {
      store.setTitle(item.session_id, title); // optimistic; `session_updated` brings the stored one
      commandOn(item, "/rename " + title);
    }
    renderSidebar();
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

function confirmDelete(item) {
  var dialog = $("confirm-dialog");
  $("confirm-body").textContent = t("delete_body", { title: item.title || item.dialog_id });
  dialog.returnValue = "";
  dialog.onclose = function () {
    if (dialog.returnValue === "confirm") {
      commandOn(item, "/delete");
    }
  };
  dialog.showModal();
  $("confirm-cancel").focus();
}

// --- Mobile slide-over ----------------------------------------------------------------------

function isNarrow() {
  return window.matchMedia("(max-width: 768px)").matches;
}

function openSidebar() {
  $("app").classList.add("sidebar-open");
  $("scrim").hidden = false;
  $("menu-button").setAttribute("aria-expanded", "true");
  var current = document.querySelector(".dialog-item.is-current .dialog-open");
  (current || $("new-dialog")).focus();
}

function openSidebarIfMobile() {
  if (isNarrow()) {
    $("app").classList.add("sidebar-open");
    $("scrim").hidden = false;
    $("menu-button").setAttribute("aria-expanded", "true");
  }
}

export function isSidebarOpen() {
  return $("app").classList.contains("sidebar-open");
}

export function closeSidebar() {
  if (!isSidebarOpen()) {
    return;
  }
  $("app").classList.remove("sidebar-open");
  $("scrim").hidden = true;
  $("menu-button").setAttribute("aria-expanded", "false");
}

/** Wire the list's buttons, the dialog menu (click, arrows, Tab, outside click) and the
 * slide-over. */
export function bindSidebar() {
  // "New dialog" is newdialog.js's (a draft until its first message).
  $("menu-button").addEventListener("click", openSidebar);
  $("sidebar-close").addEventListener("click", closeSidebar);
  $("scrim").addEventListener("click", closeSidebar);
  $("dialog-menu").addEventListener("click", function (event) {
    var item = event.target.closest(".menu-item");
    if (item) {
      menuAction(item.dataset.action);
    }
  });
  $("dialog-menu").addEventListener("keydown", function (event) {
    var items = Array.prototype.slice.call($("dialog-menu").querySelectorAll(".menu-item"));
    var index = items.indexOf(document.activeElement);
    if (event.key === "ArrowDown" || event.key === "ArrowUp") {
      event.preventDefault();
      var next = (index + (event.key === "ArrowDown" ? 1 : -1) + items.length) % items.length;
      items[next].focus();
    } else if (event.key === "Tab") {
      closeMenu();
    }
  });
  document.addEventListener("click", function (event) {
    if (!$("dialog-menu").hidden && !event.target.closest("#dialog-menu")) {
      closeMenu();
    }
  });
}
