"""Model answers (Markdown) in the shape each platform renders, in pieces that fit its
message length limit without breaking a code block."""

from __future__ import annotations

import html
import re
from collections.abc import Callable

FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+#.-]*)\s*$")
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\[([^\]\n]+)\]\((https?://[^\s)]+)\)")
_BOLD = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*|__(?=\S)(.+?)(?<=\S)__")
_ITALIC = re.compile(r"(?<![\w*])\*(?=\S)([^*\n]+?)(?<=\S)\*(?![\w*])")
_STRIKE = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_BULLET = re.compile(r"^(\s*)[-*+]\s+")
_QUOTE = re.compile(r"^\s{0,3}>\s?(.*)$")


def split_markdown(text: str, limit: int) -> list[str]:
    """Pieces of at most `limit` characters, cut at line ends where possible. A code block cut
    in two is closed at the end of one piece and opened again (same language) in the next."""
    if len(text) <= limit:
        return [text]
    pieces: list[str] = []
    current: list[str] = []
    size = 0
    fence: tuple[str, str] | None = None  # (marker, language) of an open code block

    def close_piece() -> None:
        nonlocal current, size
        body = "\n".join(current)
        if fence is not None:
            body += "\n" + fence[0]
        pieces.append(body)
        current = [f"{fence[0]}{fence[1]}"] if fence is not None else []
        size = len(current[0]) + 1 if current else 0

    reserve = 8  # room for a closing fence
    for line in text.split("\n"):
        while True:
            room = limit - size - (reserve if fence is not None else 0)
            if len(line) + 1 <= room or (not current and len(line) <= room):
                break
            if current and (len(current) > 1 or fence is None):
                close_piece()
                continue
            # A line longer than a whole piece: cut it.
            cut = max(1, room - 1)
            current.append(line[:cut])
            size += cut + 1
            line = line[cut:]
            close_piece()
        current.append(line)
        size += len(line) + 1
        match = FENCE.match(line)
        if match:
            fence = None if fence is not None else (match.group(1), match.group(2))
    if current and any(part for part in current):
        pieces.append("\n".join(current))
    return [p for p in pieces if p.strip()] or [text[:limit]]


def _inline_html(text: str) -> str:
    """Inline Markdown of one line as Telegram HTML; everything else is escaped."""
    out: list[str] = []
    last = 0
    for match in _INLINE_CODE.finditer(text):
        out.append(_spans_html(text[last : match.start()]))
        out.append(f"<code>{html.escape(match.group(1), quote=False)}</code>")
        last = match.end()
    out.append(_spans_html(text[last:]))
    return "".join(out)


def _spans_html(text: str) -> str:
    links: list[str] = []

    def keep_link(match: re.Match[str]) -> str:
        label = html.escape(match.group(1), quote=False)
        href = html.escape(match.group(2), quote=True)
        links.append(f'<a href="{href}">{label}</a>')
        return f"\x00{len(links) - 1}\x00"

    text = _LINK.sub(keep_link, text)
    text = html.escape(text, quote=False)
    text = _BOLD.sub(lambda m: f"<b>{m.group(1) or m.group(2)}</b>", text)
    text = _ITALIC.sub(r"<i>\1</i>", text)
    text = _STRIKE.sub(r"<s>\1</s>", text)
    return re.sub("\x00(\\d+)\x00", lambda m: links[int(m.group(1))], text)


def telegram_html(markdown: str) -> str:
    """Markdown as Telegram's HTML parse mode: code blocks as <pre><code>, inline code,
    bold, italic, strike, links, headings as bold, quotes; all other text escaped."""
    lines: list[str] = []
    code: list[str] | None = None
    language = ""
    for line in markdown.split("\n"):
        match = FENCE.match(line)
        if code is not None:
            if match:
                body = html.escape("\n".join(code), quote=False)
                cls = f' class="language-{html.escape(language)}"' if language else ""
                lines.append(f"<pre><code{cls}>{body}</code></pre>")
                code = None
            else:
                code.append(line)
            continue
        if match:
            code, language = [], match.group(2)
            continue
        heading = _HEADING.match(line)
        if heading:
            lines.append(f"<b>{_inline_html(heading.group(1))}</b>")
            continue
        quote = _QUOTE.match(line)
        if quote:
            lines.append(f"<blockquote>{_inline_html(quote.group(1))}</blockquote>")
            continue
        line = _BULLET.sub(lambda m: m.group(1) + "• ", line)
        lines.append(_inline_html(line))
    if code is not None:  # an unclosed block while the answer streams
        body = html.escape("\n".join(code), quote=False)
        lines.append(f"<pre><code>{body}</code></pre>")
    return "\n".join(lines)


def feishu_markdown(markdown: str) -> str:
    """Markdown for a Feishu card's markdown element, which has no headings or quotes:
    headings become bold lines; the rest (bold, italic, links, code) it renders itself."""
    out = []
    in_code = False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            in_code = not in_code
            out.append(line)
            continue
        heading = None if in_code else _HEADING.match(line)
        out.append(f"**{heading.group(1)}**" if heading else line)
    return "\n".join(out)


def pieces_for(text: str, *, limit: int, render: Callable[[str], str]) -> list[str]:
    """Split Markdown so that each rendered piece fits `limit` (rendering can grow a piece,
    e.g. escaping `<` as `&lt;`)."""
    budget = limit
    while True:
        rendered = [render(piece) for piece in split_markdown(text, budget)]
        if all(len(piece) <= limit for piece in rendered) or budget < 200:
            return [piece[:limit] for piece in rendered]
        budget = int(budget * 0.8)
