"""The web chat's strings for search, export, import and share links (SPEC H2), merged into
the page's `chat-config` by `web.js_strings` (F5: every string in both languages)."""

from __future__ import annotations

from django.utils.translation import gettext as _


def carry_strings() -> dict[str, str]:
    return {
        "search_no_results": _("No matches"),
        "search_count": _("Matches: %(n)s"),
        "search_in_title": _("Title"),
        "search_you": _("You"),
        "search_assistant": _("Assistant"),
        "export_json": _("Export as JSON"),
        "export_markdown": _("Export as Markdown"),
        "share": _("Share…"),
        "share_create": _("Create a link"),
        "share_copy": _("Copy link"),
        "share_revoke": _("Revoke"),
        "share_none": _("No links yet. A link shows the dialog as it is when you make it."),
        "share_made": _("Link created."),
        "share_revoked": _("Link revoked."),
        "share_failed": _("Could not change the links: %(message)s"),
        "import_done": _("Imported “%(title)s”."),
        "import_failed": _("Import failed: %(message)s"),
        "importing": _("Importing…"),
    }
