"""Background jobs: titles (B4) and compaction (B5), off the turn's critical path.

The jobs are plain functions keyed by ids. The engine's scheduler (`scheduler`) runs them:
on Celery workers in scaled mode (`sessions_app.tasks`, thin wrappers), in-process under the
engine's supervisor in embedded mode. Either way a turn never waits for them.
"""

from __future__ import annotations

import asyncio
import logging
import re

from django.conf import settings
from django.core.cache import cache
from django.utils.translation import gettext as _

from chatcore.common import events, publish
from chatcore.common.dbthreads import on_db
from sessions_app import branches, titles, turn_services
from sessions_app.models import Compaction, Message, MessageKind, Session, TitleSource

from .provider import provider_from_settings
from .provider_types import ChatProvider, complete_text

logger = logging.getLogger(__name__)

TITLE_PROMPT_ZH = (
    "给定以下对话历史，生成一个简短的会话标题（5-15 个中文字符），"
    "概括这个对话的核心内容或用户的主要需求。只返回一个标题，不要解释。"
)
TITLE_PROMPT_EN = (
    "Given the conversation below, write a short title of a few words (at most 8) in the "
    "language of the conversation that sums up its main topic or the user's request. Return "
    "only the title, without quotes or explanation."
)
SUMMARY_PROMPT = (
    "Summarise the conversation below for your own later use: keep facts, decisions, names, "
    "numbers, open questions and the user's preferences; drop small talk. Write in the "
    "conversation's language, as compact notes."
)
KEEP_RECENT = 6
_CJK = re.compile(r"[\u3400-\u9fff]")


def guard_key(job: str, session_pk: str) -> str:
    """The cache key that keeps one pending job per kind and dialog (see `scheduler`)."""
    return f"bg:{job}:{session_pk}"


def title_due(*, session_pk: str) -> str | None:
    """After a completed turn: the title due (B4), as `title_stage` says, or None."""
    session = (
        Session.objects.filter(pk=session_pk)
        .only("message_count", "title_source", "title_attempts", "deleted_at")
        .first()
    )
    return None if session is None else title_stage(session)


def title_due_of(session: Session) -> str | None:
    """`title_due` on a dialog row already at hand (the one a turn's commit locked)."""
    return title_stage(session)


def title_stage(session: Session) -> str | None:
    """B4: which title a live dialog is due, as the source it would be committed with: the
    seed's (`auto`) once message_count reaches the threshold while the title is still a
    machine's or the default, else a first one (`first`) after the first completed answer
    while it is the default; None when a person named it, it is deleted, or the title now due
    failed 1 + TITLE_RETRIES times."""
    if session.deleted_at is not None:
        return None
    if session.title_attempts > len(settings.CHAT["TITLE_RETRY_DELAYS"]):
        return None
    source = session.title_source
    if (
        source in (TitleSource.DEFAULT, TitleSource.FIRST)
        and session.message_count >= settings.CHAT["AUTO_TITLE_AFTER"]
    ):
        return TitleSource.AUTO
    if source == TitleSource.DEFAULT and settings.CHAT["FIRST_TITLE"] and session.message_count:
        return TitleSource.FIRST
    return None


def _transcript(messages: list[Message], limit_chars: int = 12000) -> str:
    lines = []
    for m in messages:
        if m.role not in ("user", "assistant") or not m.content or m.kind == MessageKind.WELCOME:
            continue
        lines.append(f"{m.role}: {m.content}")
    text = "\n".join(lines)
    return text[-limit_chars:]


def _clean_title(raw: str) -> str:
    line = next((ln for ln in raw.strip().splitlines() if ln.strip()), "")
    line = re.sub(r"^(title|标题)\s*[:：]\s*", "", line.strip(), flags=re.IGNORECASE)
    return line.strip(" \"'“”‘’「」《》#*").strip()[:60]


# --- Titles (B4) --------------------------------------------------------------------------


def _title_input(session_pk: str, stage: str) -> list[dict[str, str]] | None:
    """The title prompt, or None when the title is no longer for a machine to make: a person
    named the dialog, it is gone, a title of this stage already landed, or its attempts ran
    out. Whether it is due was decided where the turn ended (its settings, not this worker's)."""
    session = Session.objects.filter(pk=session_pk, deleted_at__isnull=True).first()
    if session is None or session.title_source not in replaceable_by(stage):
        return None
    if session.title_attempts > len(settings.CHAT["TITLE_RETRY_DELAYS"]):
        return None
    if session.forked:
        # H1: the active path's first messages, not another branch's.
        messages = branches.page_from(session, 0, 40)
    else:
        messages = list(Message.objects.filter(session_id=session_pk).order_by("seq")[:40])
    transcript = _transcript(messages, limit_chars=6000)
    if not transcript:
        return None
    prompt = TITLE_PROMPT_ZH if _CJK.search(transcript) else TITLE_PROMPT_EN
    return [
        {"role": "system", "content": prompt},
        {"role": "user", "content": "History:\n" + transcript},
    ]


def replaceable_by(stage: str) -> tuple[str, ...]:
    """The title sources a title of `stage` may replace (B4): a first title only the default;
    the seed's (`auto`, also an operator's regenerate) the default and a first title."""
    if stage == TitleSource.FIRST:
        return (TitleSource.DEFAULT,)
    return (TitleSource.DEFAULT, TitleSource.FIRST)


