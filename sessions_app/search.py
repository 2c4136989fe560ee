"""Search over dialogs (SPEC H2, PROTOCOL "Search, export, import"): reads only.

A query is split into words; a hit contains every word, case-insensitively. The index is the
database's own (migration `0011_search_and_shares`):

- PostgreSQL: a word of letters and digits matches the start of a word of the text, through
  the GIN index of `to_tsvector('simple', content)` (ranked by `ts_rank`); a word holding CJK
  characters, which the parser does not split into words, matches as a substring, through the
  pg_trgm GIN index (ranked by how often it occurs), as does a word with punctuation in it.
- SQLite: FTS5 with the trigram tokenizer: every word matches as a substring, ranked by
  bm25. Words shorter than three characters (two Chinese characters) have no trigram: they
  filter the rows the other words found, or, alone, scan the index's text.

A user with up to `OWNER_SCAN_MAX` messages (in the chat searched) is matched by reading their
own messages instead, with the same rules (PostgreSQL: a regular expression for a word's
start, ILIKE for a substring; SQLite: substrings, casefolded in Python): a frequent word is
in a large share of everyone's messages, and the index would hand all of them to the owner
filter, where the reader's own history is small.

Messages of the user and the assistant are searched (not welcome notes or tool output), and
titles. Owner-scoped, live dialogs only: a deleted dialog drops out at once (the query joins
its row), and a purged one leaves nothing (the index entries go with the rows). Titles are
matched in Python over the caller's live dialogs (a few hundred short strings), which keeps
Unicode case folding the same on both databases. Title hits come first, then messages, best
first, newest first among equals; each hit carries a snippet around the first match and the
spans to highlight in it.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import connection
from django.db.models import Sum
from django.utils import timezone
from django.utils.translation import gettext as _

from chatcore.common.errors import BadRequest
from chatcore.common.ids import storable_text

from .models import Message, Session

QUERY_MAX_CHARS = 200
QUERY_MAX_WORDS = 10
LIMIT_MAX = 100
SNIPPET_BEFORE = 60
SNIPPET_CHARS = 200
# Up to this many messages of one user (in the chat searched) are read directly rather than
# found through the index (`_message_rows`).
OWNER_SCAN_MAX = 20_000

_SEARCHABLE = "m.role IN ('user', 'assistant')"
# Scripts written without spaces between words: matched as substrings on PostgreSQL.
_CJK = re.compile(
    "[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff66-\uff9f"
    "\U00020000-\U0002fa1f]"
)
_WORD = re.compile(r"[^\W_]+")


@dataclass(frozen=True, slots=True)
class Hit:
    session_id: str
    dialog_id: str
    title: str
    seq: int | None
    role: str
    snippet: str
    highlights: list[list[int]]
    created_at: datetime

    def as_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "dialog_id": self.dialog_id,
            "title": self.title,
            "seq": self.seq,
            "role": self.role,
            "snippet": self.snippet,
            "highlights": self.highlights,
            "created_at": self.created_at.isoformat(),
        }


def query_words(q: object) -> list[str]:
    """The words of a query, each once, in order; a clear error for what cannot be one."""
    if not isinstance(q, str):
        raise BadRequest(_("The search query must be text."))
    if len(q) > QUERY_MAX_CHARS:
        raise BadRequest(
            _("A search query may have at most %(n)d characters.") % {"n": QUERY_MAX_CHARS}
        )
    if not storable_text(q.replace("\x00", "")):
        raise BadRequest(_("The search query must be text."))
    text = unicodedata.normalize("NFC", q.replace("\x00", ""))
    words = list(dict.fromkeys(w for w in text.split() if w))
    if not words:
        raise BadRequest(_("Type something to search for."))
    if len(words) > QUERY_MAX_WORDS:
        raise BadRequest(_("A search query may have at most %(n)d words.") % {"n": QUERY_MAX_WORDS})
    return words


def search_for_owner(
    *,
    owner_id: int,
    q: object,
    limit: int = 20,
    offset: int = 0,
    chat: tuple[str, str] | None = None,
) -> tuple[list[Hit], int]:
    """The caller's hits for `q`, best first: (one page, how many there are in all).
    `chat` (channel, chat id) keeps to one chat's dialogs (the web chat's socket)."""
    words = query_words(q)
    limit = max(1, min(limit, LIMIT_MAX))
    offset = max(0, offset)
    titles = _title_hits(owner_id, words, chat)
    page: list[Hit] = titles[offset : offset + limit]
    message_offset = max(0, offset - len(titles))
    message_limit = limit - len(page)
    rows, message_count = _message_rows(
        words, owner_id=owner_id, chat=chat, limit=message_limit, offset=message_offset
    )
    for row in rows:
        page.append(_message_hit(row, words))
    return page, len(titles) + message_count


def session_pks_matching(*, q: str, limit: int = 1000) -> list[str]:
    """Dialogs (of anyone, deleted ones too) with a message holding every word of `q`: the
    admin's dialog search, through the same index. Unusable input matches nothing."""
    try:
        words = query_words(q)
    except BadRequest:
        return []
    sql, params = _match_sql(words, select="DISTINCT m.session_id", where="", ranked=False)
    with connection.cursor() as cursor:
        cursor.execute(f"{sql} LIMIT %s", [*params, limit])
        return [str(row[0]) for row in cursor.fetchall()]


