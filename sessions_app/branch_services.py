"""Writes of the message tree (SPEC H1): moving a dialog's head. Stored messages are never
rewritten: an edit or a regenerate adds a sibling (`services.append_locked`), a branch switch
only moves `Session.head_seq`. A move of the head changes the active path, so it raises the
history revision (D2: `last_seq`, which then skips a number no message takes) and the state
version, and is announced to the dialog's connections (`events.path_changed_frame`), which
answer their clients with a fresh `session_history`."""

from __future__ import annotations

from typing import Literal

from django.db import transaction
from django.utils.translation import gettext as _

from chatcore.common import events, publish
from chatcore.common.errors import BadRequest, NotFound

from . import branches
from .models import Message, Role, Session, Turn, TurnMode, TurnStatus
from .rows import update as rows_update
from .services import lock_session
from .storage import storage_retry


def move_head(live: Session, head: int) -> None:
    """Make `head` the dialog's head on its locked row, in the caller's transaction, and
    announce the new path once that commits."""
    live.head_seq = head
    live.forked = True
    live.last_seq += 1
    live.state_version += 1
    rows_update(live, ["head_seq", "forked", "last_seq", "state_version"])
    announce_path(live)


def announce_path(live: Session) -> None:
    """Once the transaction commits: every connection showing the dialog reloads it (at the
    revision the row has then: an edit's user message is appended after this call)."""

    def publish_path() -> None:
        frame = events.path_changed_frame(
            session_id=live.session_id, history_revision=live.last_seq
        )
        publish.publish_to_chat(live, frame)

    transaction.on_commit(publish_path)


def turn_branch_start(live: Session, turn: Turn) -> int | None | Literal[False]:
    """What an edit or regenerate turn does to the tree as it starts (on the dialog's locked
    row, in the claiming transaction): an edit's user message becomes a sibling of the edited
    one (returned: the parent its append gets); a regenerate moves the head back to the user
    message it answers again, so its answer becomes a sibling of the old one. False for every
    other turn (its messages follow the head)."""
    if turn.mode == TurnMode.EDIT:
        edited = turn.source.get("edit_of")
        row = (
            Message.objects.filter(session_id=live.pk, seq=edited)
            .values_list("parent_seq", flat=True)
            .first()
            if isinstance(edited, int)
            else None
        )
        if row is None and not Message.objects.filter(session_id=live.pk, seq=edited).exists():
            return False  # history cleared since: the new text follows the head
        live.forked = True
        announce_path(live)
        return row
    if turn.mode == TurnMode.REGENERATE:
        answers = turn.source.get("answers")
        if (
            isinstance(answers, int)
            and Message.objects.filter(session_id=live.pk, seq=answers).exists()
        ):
            move_head(live, answers)
    return False


def branch_switch(*, session: Session, seq: int) -> Session:
    """H1 `branch`: make the branch through `seq` active, down to its newest leaf. Refused
    while the dialog runs or waits to run a turn (its answer belongs to the path it started
    on); a seq not in the dialog is a bad request. Returns the row as written."""

    def write() -> Session:
        with transaction.atomic():
            live = lock_session(session.pk)
            if live is None or live.deleted_at is not None:
                raise NotFound(_("Dialog not found."))
            parents = branches.parents_of(live.pk)
            if seq not in parents:
                raise BadRequest(_("Message #%(seq)d is not in this dialog.") % {"seq": seq})
            busy = Turn.objects.filter(
                session_id=live.pk, status__in=(TurnStatus.QUEUED, TurnStatus.RUNNING)
            ).exists()
            if busy:
                raise BadRequest(_("Wait until the answer is done to switch versions."))
            leaf = branches.newest_leaf(parents, seq)
            if live.forked and leaf == live.head_seq:
                return live
            move_head(live, leaf)
            return live

    return storage_retry(write, what="branch", session=session)


def edit_target(session: Session, seq: object) -> Message:
    """The user message an edit replaces (bad request: not a seq of the dialog's user
    messages)."""
    message = _message(session, seq)
    if message.role != Role.USER:
        raise BadRequest(_("Only your own messages can be edited."))
    return message


def regenerate_target(session: Session, seq: object | None) -> tuple[Message, int]:
    """The answer a regenerate asks for again (default: the last answer of the active path)
    and the user message it answers (bad request: not an answer of the dialog)."""
    if seq is None:
        if session.forked:
            # The newest answer of the active path, walked up from its head.
            newest = branches.page_before(session, None, 50)
            found = [m for m in newest if m.role == Role.ASSISTANT][:1]
        else:
            answers = Message.objects.filter(session_id=session.pk, role=Role.ASSISTANT)
            found = list(answers.order_by("-seq").only("seq")[:1])
        if not found:
            raise BadRequest(_("There is no answer to regenerate."))
        seq = found[0].seq
    message = _message(session, seq)
    if message.role != Role.ASSISTANT:
        raise BadRequest(_("Only an answer can be regenerated."))
    # Up from the answer to the user message it answers (past a turn's tool calls and
    # results): a few lookups by seq.
    answered, at = None, message.parent_seq
    while at is not None:
        step = Message.objects.filter(session_id=session.pk, seq=at)
        above = step.values_list("role", "parent_seq").first()
        if above is None:
            break
        if above[0] == Role.USER:
            answered = at
            break
        at = above[1]
    if answered is None:
        raise BadRequest(_("This answer answers no message of yours."))
    return message, answered


def _message(session: Session, seq: object) -> Message:
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise BadRequest(_("seq must be a positive integer."))
    message = Message.objects.filter(session_id=session.pk, seq=seq).first()
    if message is None:
        raise BadRequest(_("Message #%(seq)d is not in this dialog.") % {"seq": seq})
    return message
