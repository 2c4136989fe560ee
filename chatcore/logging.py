"""Structured log lines (F4): `ts level logger message key=value ...`.

Session and turn ids travel as `extra={"session_id": ..., "turn_id": ...}`. Secrets are
scrubbed here as a last line of defence; callers never log keys in the first place.
"""

from __future__ import annotations

import json
import logging
import re

_CONTEXT_KEYS = ("session_id", "turn_id", "channel", "user_id", "kind", "attempt")
_SECRET_PATTERNS = [
    re.compile(r"(?i)(authorization:\s*bearer\s+)[^\s'\"]+"),
    re.compile(r"(?i)(api[_-]?key['\"]?\s*[:=]\s*['\"]?)[^\s'\",]+"),
    re.compile(r"(://[^/:@\s]+:)[^@/\s]+(@)"),
    re.compile(r"\b(sk-)[A-Za-z0-9_\-]{8,}"),
]


def scrub(text: str) -> str:
    """Remove bearer tokens, API keys and URL passwords from text."""
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(
            lambda m: m.group(1) + "***" + (m.group(2) if m.re.groups > 1 else ""), text
        )
    return text


class StructuredFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = scrub(record.getMessage())
        parts = [
            self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            record.levelname,
            record.name,
            json.dumps(message, ensure_ascii=False),
        ]
        for key in _CONTEXT_KEYS:
            value = record.__dict__.get(key)
            if value is not None:
                parts.append(f"{key}={value}")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + scrub(self.formatException(record.exc_info))
        return line
