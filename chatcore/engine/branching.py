"""Edit, regenerate and branch (SPEC H1, PROTOCOL "Branches"), as the engine runs them.

An edit or a regenerate is a turn like a send: refused with `bad_request` for a seq of the
wrong role or not in the dialog, charged to the send rate (F7), queued durably behind the
dialog's other turns (C1, C2: never interleaved with a running one), stopped by `/stop` and
retried like any turn. Its branch becomes active when it starts
(`branch_services.turn_branch_start`, in the transaction that claims it, `queue._begin_locked`).
A `branch` only moves the dialog's head to another leaf and is answered by `session_history`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from chatcore.common.dbthreads import on_db
from chatcore.common.errors import BadRequest
from sessions_app import branch_services, storage
from sessions_app.models import Session, TurnMode

from . import queue
from .ingress import Ack, check_content, check_model_work

if TYPE_CHECKING:
    from .engine import Engine


def enqueue_edit(
    session: Session,
    *,
    owner_id: int,
    seq: object,
    content: str,
    client_msg_id: str,
    source: dict[str, Any],
    cfg: dict[str, Any],
) -> Ack:
    """Queue an `edit` turn: its user message, `content`, will be a sibling of message `seq`."""

    def write() -> Ack:
        with transaction.atomic():
            live = queue.lock_live(session.pk)
            edited = branch_services.edit_target(live, seq)
            kept = {"edit_of": edited.seq}
            if edited.media_refs:
                kept["attachments"] = edited.media_refs  # H3: the new version keeps its files
            turn = queue.enqueue_locked(
                live,
                cfg=cfg,
                owner_id=owner_id,
                content=content,
                client_msg_id=client_msg_id,
                source={**source, **kept},
                received_at=timezone.now(),
                mode=TurnMode.EDIT,
            )
            return Ack(live, str(turn.pk), queue.position(turn), TurnMode.EDIT, client_msg_id)

    return storage.storage_retry(write, what="edit", session=session)


def enqueue_regenerate(
    session: Session,
    *,
    owner_id: int,
    seq: object | None,
    client_msg_id: str,
    source: dict[str, Any],
    cfg: dict[str, Any],
) -> Ack:
    """Queue a `regenerate` turn: a new answer to the user message that answer `seq` (default:
    the active path's last answer) answers, as a sibling of it."""

    def write() -> Ack:
        with transaction.atomic():
            live = queue.lock_live(session.pk)
            answer, answered = branch_services.regenerate_target(live, seq)
            turn = queue.enqueue_locked(
                live,
                cfg=cfg,
                owner_id=owner_id,
                content="",
                client_msg_id=client_msg_id,
                source={**source, "regenerate_of": answer.seq, "answers": answered},
                received_at=timezone.now(),
                mode=TurnMode.REGENERATE,
            )
            return Ack(live, str(turn.pk), queue.position(turn), TurnMode.REGENERATE, client_msg_id)

    return storage.storage_retry(write, what="regenerate", session=session)


def _source(owner: User, channel: str, client_msg_id: str) -> dict[str, Any]:
    data: dict[str, Any] = {"from_channel": channel, "from_user_id": str(owner.pk)}
    if client_msg_id:
        data["client_msg_id"] = client_msg_id
    return data


async def edit(
    engine: Engine,
    session: Session,
    *,
    owner: User,
    seq: object,
    content: object,
    channel: str,
    client_msg_id: str = "",
) -> Ack:
    """H1 `edit`: checked like a send's text, charged like a send, then queued and run."""
    text = check_content(content, cfg=engine.cfg)
    # Bad input is refused before the send budget is charged (it changes nothing).
    await on_db(branch_services.edit_target)(session, seq)
    await check_model_work(owner, cfg=engine.cfg, closing=engine.closing)
    ack = await on_db(enqueue_edit)(
        session,
        owner_id=owner.pk,
        seq=seq,
        content=text,
        client_msg_id=client_msg_id,
        source=_source(owner, channel, client_msg_id),
        cfg=engine.cfg,
    )
    await engine.kick(session.pk)
    return ack


async def regenerate(
    engine: Engine,
    session: Session,
    *,
    owner: User,
    seq: object | None,
    channel: str,
    client_msg_id: str = "",
) -> Ack:
    """H1 `regenerate`: charged like a send, then queued and run."""
    await on_db(branch_services.regenerate_target)(session, seq)
    await check_model_work(owner, cfg=engine.cfg, closing=engine.closing)
    ack = await on_db(enqueue_regenerate)(
        session,
        owner_id=owner.pk,
        seq=seq,
        client_msg_id=client_msg_id,
        source=_source(owner, channel, client_msg_id),
        cfg=engine.cfg,
    )
    await engine.kick(session.pk)
    return ack


async def branch(session: Session, *, seq: object) -> Session:
    """H1 `branch`: make the branch through `seq` active; the row as written."""
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise BadRequest(_("seq must be a positive integer."))
    return await on_db(branch_services.branch_switch)(session=session, seq=seq)
