"""What the web chat's dialog settings (SPEC H4, `static/chat/settings.js`) need from the page:
the API addresses it reads (the model list, a turn's usage) and its translated strings (F5)."""

from __future__ import annotations

from typing import Any

from django.utils.translation import gettext as _

from chatcore.common.llm_models import SYSTEM_PROMPT_MAX

API_BASE = "/api/v1"


def settings_config() -> dict[str, Any]:
    return {
        "models_url": f"{API_BASE}/models",
        "turns_url": f"{API_BASE}/turns/",
        "system_prompt_max": SYSTEM_PROMPT_MAX,
        # A longer list gets a search field.
        "search_after": 8,
    }


def settings_strings() -> dict[str, str]:
    return {
        "model_for_dialog": _("Model for this dialog: %(model)s"),
        "model_changed": _("This dialog now uses %(model)s."),
        "models_unavailable": _("The list of models could not be loaded."),
        "no_models_match": _("No model matches."),
        "settings_saved": _("Dialog settings saved."),
        "prompt_count": _("%(n)s / %(max)s characters"),
        "prompt_too_long": _("The system prompt is too long."),
        "usage": _("Tokens"),
        "usage_label": _("Tokens this answer used"),
        "usage_line": _("%(prompt)s in (%(cached)s cached) · %(completion)s out"),
        "usage_unavailable": _("No usage reported."),
    }
