"""Model names and their context windows as configured (SPEC H4): a leaf every layer reads.

The list the model server offers is the engine's (`chatcore.engine.model_catalog`); this
module only says what the settings say: the default model, the demo provider's name and the
window of a model (`LLM_CONTEXT_WINDOWS`, else `LLM_CONTEXT_WINDOW`).
"""

from __future__ import annotations

from django.conf import settings

# What the demo provider (no `LLM_BASE_URL`) lists and answers as.
DEMO_MODEL = "demo"
SYSTEM_PROMPT_MAX = 20_000


def default_model() -> str:
    """The model of a dialog that chose none, and of titles and summaries."""
    if not settings.LLM["BASE_URL"]:
        return DEMO_MODEL
    return str(settings.LLM["MODEL"])


def context_window(model: str | None = None) -> int:
    """The context window of `model` in tokens (H4), the default window when not listed."""
    windows = settings.LLM.get("CONTEXT_WINDOWS") or {}
    if model and model in windows:
        return int(windows[model])
    return int(settings.LLM["CONTEXT_WINDOW"])
