"""The turn input builder (C7): system prompt + skills + memory notes + active plan +
compacted history (all read in one transaction) + this turn's messages, with one runtime-context
block appended to the last user message. Overflow recovery goes through the same assembly with a
tighter budget, so nothing is ever appended twice.

Everything here that grows with the dialog runs in a worker thread, never on the event loop
(F7): loading the history (after the last compaction only), converting it, counting and
trimming. Each stored message is converted and counted once (`Replayed`, kept on the message
the history cache holds; `TokenCache`, by message id, for a dialog loaded again) and trimming
walks back from the newest message until the budget is spent, so a build is linear in the
dialog, and its cost per message already seen is a lookup. A turn's first build goes on from
the dialog's last one (`Carried`, `CarriedBuilds`): it makes items for the messages stored
since, moves the budget's start on and joins the request body's JSON in one go, so its cost
follows what was added, not the dialog's length, also once the dialog is longer than the read
window and its start moves on with every turn; anything else (a tool's call or result, a
continuation, another compaction, head or budget) walks the window again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from django.conf import settings

from chatcore.common.dbthreads import on_db
from chatcore.common.llm_models import context_window as model_window
from sessions_app import selectors, services
from sessions_app.models import Compaction, Message, Session

from ..provider_types import EncodedMessage, EncodedMessages
from ..sessions import SessionStates
from ..tokens import TokenCache, TokenCounter, counter_for_model
from . import attachments
from .carried import Carried, CarriedBuilds, Window, go_on
from .items import (
    REPLAYED,
    Item,
    encoded,
    joined_input,
    message_to_openai,
    replay,
    replayed,
    sanitize_tool_pairs,
)
from .outcome import PendingMessage
from .paths import forked_context

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You are a helpful assistant in a chat application. Answer in the language of the user. "
    "Use Markdown for structure when it helps. Use the tools when they help; do not invent "
    "tool results."
)
RUNTIME_MARKER = "\n\n[runtime context]\n"
TRIMMED_NOTE = "\n[... trimmed for the model's context ...]"
# The read window: at most this many characters per token of the model's window are loaded
# (newest first). Real text runs 3-5 characters a token; anything past 16 cannot fit anyway.
WINDOW_CHARS_PER_TOKEN = 16


def load_skills(folder: str | Path) -> str:
    """Concatenate the markdown skill files of a folder, in name order."""
    path = Path(folder)
    if not path.is_dir():
        return ""
    parts = []
    for file in sorted(path.glob("*.md")):
        try:
            parts.append(f"## Skill: {file.stem}\n{file.read_text(encoding='utf-8').strip()}")
        except OSError:
            logger.warning("could not read skill %s", file.name)
    return "\n\n".join(parts)


@dataclass
class RuntimeInfo:
    channel: str
    dialog_id: str
    title: str
    now: datetime | None = None

    def render(self) -> str:
        now = self.now or datetime.now(UTC)
        return (
            f"{RUNTIME_MARKER}time: {now:%Y-%m-%d %H:%M} UTC\n"
            f"channel: {self.channel}\ndialog: {self.dialog_id} ({self.title})"
        )


@dataclass
class PreparedInput:
    messages: list[dict[str, Any]]
    base_generation: int
    estimated_tokens: int
    dropped_for_budget: int = 0
    compacted_through: int = 0
    # H4: the dialog's model (None: the provider's default) and that model's window.
    model: str | None = None
    context_window: int = 0


def admitted_context(
    found: selectors.TurnContext | None, session: Session | None
) -> selectors.TurnContext | None:
    """A started turn's context as its admission read it, in the round trip of its lock
    (`admission_lock.lock_for_admission`), for the row that admission left: the user message
    appended as the one message after the revision the read saw, and the state version raised
    once by that append. None (read it again) when the row shows anything else."""
    if found is None or session is None:
        return None
    if found.revision != (session.last_seq - 1, session.state_version - 1):
        return None
    return found


class TurnInputBuilder:
    def __init__(
        self,
        *,
        states: SessionStates,
        context_window: int | None = None,
        skills_dir: str | Path | None = None,
        system_prompt: str = SYSTEM_PROMPT,
        counter: TokenCounter | None = None,
        token_cache: TokenCache | None = None,
    ) -> None:
        self.states = states
        self.context_window = context_window or settings.LLM["CONTEXT_WINDOW"]
        self.skills = load_skills(skills_dir or settings.CHAT["SKILLS_DIR"])
        self.system_prompt = system_prompt
        self._counter = counter
        self.token_cache = token_cache or TokenCache(settings.CHAT["TOKEN_CACHE_ENTRIES"])
        # Each dialog's last build of its stored history, for its next one to go on from
        # (`assemble`): their JSON within an eighth of the history cache's bytes.
        self.carried = CarriedBuilds(max(1, states.max_bytes // 8))

    @property
    def counter(self) -> TokenCounter:
        """The default model's counter (`counter_for`)."""
        return self.counter_for(None)

    def counter_for(self, model: str | None) -> TokenCounter:
        """C7, H4: the token counter of the dialog's model (None: the default model), the one
        given to this builder when it was (tests). Its tables load on first use: call this in
        a worker thread, as the builds and the runner's counts do."""
        if self._counter is not None:
            return self._counter
        return counter_for_model(model or settings.LLM["MODEL"])

    def window_of(self, session: Session) -> int:
        """H4: the context window of the dialog's model (`LLM_CONTEXT_WINDOWS`), else this
        builder's."""
        name = session.model or settings.LLM["MODEL"]
        windows = settings.LLM.get("CONTEXT_WINDOWS") or {}
        return model_window(name) if name in windows else self.context_window

    async def prepare(
        self,
        *,
        session_pk: str,
        runtime: RuntimeInfo,
        pending: list[PendingMessage] | None = None,
        exclude_turn_partials: str | None = None,
        budget_ratio: float | None = None,
        session: Session | None = None,
        context: selectors.TurnContext | None = None,
    ) -> PreparedInput:
        """The model's input for a turn of the dialog. `session`: its row as the caller's
        transaction just read it (the claim, G6); without it, the row is read here.
        `context`: the turn's context as its admission read it (`Started.context`), used
        when nothing but the turn's own user message changed the dialog since."""
        found = admitted_context(context, session)
        return await on_db(self._build)(
            session_pk,
            runtime,
            session=session,
            found=found,
            pending=pending,
            exclude_turn_partials=exclude_turn_partials,
            budget_ratio=budget_ratio,
        )

    def prepare_beside(
        self,
        session: Session,
        context: selectors.TurnContext | None,
        appended: services.Appended | None = None,
    ) -> PreparedInput | None:
        """A send's turn input, built on a database thread as soon as its admission has
        started its turn (`Engine.submit`, G6), while that transaction commits:
        from the context the admission read in its first round trip, on the row it left and
        with the messages it `appended` (not yet committed, so neither read nor recorded in
        the history cache here), with no trip back to the event loop and out again before
        the model request. None when that context cannot be used (the worker then reads and
        builds, `prepare`)."""
        found = admitted_context(context, session)
        if found is None:
            return None
        runtime = RuntimeInfo(
            channel=session.channel, dialog_id=session.dialog_id, title=session.title
        )
        return self._build(session.pk, runtime, session=session, found=found, appended=appended)

    def prepare_committed(
        self, session: Session, appended: services.Appended | None
    ) -> PreparedInput:
        """A send's turn input, built on a database thread as soon as its admission, which
        started its turn, has committed (`Engine.submit`, G6, SQLite): the context read here,
        on the row the admission left. The messages it `appended` are recorded in the history
        cache first (committed, so they may be, A4; the admission records them too, once)."""
        if appended is not None:
            self.states.apply_appended(appended)
        runtime = RuntimeInfo(
            channel=session.channel, dialog_id=session.dialog_id, title=session.title
        )
        return self._build(session.pk, runtime, session=session)

    def _build(
        self,
        session_pk: str,
        runtime: RuntimeInfo,
        *,
        session: Session | None = None,
        found: selectors.TurnContext | None = None,
        pending: list[PendingMessage] | None = None,
        exclude_turn_partials: str | None = None,
        budget_ratio: float | None = None,
        appended: services.Appended | None = None,
    ) -> PreparedInput:
        """On a database thread. G6: the context (compaction, history window, memory notes)
        in one statement, beside the dialog row the claim read; F7: then the conversion,
        counting and trimming, which grow with the dialog: all in one trip to that thread."""
        ratio = budget_ratio or settings.CHAT["COMPACTION_BUDGET_RATIO"]
        row, history, compaction, skipped, notes = self._load_context(
            session_pk, session, found, appended
        )
        window = self.window_of(row)
        budget = int(window * ratio)
        prepared = self.assemble(
            session=row,
            history=history,
            compaction=compaction,
            notes=notes,
            plan=row.plan or "",
            runtime=runtime,
            pending=pending or [],
            exclude_turn_partials=exclude_turn_partials,
            budget=budget,
        )
        # Messages outside the read window were left out for the budget too.
        prepared.dropped_for_budget += skipped
        prepared.model, prepared.context_window = row.model or None, window
        # F7: the request body's JSON, here rather than on the event loop; a message seen
        # before keeps its own, so this encodes only what is new since, and the window's
        # messages are joined here once (`EncodedMessages`).
        if not isinstance(prepared.messages, EncodedMessages):
            prepared.messages = EncodedMessages(
                m if m.__class__ is EncodedMessage else encoded(m) for m in prepared.messages
            )
        return prepared

    async def recover_after_overflow(
        self,
        *,
        session_pk: str,
        runtime: RuntimeInfo,
        pending: list[PendingMessage],
        exclude_turn_partials: str | None = None,
    ) -> PreparedInput:
        """C7: the same assembly with half the budget; called at most once per turn."""
        return await self.prepare(
            session_pk=session_pk,
            runtime=runtime,
            pending=pending,
            exclude_turn_partials=exclude_turn_partials,
            budget_ratio=settings.CHAT["COMPACTION_BUDGET_RATIO"] / 2,
        )

    def _load_context(
        self,
        session_pk: str,
        session: Session | None = None,
        found: selectors.TurnContext | None = None,
        appended: services.Appended | None = None,
    ) -> tuple[Session, list[Message], Compaction | None, int, list[str]]:
        """Runs on a database thread (`on_db`), beside other dialogs' calls (F7). The dialog
        row as the claim locked it, and the rest (compaction, history window, memory notes)
        in one statement (`selectors.turn_context`, G6); the messages only where this
        process's history is behind. Messages are never rewritten (B5) and only the lease
        holder appends them, so a later read of them agrees with that statement."""
        if session is None:
            with selectors.read_transaction():
                return self._load_context(session_pk, Session.objects.get(pk=session_pk))
        if found is None:
            found = selectors.turn_context(
                session_pk=session_pk,
                owner_id=session.owner_id,
                max_chars=self.window_of(session) * WINDOW_CHARS_PER_TOKEN,
            )
        # F7: only the newest messages that could fit the model's window at all are read;
        # a dialog longer than that costs one running sum, not one row per message, and
        # the same statement counted those it leaves out.
        skipped = found.skipped
        if session.forked:  # H1: the active path only (`turns/paths.py`)
            chars = self.window_of(session) * WINDOW_CHARS_PER_TOKEN
            return session, *forked_context(self.states, session, appended, chars), found.notes
        if appended is None:
            history = self.states.history(session, after_seq=found.window_start)
        else:
            # The admission's own messages, still in its open transaction, come as written.
            history = self.states.history_through(
                session, after_seq=found.window_start, through_seq=appended.base_revision
            ) + [m for m in appended.messages if m.seq > found.window_start]
        return session, history, found.compaction, skipped, found.notes

    def assemble(
        self,
        *,
        session: Session,
        history: list[Message],
        compaction: Compaction | None,
        notes: list[str],
        plan: str,
        runtime: RuntimeInfo,
        pending: list[PendingMessage],
        exclude_turn_partials: str | None,
        budget: int,
    ) -> PreparedInput:
        system = self.system_prompt
        if self.skills:
            system += "\n\n# Skills\n" + self.skills
        if session.system_prompt:
            # H4: the dialog's own instructions, after the platform's (counted with the head).
            system += "\n\n# Instructions for this dialog\n" + session.system_prompt
        if notes:
            system += "\n\n# Memory notes about the user\n" + "\n".join(f"- {n}" for n in notes)
        if plan:
            system += "\n\n# Active plan for this dialog\n" + plan
        head: list[dict[str, Any]] = [{"role": "system", "content": system}]
        through = compaction.through_seq if compaction else 0
        if compaction:
            head.append(
                {
                    "role": "system",
                    "content": "Summary of the earlier conversation:\n" + compaction.summary,
                }
            )

        counter, cache = self.counter_for(session.model), self.token_cache
        name = counter.name

        def count(it: Item) -> int:
            kept = it.tokens
            if kept is None:
                return cache.count(counter, it.key, it.data)
            found = kept.get(name)
            if found is None:
                found = kept[name] = cache.count(counter, it.key, it.data)
            return found

        # The head (system prompt, skills, notes, plan, summary) is the same turn after turn:
        # counted once per text, kept under the text itself.
        head_total = sum(cache.count(counter, ("head", h["content"]), h) for h in head)
        # A build of the stored history alone (a turn's first) may go on from the dialog's
        # last one (`Carried`): what it walked, counted and joined then is not done again.
        key = (session.generation, through, budget, head_total, name)
        carries = not pending and not exclude_turn_partials and bool(history)
        carried = self.carried.get(session.pk) if carries else None
        window = go_on(carried, key, history, through, budget, count) if carried else None
        if window is not None:
            body = list(window.datas)
            jsons: list[bytes] | None = window.jsons
            start, total = window.dropped, head_total + window.kept
        else:
            items, start, total, plain = self._walk(
                history, pending, through, exclude_turn_partials, budget, head_total, count, name
            )
            body = [it.data for it in items[start:]]
            jsons = None
            if carries and items:
                window = Window.of(items, start, total - head_total, plain=plain)
                jsons = window.jsons
        if carries and window is not None:
            self.carried.put(
                session.pk,
                Carried(
                    key=key,
                    first=history[0].pk,
                    last=history[-1].pk,
                    first_seq=history[0].seq,
                    last_seq=history[-1].seq,
                    walked=len(history),
                    window=window,
                ),
            )

        # C7: the runtime context block, exactly once, on the last user message.
        block = runtime.render()
        at = None
        for i in range(len(body) - 1, -1, -1):
            if body[i]["role"] == "user":
                body[i] = {**body[i], "content": attachments.append_text(body[i]["content"], block)}
                total += counter.count_text(block)
                at = i
                break
        messages: list[dict[str, Any]]
        if jsons is not None:
            # F7: the request body's JSON, joined here in one go from the items' own
            # (`EncodedMessages`), not message by message.
            messages = joined_input(head, body, at, jsons)
        else:
            messages = head + body
        return PreparedInput(
            messages=messages,
            base_generation=session.generation,
            estimated_tokens=total,
            dropped_for_budget=start,
            compacted_through=through,
        )

    def _walk(
        self,
        history: list[Message],
        pending: list[PendingMessage],
        through: int,
        exclude_turn_partials: str | None,
        budget: int,
        head_total: int,
        count: Any,
        name: str,
    ) -> tuple[list[Item], int, int, bool]:
        """The model input's items from the stored `history` and this turn's `pending`
        messages, the first one the budget keeps, the tokens of the head and of what it
        keeps, and whether every stored message of it was a plain one (`Replayed.plain`)."""
        items: list[Item] = []
        answers: dict[str, int] = {}
        # This walk runs for every message of the window before every first token: the
        # usual message (`plain`) costs a lookup and an append.
        tools = mixed = False
        for m in history:
            r = m.__dict__.get(REPLAYED) or replayed(m)
            if r.skipped or m.seq <= through:
                continue
            if exclude_turn_partials and m.status and str(m.turn_id) == exclude_turn_partials:
                continue
            if r.plain:
                items.append(r.item)
                if r.answer:
                    answers[r.id] = len(items) - 1
            else:
                tools, mixed = tools or r.tool, True
                replay(items, answers, m, r)
        for p in pending:
            tools = tools or p.role == "tool" or bool(p.tool_calls)
            items.append(Item(message_to_openai(p), None, in_turn=True))
        if tools:
            items = sanitize_tool_pairs(items)

            # C8: trim oversized tool results of earlier turns, in the model input only.
            limit = settings.CHAT["TOOL_RESULT_TRIM_CHARS"]
            for i, it in enumerate(items):
                content = it.data["content"]
                if not it.in_turn and it.data["role"] == "tool" and len(content) > limit:
                    key = ("trimmed", it.key) if it.key is not None else None
                    items[i] = Item(
                        {**it.data, "content": content[:limit] + TRIMMED_NOTE}, key, seq=it.seq
                    )

        # Keep within budget by leaving out the oldest messages, never this turn's nor the
        # last stored one (this turn's user message). Walking back from the newest message
        # counts each message at most once, and only those that can still fit (STYLE 18).
        total = head_total
        keep = next((i for i, it in enumerate(items) if it.in_turn), len(items))
        keep = max(0, keep - 1)
        counts = [0] * len(items)
        for i in range(keep, len(items)):
            counts[i] = count(items[i])
            total += counts[i]
        start = keep
        while start > 0:
            it = items[start - 1]
            # A message counted before (the usual case) at the cost of a lookup.
            n = it.tokens.get(name) if it.tokens is not None else None
            if n is None:
                n = count(it)
            if total + n > budget:
                break
            start -= 1
            counts[start] = n
            total += n
        while start < len(items) and items[start].data["role"] == "tool":
            total -= counts[start]
            start += 1
        return items, start, total, not mixed
