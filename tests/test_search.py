"""Search over one's own live dialogs (SPEC H2; PROTOCOL "Search, export, import"): the
selector on both databases, the REST route and the WebSocket frame."""

# covers: H2

from __future__ import annotations

from typing import Any

import pytest

from sessions_app import search, services
from tests.carry_helpers import dialog_with

pytestmark = [pytest.mark.django_db, pytest.mark.both_dbs]


@pytest.fixture(autouse=True, params=["index", "scan"])
def read_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test through both ways of reading: the search index (a user with many
    messages) and the user's own messages read directly (a user with few)."""
    monkeypatch.setattr(search, "OWNER_SCAN_MAX", 0 if request.param == "index" else 10**9)
    return str(request.param)


def _hits(user: Any, q: str, **kw: Any) -> list[search.Hit]:
    return search.search_for_owner(owner_id=user.pk, q=q, **kw)[0]


def test_every_word_must_match_and_only_own_dialogs(user: Any, other_user: Any) -> None:
    mine = dialog_with(user, "How do I deploy Django behind nginx?", "Use gunicorn and a proxy.")
    dialog_with(user, "Deploy a rocket", "Countdown first.")
    dialog_with(other_user, "Deploy Django on my secret server", "ok")

    hits = _hits(user, "django deploy")
    assert [(h.session_id, h.seq, h.role) for h in hits] == [(mine.session_id, 2, "user")]
    assert "secret" not in repr(hits)
    assert hits[0].snippet == "How do I deploy Django behind nginx?"
    spans = [hits[0].snippet[a:b] for a, b in hits[0].highlights]
    assert spans == ["deploy", "Django"]
    # Case-insensitive; the other user's dialog is never found, whatever is asked.
    assert len(_hits(user, "DEPLOY")) == 2
    assert _hits(user, "secret") == []
    assert [h.seq for h in _hits(other_user, "secret")] == [2]


def test_cjk_substrings_and_titles(user: Any) -> None:
    session = dialog_with(user, "今天天气很好，我们去公园散步吧", "好的", title="周末计划")
    hits = _hits(user, "天气")
    assert [(h.seq, h.role) for h in hits] == [(2, "user")]
    assert [hits[0].snippet[a:b] for a, b in hits[0].highlights] == ["天气"]
    # Two substrings, both required; one missing finds nothing.
    assert len(_hits(user, "公园 散步")) == 1
    assert _hits(user, "公园 咖啡") == []
    titles = _hits(user, "周末")
    assert [(t.role, t.seq, t.session_id) for t in titles] == [("title", None, session.session_id)]


def test_deleted_dialogs_drop_out_and_purged_leave_nothing(user: Any) -> None:
    session = dialog_with(user, "remember the pineapple recipe", "Sure.")
    assert len(_hits(user, "pineapple")) == 1
    services.session_soft_delete(session=session)
    assert _hits(user, "pineapple") == []
    services.session_restore(session=session)
    assert len(_hits(user, "pineapple")) == 1
    services.session_purge(session=session)
    assert _hits(user, "pineapple") == []
    assert search.session_pks_matching(q="pineapple") == []
    assert _index_rows() == 0


def _index_rows() -> int:
    """Rows left in SQLite's search index (PostgreSQL's indexes are the table's own)."""
    from django.db import connection

    if connection.vendor != "sqlite":
        return 0
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT (SELECT COUNT(*) FROM sessions_app_search_doc)"
            " + (SELECT COUNT(*) FROM sessions_app_message_fts)"
        )
        return int(cursor.fetchone()[0])


def test_cleared_history_is_not_found(user: Any) -> None:
    session = dialog_with(user, "the walrus sings", "lovely")
    services.messages_clear(session=session)
    assert _hits(user, "walrus") == []
    assert _index_rows() == 0


def test_best_first_pages_and_count(user: Any) -> None:
    dialog_with(user, "kiwi once in a long message about many other fruits and vegetables")
    best = dialog_with(user, "kiwi kiwi kiwi")
    for _ in range(3):
        dialog_with(user, "a kiwi")
    hits, count = search.search_for_owner(owner_id=user.pk, q="kiwi", limit=2)
    assert count == 5
    assert len(hits) == 2
    assert hits[0].session_id == best.session_id
    rest, count = search.search_for_owner(owner_id=user.pk, q="kiwi", limit=10, offset=2)
    assert (len(rest), count) == (3, 5)
    beyond, count = search.search_for_owner(owner_id=user.pk, q="kiwi", offset=50)
    assert (beyond, count) == ([], 5)


def test_welcome_and_tool_messages_are_not_searched(user: Any) -> None:
    dialog_with(user, ("tool", "zebra output of a tool"), "fine")
    assert _hits(user, "zebra") == []
    assert _hits(user, "created") == []  # the welcome note: "New dialog created! ..."


@pytest.mark.parametrize("q", ["", "   ", "x" * 201, " ".join(f"w{i}" for i in range(11))])
def test_bad_queries_are_refused(user: Any, q: str) -> None:
    from chatcore.common.errors import BadRequest

    with pytest.raises(BadRequest):
        search.search_for_owner(owner_id=user.pk, q=q)


def test_like_wildcards_are_literal(user: Any) -> None:
    dialog_with(user, "100% sure about under_score", "ok")
    dialog_with(user, "100 sure about underscore", "ok")
    assert len(_hits(user, "100%")) == 1
    assert len(_hits(user, "r_s")) == 1


def test_short_words_and_prefixes(user: Any) -> None:
    dialog_with(user, "Configure the PostgreSQL database", "ok")
    assert len(_hits(user, "postgres")) == 1  # the start of a word
    assert len(_hits(user, "db postgres")) == 0
    assert len(_hits(user, "th")) == 1


def test_a_lone_surrogate_is_refused(user: Any) -> None:
    from chatcore.common.errors import BadRequest

    with pytest.raises(BadRequest):
        search.search_for_owner(owner_id=user.pk, q="a \ud800 b")


def test_snippets_are_cut_around_the_first_match_and_highlighted() -> None:
    text = "start " + "filler words here " * 20 + "the NEEDLE is here " + "tail " * 60
    snippet = search.make_snippet(text, ["needle"])
    assert snippet.startswith("…") and snippet.endswith("…")
    assert len(snippet) <= search.SNIPPET_CHARS + 2
    assert [snippet[a:b] for a, b in search.highlight_spans(snippet, ["needle"])] == ["NEEDLE"]
    short = search.make_snippet("line one\n\nneedle  two", ["needle"])
    assert short == "line one needle two"  # one line, whitespace folded
    # Overlapping words are one highlight; the spans count code points.
    assert search.highlight_spans("😀 abcd", ["abc", "bcd"]) == [[2, 6]]
