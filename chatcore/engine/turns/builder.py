"""The turn input builder (C7): system prompt + skills + memory notes + active plan (read
concurrently) + compacted history + this turn's messages, with one runtime-context block
appended to the last user message. Overflow recovery goes through the same assembly with a
tighter budget, so nothing is ever appended twice.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection

from sessions_app.models import Compaction, MemoryNote, Message, MessageKind, Session

from ..sessions import SessionStates
from .outcome import PendingMessage

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You are a helpful assistant in a chat application. Answer in the language of the user. "
    "Use Markdown for structure when it helps. Use the tools when they help; do not invent "
    "tool results."
)
RUNTIME_MARKER = "\n\n[runtime context]\n"
TRIMMED_NOTE = "\n[... trimmed for the model's context ...]"


def estimate_tokens(messages: list[dict[str, Any]]) -> int:
    """A conservative estimate: ~4 characters a token, CJK characters one token each, plus a
    small overhead per message."""
    total = 0
    for m in messages:
        text = str(m.get("content") or "")
        if m.get("tool_calls"):
            text += str(m["tool_calls"])
        cjk = sum(1 for ch in text if "\u3000" <= ch <= "\u9fff" or "\uac00" <= ch <= "\ud7af")
        total += cjk + (len(text) - cjk) // 4 + 4
    return total


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


def message_to_openai(m: Message | PendingMessage) -> dict[str, Any]:
    data: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.tool_calls:
        data["tool_calls"] = m.tool_calls
        if m.role == "assistant" and not m.content:
            # E5: no empty assistant text beside tool calls; some backends reject "".
            data["content"] = None
    if m.role == "tool":
        data["tool_call_id"] = m.tool_call_id
    return data


CONTINUE_INSTRUCTION = (
    "Your previous answer was cut off because it reached the length limit. Continue it "
    "exactly where it stopped, without repeating anything already written and without any "
    "preamble."
)


def _replay(body: list[dict[str, Any]], answers: dict[str, int], m: Message) -> None:
    """Add a stored message to the model input (E5): an empty assistant text is never
    replayed, and a continuation is joined to the answer it continues, so the model sees
    one answer, as the user does. `answers` maps answer message ids to their index."""
    is_answer = m.role == "assistant" and not m.tool_calls
    if is_answer and not (m.content or "").strip():
        return
    target = str((m.source or {}).get("continues") or "")
    if is_answer and target in answers:
        index = answers[target]
        body[index] = {**body[index], "content": (body[index]["content"] or "") + m.content}
        answers[str(m.id)] = index
        return
    body.append(message_to_openai(m))
    if is_answer:
        answers[str(m.id)] = len(body) - 1


def _sanitize_tool_pairs(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keep the model input well formed: tool results need their call and the reverse (a
    cancelled turn may have stored one without the other)."""
    answered = {m.get("tool_call_id") for m in items if m["role"] == "tool"}
    called: set[str] = set()
    out: list[dict[str, Any]] = []
    for m in items:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [c for c in m["tool_calls"] if c.get("id") in answered]
            m = dict(m)
            if calls:
                m["tool_calls"] = calls
                called.update(c["id"] for c in calls)
            else:
                m.pop("tool_calls")
                if not m["content"]:
                    continue
        elif m["role"] == "tool" and m.get("tool_call_id") not in called:
            continue
        out.append(m)
    return out


class TurnInputBuilder:
    def __init__(
        self,
        *,
        states: SessionStates,
        context_window: int | None = None,
        skills_dir: str | Path | None = None,
        system_prompt: str = SYSTEM_PROMPT,
    ) -> None:
        self.states = states
        self.context_window = context_window or settings.LLM["CONTEXT_WINDOW"]
        self.skills = load_skills(skills_dir or settings.CHAT["SKILLS_DIR"])
        self.system_prompt = system_prompt

    async def prepare(
        self,
        *,
        session_pk: str,
        runtime: RuntimeInfo,
        pending: list[PendingMessage] | None = None,
        exclude_turn_partials: str | None = None,
        budget_ratio: float | None = None,
    ) -> PreparedInput:
        ratio = budget_ratio or settings.CHAT["COMPACTION_BUDGET_RATIO"]
        session, history, compaction = await sync_to_async(self._load_history)(session_pk)
        # C7: memory and plan do not depend on each other; read them concurrently.
        notes, plan = await asyncio.gather(
            sync_to_async(_memory_notes, thread_sensitive=False)(session.owner_id),
            sync_to_async(_plan, thread_sensitive=False)(session_pk),
        )
        return self.assemble(
            session=session,
            history=history,
            compaction=compaction,
            notes=notes,
            plan=plan,
            runtime=runtime,
            pending=pending or [],
            exclude_turn_partials=exclude_turn_partials,
            budget=int(self.context_window * ratio),
        )

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

    def _load_history(self, session_pk: str) -> tuple[Session, list[Message], Compaction | None]:
        session = Session.objects.get(pk=session_pk)
        history = self.states.history(session)
        compaction = (
            Compaction.objects.filter(session_id=session_pk).order_by("-through_seq").first()
        )
        return session, history, compaction

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

        body: list[dict[str, Any]] = []
        answers: dict[str, int] = {}
        for m in history:
            if m.seq <= through or m.kind == MessageKind.WELCOME or m.role == "system":
                continue
            if exclude_turn_partials and m.status and str(m.turn_id) == exclude_turn_partials:
                continue
            _replay(body, answers, m)
        turn_start = len(body)
        body.extend(message_to_openai(p) for p in pending)
        body = _sanitize_tool_pairs(body)

        # C8: trim oversized tool results of earlier turns, in the model input only.
        limit = settings.CHAT["TOOL_RESULT_TRIM_CHARS"]
        for i, item in enumerate(body[:turn_start]):
            if item["role"] == "tool" and len(item["content"]) > limit:
                body[i] = {**item, "content": item["content"][:limit] + TRIMMED_NOTE}

        # Keep within budget by leaving out the oldest messages (never this turn's).
        dropped = 0
        while body and estimate_tokens(head + body) > budget and dropped < max(0, turn_start - 1):
            body.pop(0)
            dropped += 1
        while body and body[0]["role"] == "tool":
            body.pop(0)
            dropped += 1

        # C7: the runtime context block, exactly once, on the last user message.
        for i in range(len(body) - 1, -1, -1):
            if body[i]["role"] == "user":
                body[i] = {**body[i], "content": body[i]["content"] + runtime.render()}
                break
        messages = head + body
        return PreparedInput(
            messages=messages,
            base_generation=session.generation,
            estimated_tokens=estimate_tokens(messages),
            dropped_for_budget=dropped,
            compacted_through=through,
        )


def _memory_notes(owner_id: int) -> list[str]:
    try:
        rows = MemoryNote.objects.filter(owner_id=owner_id).order_by("-created_at")[:20]
        return [n.content for n in reversed(list(rows))]
    finally:
        # Runs on a pool thread; do not leave its connection open behind it.
        connection.close()


def _plan(session_pk: str) -> str:
    try:
        return Session.objects.filter(pk=session_pk).values_list("plan", flat=True).first() or ""
    finally:
        connection.close()