# --- Titles ---------------------------------------------------------------------------------


def _title_hits(owner_id: int, words: list[str], chat: tuple[str, str] | None) -> list[Hit]:
    folded = [w.casefold() for w in words]
    sessions = Session.objects.filter(owner_id=owner_id, deleted_at__isnull=True)
    if chat is not None:
        sessions = sessions.filter(channel=chat[0], chat_id=chat[1])
    rows = sessions.order_by("-last_active_at").values_list(
        "channel", "chat_id", "dialog_id", "title", "created_at"
    )
    hits = []
    for channel, chat_id, dialog_id, title, created_at in rows.iterator(chunk_size=500):
        lowered = title.casefold()
        if all(w in lowered for w in folded):
            hits.append(
                Hit(
                    session_id=f"{channel}:{chat_id}:{dialog_id}",
                    dialog_id=dialog_id,
                    title=title,
                    seq=None,
                    role="title",
                    snippet=title,
                    highlights=highlight_spans(title, words),
                    created_at=created_at,
                )
            )
    return hits


# --- Messages -------------------------------------------------------------------------------

_COLUMNS = "m.seq, m.role, m.content, m.created_at, s.channel, s.chat_id, s.dialog_id, s.title"


def _message_rows(
    words: list[str], *, owner_id: int, chat: tuple[str, str] | None, limit: int, offset: int
) -> tuple[list[tuple[Any, ...]], int]:
    where = " AND s.owner_id = %s AND s.deleted_at IS NULL"
    scope: list[Any] = [owner_id]
    if chat is not None:
        where += " AND s.channel = %s AND s.chat_id = %s"
        scope += list(chat)
    # A user with few messages: read theirs, not the index. A frequent word is in a large
    # share of everyone's messages; the index would hand all of them to the owner filter.
    indexed = _owner_messages(owner_id, chat) > OWNER_SCAN_MAX
    # The count beside the page, in one pass over the matches (SQLite's bm25 cannot be
    # used beside a window function: there the count is a statement of its own).
    counted = connection.vendor == "postgresql" or not indexed
    select = f"{_COLUMNS}, COUNT(*) OVER ()" if counted else _COLUMNS
    rows: list[tuple[Any, ...]] = []
    with connection.cursor() as cursor:
        if limit > 0:
            sql, params = _match_sql(
                words, select=select, where=where, ranked=True, indexed=indexed
            )
            cursor.execute(
                f"{sql} ORDER BY rank, m.created_at DESC LIMIT %s OFFSET %s",
                [*params, *scope, limit, offset],
            )
            rows = [tuple(r) for r in cursor.fetchall()]
            if rows and counted:
                return [r[:8] for r in rows], int(rows[0][8])
            if 0 < len(rows) < limit or (not rows and offset == 0):
                return rows, offset + len(rows)  # the last page: no count needed
        sql, params = _match_sql(
            words, select="COUNT(*)", where=where, ranked=False, indexed=indexed
        )
        cursor.execute(sql, [*params, *scope])
        return rows, int(cursor.fetchone()[0])


