/*
 * "New dialog" (issue 54): the page empties into a draft (draft.js) that is stored only with
 * its first message; clicking again keeps the same draft. Also the Ctrl/⌘+Shift+O shortcut.
 */
import { renderPending, updateReadOnly, updateRunning } from "./composer.js";
import { enterDraft } from "./draft.js";
import { renderHeader } from "./header.js";
import { clearTurnNote, renderOlderIndicator, renderTranscript, updateEmpty } from "./render.js";
import { closeMenu, closeSidebar, renderSidebar } from "./sidebar.js";
import { history, store } from "./state.js";
import { removeStreaming } from "./stream.js";
import { $ } from "./ui.js";

/** Show an empty draft dialog (or keep the one shown), ready to type in. */
export function startDraft() {
  closeMenu();
  closeSidebar();
  if (enterDraft()) {
    history.reset();
    store.resetTurns();
    store.setOlder(null);
    removeStreaming();
    renderTranscript();
    clearTurnNote();
    renderPending();
    renderOlderIndicator();
    updateEmpty();
    renderHeader();
    renderSidebar();
    updateReadOnly();
    updateRunning();
    if (location.hash) {
      window.history.replaceState(null, "", location.pathname + location.search);
    }
  }
  $("composer-input").focus();
}

export function bindNewDialog() {
  $("new-dialog").addEventListener("click", startDraft);
}
