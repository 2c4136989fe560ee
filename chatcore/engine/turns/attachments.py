"""How a user message with attachments becomes the model's content parts (SPEC H3, PROTOCOL
"Files and images"): its text part, then each image as an `image_url` part holding a data
URL of its bytes, and each text or PDF file as a text part with its name and its text.

A file's text is trimmed to its share of the builder's context budget (the builder then
counts the parts: `tokens.TokenCounter.count_message`); the stored file is never changed. A
file deleted since (its dialog's purge never runs while the dialog is read, but its owner
may be deleted) becomes a short note. Runs where the turn's input is built, on a database
thread; the result is kept with the message in the history cache, so a file is read once.
"""

from __future__ import annotations

import base64
from typing import Any

from django.conf import settings

from sessions_app import files
from sessions_app.file_models import File, FileKind

# Of the builder's budget, the share all the files of one message may take, and the
# characters a token is assumed to hold at least (code and prose run 3-4; CJK less, which
# the builder's count then catches).
FILES_BUDGET_SHARE = 0.5
CHARS_PER_TOKEN = 3
TRIMMED_NOTE = "\n[... the rest of this file was left out: it is longer than the context allows]"


def text_budget_chars() -> int:
    """The characters of file text one message may give the model."""
    window = int(settings.LLM["CONTEXT_WINDOW"])
    ratio = float(settings.CHAT["COMPACTION_BUDGET_RATIO"])
    return max(1000, int(window * ratio * FILES_BUDGET_SHARE * CHARS_PER_TOKEN))


def content_parts(text: str, refs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content parts of a user message with the attachments `refs` (as the message
    carries them)."""
    ids = [str(r.get("file_id", "")) for r in refs]
    found = {str(f.pk): f for f in File.objects.filter(pk__in=[i for i in ids if i])}
    texts = sum(1 for f in found.values() if f.kind != FileKind.IMAGE)
    share = text_budget_chars() // max(1, texts)
    parts: list[dict[str, Any]] = []
    if text:
        parts.append({"type": "text", "text": text})
    for ref, file_id in zip(refs, ids, strict=True):
        file = found.get(file_id)
        if file is None:
            parts.append(
                {"type": "text", "text": f"[attachment {ref.get('name', '')}: no longer available]"}
            )
            continue
        if file.kind == FileKind.IMAGE:
            parts.append(_image_part(file))
            continue
        body = file.text
        if len(body) > share:
            body = body[:share] + TRIMMED_NOTE
        if not body.strip():
            body = "[no text could be extracted from this file]"
        parts.append({"type": "text", "text": f"File: {file.name}\n\n{body}"})
    return parts


def _image_part(file: File) -> dict[str, Any]:
    data = base64.b64encode(files.file_bytes(file)).decode("ascii")
    return {"type": "image_url", "image_url": {"url": f"data:{file.content_type};base64,{data}"}}


def append_text(content: Any, text: str) -> Any:
    """`content` (a text or a list of parts) with `text` added to its text: the runtime block
    the builder puts on the last user message (C7)."""
    if isinstance(content, str):
        return content + text
    parts = list(content)
    if parts and parts[0].get("type") == "text":
        parts[0] = {**parts[0], "text": parts[0]["text"] + text}
    else:
        parts.insert(0, {"type": "text", "text": text.lstrip()})
    return parts


def text_of(content: Any) -> str:
    """The text of a content (a text or a list of parts), images left out."""
    if isinstance(content, str):
        return content
    if not content:
        return ""
    return "\n\n".join(
        str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
    )