def _owner_messages(owner_id: int, chat: tuple[str, str] | None) -> int:
    sessions = Session.objects.filter(owner_id=owner_id, deleted_at__isnull=True)
    if chat is not None:
        sessions = sessions.filter(channel=chat[0], chat_id=chat[1])
    return int(sessions.aggregate(n=Sum("total_message_count"))["n"] or 0)


def _match_sql(
    words: list[str], *, select: str, where: str, ranked: bool, indexed: bool = True
) -> tuple[str, list[Any]]:
    """The statement finding the messages that hold every word; `ranked` adds a `rank`
    column (lower is better) for the ordering; `where` adds conditions on `s` (the dialog),
    whose parameters the caller appends. `indexed`: through the search index, else the
    messages of the dialogs `where` selects, read one by one."""
    if connection.vendor == "postgresql":
        return _match_postgresql(words, select=select, where=where, ranked=ranked, indexed=indexed)
    if indexed:
        return _match_sqlite(words, select=select, where=where, ranked=ranked)
    return _scan_sqlite(words, select=select, where=where, ranked=ranked)


def _like(word: str) -> str:
    escaped = word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


# How often a word occurs in a message (two parameters: the word), a little less for long texts.
_OCCURRENCES = (
    "(length(m.content) - length(replace(lower(m.content), lower(%s), '')))"
    " / greatest(length(%s), 1)::float / ln(2.7 + length(m.content) / 1000.0)"
)


def _match_postgresql(
    words: list[str], *, select: str, where: str, ranked: bool, indexed: bool
) -> tuple[str, list[Any]]:
    table_m, table_s = Message._meta.db_table, Session._meta.db_table
    # The indexes' own expression, so the planner can use `idx_message_fts` and
    # `idx_message_trgm`; another one (the same text) when the owner's rows are read, where
    # a word's start is found by a regular expression (`\m`: the start of a word), cheaper
    # than a text search vector made for each row.
    text = "m.content" if indexed else "(m.content || '')"
    prefixes: list[str] = []
    substrings: list[str] = []
    for word in words:
        if _CJK.search(word):
            substrings.append(word)
        elif _WORD.fullmatch(word):
            prefixes.append(word)
        else:
            substrings.append(word)  # with punctuation ("100%", "e-mail"): as written
    conditions = [_SEARCHABLE]
    params: list[Any] = []
    rank_terms: list[str] = []
    rank_params: list[Any] = []
    if prefixes and indexed:
        tsquery = " & ".join(f"'{w.lower()}':*" for w in prefixes)
        conditions.append(
            f"to_tsvector('simple'::regconfig, {text}) @@ to_tsquery('simple'::regconfig, %s)"
        )
        params.append(tsquery)
        rank_terms.append(
            "ts_rank(to_tsvector('simple'::regconfig, m.content),"
            " to_tsquery('simple'::regconfig, %s))"
        )
        rank_params.append(tsquery)
    elif prefixes:
        for word in prefixes:
            conditions.append(f"{text} ~* %s")
            params.append("\\m" + word)  # letters and digits only: nothing to escape
            rank_terms.append(_OCCURRENCES)
            rank_params.extend([word, word])
    for word in substrings:
        conditions.append(f"{text} ILIKE %s")
        params.append(_like(word))
        rank_terms.append(_OCCURRENCES)
        rank_params.extend([word, word])
    rank_sql = f", -({' + '.join(rank_terms)}) AS rank" if ranked else ""
    sql = (
        f"SELECT {select}{rank_sql}"  # noqa: S608 (our tables; values are parameters)
        f' FROM "{table_m}" m JOIN "{table_s}" s ON s.id = m.session_id'
        f" WHERE {' AND '.join(conditions)}{where}"
    )
    return sql, [*(rank_params if ranked else []), *params]


