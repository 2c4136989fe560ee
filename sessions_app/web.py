"""The web chat page (E1): one template whose static JS speaks PROTOCOL `/ws/chat/`.

The page itself holds no dialog data: the socket sends `sessions` and `session_history` on
connect. The view only hands the script its configuration (socket path, limits, the user's
display name) and the translated strings it shows (F5), as a `json_script` block.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.middleware.csrf import get_token
from django.shortcuts import render
from django.urls import reverse
from django.utils.translation import get_language
from django.utils.translation import gettext as _
from django.views.decorators.cache import never_cache

from .web_carry import carry_strings
from .web_settings import settings_config, settings_strings

WS_PATH = "/ws/chat/"


def js_strings() -> dict[str, str]:
    """Every string app.js shows, translated for this request. Placeholders use the Python
    `%(name)s` form so translators see the usual Django format."""
    return {
        "app_name": _("Chat"),
        "connecting": _("Connecting…"),
        "connected": _("Connected"),
        "reconnecting": _("Reconnecting…"),
        "reconnecting_in": _("Connection lost. Reconnecting in %(seconds)s s…"),
        "offline_cannot_send": _("You are offline. Your message was not sent."),
        "too_long": _("This message is too long (%(n)s characters; the limit is %(limit)s)."),
        "rename": _("Rename"),
        "rename_label": _("New title"),
        "delete": _("Delete"),
        "options_for": _("Options for %(title)s"),
        "delete_body": _("“%(title)s” will be removed from your list."),
        "no_dialogs": _("No dialogs yet"),
        "unread": _("New messages"),
        "today": _("Today"),
        "yesterday": _("Yesterday"),
        "previous_7_days": _("Previous 7 days"),
        "older": _("Older"),
        "just_now": _("just now"),
        "sending": _("Sending…"),
        "queued": _("Queued"),
        "queued_ahead": _("Queued · %(n)s ahead"),
        "starting": _("Starting…"),
        "compacted": _("Older messages were summarised to keep the conversation in context."),
        "not_sent": _("Not sent: %(message)s"),
        "not_confirmed": _("The connection dropped before this message was confirmed."),
        "edit": _("Edit"),
        "dismiss": _("Dismiss"),
        "resend": _("Resend"),
        "stop": _("Stop"),
        "stopping": _("Stopping…"),
        "retry": _("Retry"),
        "thinking": _("Thinking…"),
        "streaming": _("Answering…"),
        "answer_done": _("Answer complete."),
        "answer_stopped": _("You stopped this answer."),
        "answer_interrupted": _("This answer was interrupted."),
        "answer_failed": _("The answer failed: %(message)s"),
        "answer_failed_generic": _("The answer failed."),
        "status_stopped": _("stopped"),
        "status_interrupted": _("interrupted"),
        "stopped_before_text": _("Stopped before any text was written."),
        "status_truncated": _("cut off at the length limit"),
        "status_filtered": _("stopped by the content filter"),
        "continue": _("Continue"),
        "tool_running": _("running"),
        "tool_ok": _("done"),
        "tool_error": _("failed"),
        "tool_result": _("Result of %(name)s"),
        "copy": _("Copy"),
        "copied": _("Copied"),
        "copy_code": _("Copy code"),
        "image": _("Image: %(label)s"),
        "empty_title": _("Hello, %(name)s"),
        "empty_body": _("Ask anything: your first message starts the dialog."),
        "loading_older": _("Loading earlier messages…"),
        "esc_to_stop": _("Esc to stop"),
        "hint": _("Enter to send · Shift+Enter for a new line"),
        "error_generic": _("Something went wrong."),
        "close": _("Close"),
        "steer": _("steer"),
        "context": _("context"),
        "linked_group": _("%(platform)s (linked)"),
        "regenerate": _("Regenerate"),
        "edit_label": _("Edit your message"),
        "edit_hint": _("Enter to save and send · Esc to cancel"),
        "save_and_send": _("Save and send"),
        "cancel": _("Cancel"),
        "previous_version": _("Previous version"),
        "next_version": _("Next version"),
        "version_of": _("Version %(n)s of %(total)s"),
        "attach_pasted": _("pasted image"),
        "attach_too_many": _("At most %(n)s files per message."),
        "attach_too_large": _("%(name)s is too large (at most %(limit)s)."),
        "attach_failed": _("Upload failed."),
        "attach_refused": _("%(name)s was not attached: %(message)s"),
        "attach_uploading": _("Uploading %(name)s"),
        "attach_ready": _("%(name)s attached."),
        "attach_remove": _("Remove %(name)s"),
        "attach_wait": _("Wait until the files have uploaded."),
        "read_only": _("read-only"),
        "read_only_placeholder": _("Read-only dialog"),
        # Issue 54: the web chat in daily use.
        "new_dialog": _("New dialog"),
        "draft_unsaved": _("saved with its first message"),
        "queued_returned": _(
            "Stopped. Your queued message was not sent; its text is back in the composer."
        ),
        "send_as_message": _("Send as a message"),
        "draft_command": _("Send a first message to start this dialog, then use commands on it."),
        "notice_truncated": _("The answer was cut off because it reached the length limit."),
        "notice_filtered": _("The model's content filter stopped the answer."),
        "notice_empty": _("The model returned an empty answer."),
        "channel_api": _("API dialogs"),
        "channel_cli": _("Terminal dialogs"),
        "shortcut_new_dialog": _("Start a new dialog"),
        "shortcut_search": _("Search your dialogs"),
        "shortcut_send": _("Send the message"),
        "shortcut_new_line": _("New line in the message"),
        "shortcut_edit_last": _("Edit your last message (in an empty composer)"),
        "shortcut_stop": _("Stop the answer, or close what is open"),
        "shortcut_help": _("Show these shortcuts"),
        "read_only_note": _(
            "This %(platform)s dialog is read-only for you: its messages and answers appear "
            "here, but you write to it from %(platform)s."
        ),
        **carry_strings(),
    }


@never_cache
@login_required
def chat_page(request: HttpRequest) -> HttpResponse:
    user: Any = request.user
    display_name = (user.get_full_name() or "").strip() or user.get_username()
    config = {
        "ws_path": WS_PATH,
        "login_url": reverse("login"),
        "csrf_token": get_token(request),
        "language": get_language() or settings.LANGUAGE_CODE,
        "content_limit": settings.CHAT["CONTENT_LIMIT"],
        # H3: uploads (static/chat/attachments.js).
        "files_url": reverse("api-v1:upload_file"),
        "upload_max_bytes": settings.CHAT["UPLOAD_MAX_BYTES"],
        "attachments_max": settings.CHAT["ATTACHMENTS_MAX"],
        "user": {"username": user.get_username(), "display_name": display_name},
        "strings": {**js_strings(), **settings_strings()},
        # H4: the model picker, the settings panel and the usage under each answer.
        "dialog_settings": settings_config(),
    }
    return render(
        request,
        "chat/index.html",
        {"chat_config": config, "display_name": display_name},
    )
