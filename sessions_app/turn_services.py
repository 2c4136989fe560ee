"""Writes a running turn and its background jobs make besides messages: the turn's end, its
staged inputs, compactions (B5), memory notes and the dialog's plan (tools). Queue writes
(enqueue, claim, stop) are in `chatcore.engine.queue`; messages in `services`.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from . import branches, rows
from .models import Compaction, MemoryNote, Session, StagedInput, Turn


def turn_finish(*, turn_pk: Any, **fields: Any) -> None:
    """Close a turn: its status fields, the finish time, no partial text left (every turn
    ends here: one UPDATE without query compilation, `rows`)."""
    values = {"finished_at": timezone.now(), "partial_text": "", **fields}
    rows.update(Turn(pk=turn_pk, **values), values)


def staged_inputs_record(*, pks: list[Any], turn: Turn | None = None) -> None:
    """Staged steers/injects that entered history (C4, C5)."""
    fields: dict[str, Any] = {"status": StagedInput.Status.RECORDED}
    if turn is not None:
        fields["recorded_in"] = turn
    StagedInput.objects.filter(pk__in=pks).update(**fields)


def compaction_commit(
    *, session_pk: str, through: int, generation: int, summary: str
) -> Session | None:
    """B5: store a summary of history up to `through`, only if the dialog was not cleared or
    deleted since (`generation`) and no newer compaction landed meanwhile."""
    with transaction.atomic():
        session = Session.objects.select_for_update().filter(pk=session_pk).first()
        if session is None or session.deleted_at is not None or session.generation != generation:
            return None
        newer = Compaction.objects.filter(session_id=session_pk, through_seq__gte=through)
        ends = list(newer.values_list("through_seq", flat=True))
        if ends and session.forked:
            # H1: only a newer summary of this path counts (another branch's covers other
            # messages).
            on_path = set(branches.active_path(session) or [])
            ends = [end for end in ends if end in on_path]
        if ends:
            return None
        Compaction.objects.create(session_id=session_pk, through_seq=through, summary=summary)
        Session.objects.filter(pk=session_pk).update(state_version=session.state_version + 1)
    return session


def memory_note_add(*, owner_id: int, content: str) -> MemoryNote:
    """A note the assistant keeps about its user across dialogs (tool `remember`)."""
    return MemoryNote.objects.create(owner_id=owner_id, content=content)


def session_plan_set(*, session_pk: str, plan: str) -> None:
    """Replace a dialog's working plan (tool `plan_update`)."""
    Session.objects.filter(pk=session_pk).update(plan=plan)