def _match_sqlite(
    words: list[str], *, select: str, where: str, ranked: bool
) -> tuple[str, list[Any]]:
    table_m, table_s = Message._meta.db_table, Session._meta.db_table
    long_words = [w for w in words if len(w) >= 3]
    short_words = [w for w in words if len(w) < 3]
    conditions: list[str] = []
    params: list[Any] = []
    if long_words:
        conditions.append("sessions_app_message_fts MATCH %s")
        params.append(" ".join('"' + w.replace('"', '""') + '"' for w in long_words))
    for word in short_words:
        # No trigram in it: LIKE, which SQLite folds for ASCII only (CJK has no case).
        conditions.append("sessions_app_message_fts.content LIKE %s ESCAPE '\\'")
        params.append(_like(word))
    rank = "bm25(sessions_app_message_fts)" if long_words else "0"
    rank_sql = f", {rank} AS rank" if ranked else ""
    sql = (
        f"SELECT {select}{rank_sql}"  # noqa: S608 (our tables; values are parameters)
        " FROM sessions_app_message_fts"
        " JOIN sessions_app_search_doc d ON d.id = sessions_app_message_fts.rowid"
        f' JOIN "{table_m}" m ON m.id = d.message_id'
        f' JOIN "{table_s}" s ON s.id = m.session_id'
        f" WHERE {' AND '.join(conditions)}{where}"
    )
    return sql, params


def _scan_sqlite(
    words: list[str], *, select: str, where: str, ranked: bool
) -> tuple[str, list[Any]]:
    """The owner's messages read one by one, matched (and ranked) in Python with the same
    Unicode case folding as the titles."""
    table_m, table_s = Message._meta.db_table, Session._meta.db_table
    connection.ensure_connection()
    connection.connection.create_function("chat_match", 2, _match_score, deterministic=True)
    packed = "\x1f".join(w.casefold() for w in words)
    rank_sql = ", -chat_match(m.content, %s) AS rank" if ranked else ""
    sql = (
        f"SELECT {select}{rank_sql}"  # noqa: S608 (our tables; values are parameters)
        f' FROM "{table_s}" s JOIN "{table_m}" m ON m.session_id = s.id'
        f" WHERE {_SEARCHABLE} AND chat_match(m.content, %s) > 0{where}"
    )
    return sql, [*([packed] if ranked else []), packed]


def _match_score(content: str | None, packed: str) -> float:
    """How well `content` matches: 0 unless it holds every word (`packed`, casefolded,
    joined by U+001F); else the occurrences, a little less for long texts."""
    if not content:
        return 0.0
    folded = content.casefold()
    total = 0
    for word in packed.split("\x1f"):
        found = folded.count(word)
        if not found:
            return 0.0
        total += found
    return total / math.log(2.7 + len(content) / 1000)


def _message_hit(row: tuple[Any, ...], words: list[str]) -> Hit:
    seq, role, content, created_at, channel, chat_id, dialog_id, title = row[:8]
    if isinstance(created_at, str):  # SQLite through a plain cursor
        created_at = datetime.fromisoformat(created_at)
    if timezone.is_naive(created_at):
        created_at = timezone.make_aware(created_at, UTC)
    snippet = make_snippet(content, words)
    return Hit(
        session_id=f"{channel}:{chat_id}:{dialog_id}",
        dialog_id=dialog_id,
        title=title,
        seq=int(seq),
        role=role,
        snippet=snippet,
        highlights=highlight_spans(snippet, words),
        created_at=created_at,
    )


# --- Snippets -------------------------------------------------------------------------------


def make_snippet(text: str, words: list[str]) -> str:
    """About `SNIPPET_CHARS` characters of `text` around the first match of any word, on one
    line, with `…` where it was cut."""
    first = len(text)
    for word in words:
        found = re.search(re.escape(word), text, re.IGNORECASE)
        if found is not None:
            first = min(first, found.start())
    if first == len(text):
        first = 0
    start = max(0, first - SNIPPET_BEFORE)
    if start > 0:
        space = text.rfind(" ", start - 15, start + 15)
        start = space + 1 if space > 0 and space < first else start
    end = min(len(text), start + SNIPPET_CHARS)
    piece = " ".join(text[start:end].split())
    return ("…" if start > 0 else "") + piece + ("…" if end < len(text) else "")


def highlight_spans(snippet: str, words: list[str]) -> list[list[int]]:
    """[start, end) spans of `snippet` (Unicode code points) where a word occurs, in order,
    overlaps merged."""
    spans = sorted(
        (m.start(), m.end())
        for word in words
        for m in re.finditer(re.escape(word), snippet, re.IGNORECASE)
    )
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