class _Failed:
    """An attempt at a title that failed (retried after a delay, B4)."""


_FAILED = _Failed()


async def generate_title(
    *, session_pk: str, stage: str = TitleSource.AUTO, provider: ChatProvider | None = None
) -> str | None:
    """Capture the prompt, ask the model outside any lock, commit only over the default or a
    first title (B4: a person's rename always wins). A failed attempt is a logged warning,
    counted on the dialog, and retried after the next of TITLE_RETRY_DELAYS (backing off) while
    any is left. Idempotent; returns the committed title or None."""
    delays = settings.CHAT["TITLE_RETRY_DELAYS"]
    try:
        while True:
            outcome = await _generate_title(session_pk, stage, provider)
            if not isinstance(outcome, _Failed):
                return outcome
            attempts = await on_db(titles.title_attempt_failed)(session_pk=session_pk)
            if attempts > len(delays):
                logger.warning("title given up after %d attempts", attempts)
                return None
            await asyncio.sleep(delays[attempts - 1])
    finally:
        await on_db(cache.delete)(guard_key("generate_title", session_pk))


async def _generate_title(
    session_pk: str, stage: str, provider: ChatProvider | None
) -> str | None | _Failed:
    messages = await on_db(_title_input)(session_pk, stage)
    if messages is None:
        return None
    own = provider is None
    provider = provider or provider_from_settings()
    try:
        raw = await complete_text(provider, messages, purpose="title")
        title = _clean_title(raw)
        if not title:
            logger.warning("title generation returned nothing", extra={"session_id": session_pk})
            return _FAILED
        session = await on_db(titles.title_commit_if_default)(
            session_pk=session_pk, title=title, source=stage
        )
        return session.title if session is not None else None
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.warning(
            "title generation failed: %s", type(exc).__name__, extra={"session_id": session_pk}
        )
        return _FAILED
    finally:
        if own:
            await provider.aclose()


# --- Compaction (B5) ----------------------------------------------------------------------


def _compaction_input(session_pk: str) -> tuple[list[dict[str, str]], int, int] | None:
    session = Session.objects.filter(pk=session_pk, deleted_at__isnull=True).first()
    if session is None:
        return None
    if session.forked:
        # H1: the active path only, after the summary that lies on it.
        latest, path = branches.path_since_summary(session)
        rows = [m for m in path if m.role != "system"]
    else:
        latest = Compaction.objects.filter(session_id=session_pk).order_by("-through_seq").first()
        start = latest.through_seq if latest else 0
        rows = list(
            Message.objects.filter(session_id=session_pk, seq__gt=start)
            .exclude(role="system")
            .order_by("seq")
        )
    if len(rows) <= KEEP_RECENT:
        return None
    older = rows[:-KEEP_RECENT]
    # Never end the summarised range between a tool call and its result.
    while older and (older[-1].tool_calls or older[-1].role == "tool"):
        older.pop()
    if not older:
        return None
    through = older[-1].seq
    previous = f"Earlier summary:\n{latest.summary}\n\n" if latest else ""
    messages = [
        {"role": "system", "content": SUMMARY_PROMPT},
        {
            "role": "user",
            "content": previous + "Conversation:\n" + _transcript(older, limit_chars=60000),
        },
    ]
    return messages, through, session.generation


async def compact_session(
    *, session_pk: str, manual: bool = False, provider: ChatProvider | None = None
) -> int | None:
    """Summarise older history; commit only if the dialog was not cleared or deleted and no
    newer compaction landed meanwhile. Returns the last seq covered, or None."""
    try:
        return await _compact_session(session_pk, manual, provider)
    finally:
        await on_db(cache.delete)(guard_key("compact_session", session_pk))


async def _compact_session(
    session_pk: str, manual: bool, provider: ChatProvider | None
) -> int | None:
    # F7: reading a long history is not done on the one ORM thread that answers clients.
    captured = await on_db(_compaction_input)(session_pk)
    session = await on_db(Session.objects.filter(pk=session_pk).first)()
    if captured is None:
        if manual and session is not None:
            await publish.apublish(
                publish.chat_group(session.channel, session.chat_id),
                events.notification_frame(
                    session_id=session.session_id,
                    level="info",
                    content=_("Nothing to compact yet."),
                ),
            )
        return None
    messages, through, generation = captured
    own = provider is None
    provider = provider or provider_from_settings()
    try:
        summary = (await complete_text(provider, messages, purpose="summary")).strip()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.warning(
            "compaction failed: %s", type(exc).__name__, extra={"session_id": session_pk}
        )
        return None
    finally:
        if own:
            await provider.aclose()
    if not summary:
        return None
    committed = await on_db(turn_services.compaction_commit)(
        session_pk=session_pk, through=through, generation=generation, summary=summary
    )
    if committed is None:
        logger.info(
            "compaction skipped: the dialog changed under it", extra={"session_id": session_pk}
        )
        return None
    await publish.apublish(
        publish.chat_group(committed.channel, committed.chat_id),
        events.session_updated_frame(session=committed, compacted_through=through),
    )
    return through
