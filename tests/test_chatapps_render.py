"""Markdown for the platforms and splitting at their length limits (D4)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sessions_app.chatapps.render import (
    feishu_markdown,
    pieces_for,
    split_markdown,
    telegram_html,
)


def test_telegram_html_escapes_everything_but_its_own_tags() -> None:
    # covers: D4 (model output is untrusted)
    html = telegram_html(
        '**bold** <script>alert("x")</script> & `a<b` [site](https://e.x/?a=1&b=2)'
    )
    assert html.startswith("<b>bold</b> &lt;script&gt;")
    assert "<code>a&lt;b</code>" in html
    assert '<a href="https://e.x/?a=1&amp;b=2">site</a>' in html
    assert "<script>" not in html


def test_telegram_html_code_blocks_headings_lists_and_quotes() -> None:
    # covers: D4
    md = "# Title\n- one\n> quoted\n```py\nif a < b:\n    print('**x**')\n```"
    assert telegram_html(md) == (
        "<b>Title</b>\n• one\n<blockquote>quoted</blockquote>\n"
        "<pre><code class=\"language-py\">if a &lt; b:\n    print('**x**')</code></pre>"
    )
    # An unclosed block while streaming still renders as code.
    assert telegram_html("```\nx < 1").endswith("<pre><code>x &lt; 1</code></pre>")


def test_feishu_markdown_turns_headings_into_bold_lines_outside_code() -> None:
    # covers: D4
    assert feishu_markdown("## Plan\n```\n# comment\n```") == "**Plan**\n```\n# comment\n```"


def test_a_split_code_block_is_closed_and_reopened() -> None:
    # covers: D4
    body = "\n".join(f"line {i}" for i in range(100))
    pieces = split_markdown("intro\n```js\n" + body + "\n```\noutro", 200)
    assert len(pieces) > 3
    for piece in pieces:
        assert len(piece) <= 200
        assert piece.count("```") % 2 == 0, piece
    assert pieces[1].startswith("```js")
    rejoined = "\n".join(pieces)
    assert all(f"line {i}" in rejoined for i in range(100))


def test_rendered_pieces_fit_even_when_escaping_grows_them() -> None:
    # covers: D4 (Telegram's 4096 limit counts the rendered text)
    text = "<&>" * 3000
    pieces = pieces_for(text, limit=4096, render=telegram_html)
    assert len(pieces) > 1 and all(len(p) <= 4096 for p in pieces)
    assert "".join(pieces).count("&lt;") == 3000


@given(st.text(alphabet="ab `\n#*<>&", max_size=3000), st.integers(min_value=40, max_value=500))
def test_splitting_never_loses_text_and_respects_the_limit(text: str, limit: int) -> None:
    # covers: D4
    pieces = split_markdown(text, limit)
    assert all(len(p) <= limit for p in pieces)
    kept = "".join(pieces).replace("`", "").replace("\n", "")
    original = text.replace("`", "").replace("\n", "")
    if original.strip():
        assert kept.replace(" ", "").count("a") == original.replace(" ", "").count("a")
