"""Writes. Every change of dialogs and messages goes through here (STYLE 2, 3); a dialog's
lifecycle (delete, restore, purge: `lifecycle_services`) and API tokens (`token_services`)
have modules of their own, their functions named here too.

Each write is one transaction, retried on database errors with the configured delays (A4);
events for clients are published only after the transaction commits.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from django.contrib.auth.models import User
from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.utils import timezone
from django.utils.translation import gettext as _

from audit.trail import Action, Actor, audit_dialog
from chatcore.common import events, publish
from chatcore.common.errors import BadRequest, DialogExists, NotFound
from chatcore.common.ids import SessionKey, chat_belongs_to, storable_text, validate_part

from . import branches
from .files import file_uses_record
from .lifecycle_services import session_purge as session_purge
from .lifecycle_services import session_restore as session_restore
from .lifecycle_services import session_soft_delete as session_soft_delete
from .lifecycle_services import sessions_purge_expired as sessions_purge_expired
from .models import (
    Message,
    MessageKind,
    Role,
    Session,
    TitleSource,
    Turn,
)
from .rows import columns as rows_columns
from .rows import cursor as sql_cursor
from .rows import from_row as rows_from_row
from .rows import insert as rows_insert
from .rows import merged as rows_merged
from .rows import update as rows_update
from .storage import storage_retry
from .token_services import api_token_issue as api_token_issue
from .token_services import api_token_revoke as api_token_revoke

logger = logging.getLogger(__name__)

TITLE_MAX = 200


# --- Dialogs ------------------------------------------------------------------------------


def _welcome_text(dialog_id: str, channel: str) -> str:
    if channel == "web":
        # Issue 54: the web chat has a list and menus, not commands to learn first.
        return _("New dialog started. Rename or delete it from its menu in your list of dialogs.")
    return _(
        "New dialog created! Dialog id: %(dialog_id)s\n"
        "Use /sessions to list your dialogs and /switch <id> to change dialog."
    ) % {"dialog_id": dialog_id}


def new_dialog_id() -> str:
    return "d" + secrets.token_hex(4)


def clean_title(title: object) -> str:
    if not isinstance(title, str) or not title.strip():
        raise BadRequest(_("A title must not be empty."))
    if not storable_text(title):
        raise BadRequest(_("The title contains characters that cannot be stored."))
    title = " ".join(title.split())
    if len(title) > TITLE_MAX:
        raise BadRequest(_("A title may have at most %(n)d characters.") % {"n": TITLE_MAX})
    return title


def session_create(
    *,
    owner: User,
    channel: str,
    chat_id: str,
    dialog_id: str | None = None,
    title: str | None = None,
) -> Session:
    """Create a live dialog with its welcome message (B2) and tell the chat's clients."""
    return session_create_with_history(
        owner=owner, channel=channel, chat_id=chat_id, dialog_id=dialog_id, title=title
    )[0]


def session_create_with_history(
    *,
    owner: User,
    channel: str,
    chat_id: str,
    dialog_id: str | None = None,
    title: str | None = None,
    model: str = "",
) -> tuple[Session, list[Message]]:
    """`session_create`, with the new dialog's whole history as stored (its welcome message):
    for the engine's history cache, which then holds the dialog from its start (G6)."""
    key = SessionKey.build(
        channel, chat_id, dialog_id if dialog_id is not None else new_dialog_id()
    )
    if not chat_belongs_to(owner.pk, key.channel, key.chat_id):
        raise NotFound(_("Chat not found."))
    if (
        Session.objects.filter(channel=key.channel, chat_id=key.chat_id)
        .exclude(owner_id=owner.pk)
        .exists()
    ):
        # A1: an external platform's chat belongs to the account that connected it first.
        raise NotFound(_("Chat not found."))
    clean = clean_title(title) if title is not None else None

    def write() -> tuple[Session, Message]:
        with transaction.atomic():
            if Session.objects.filter(
                channel=key.channel,
                chat_id=key.chat_id,
                dialog_id=key.dialog_id,
                deleted_at__isnull=True,
            ).exists():
                raise DialogExists(_("Dialog %(id)s already exists.") % {"id": key.dialog_id})
            now = timezone.now()
            session = Session(
                owner=owner,
                channel=key.channel,
                chat_id=key.chat_id,
                dialog_id=key.dialog_id,
                created_at=now,
                last_active_at=now,
                model=model,
            )
            session.title = clean or session.default_title
            session.title_source = TitleSource.USER if clean else TitleSource.DEFAULT
            session.last_seq = 1
            session.head_seq = 1
            session.total_message_count = 1
            session.state_version = 1
            session.save(force_insert=True)
            welcome = Message.objects.create(
                session=session,
                seq=1,
                role=Role.SYSTEM,
                content=_welcome_text(key.dialog_id, key.channel),
                created_at=now,
                source={"kind": MessageKind.WELCOME},
            )
            transaction.on_commit(lambda: _announce_created(session, welcome))
            return session, welcome

    try:
        session, welcome = storage_retry(write, what="session_create")
    except IntegrityError as exc:
        # Two creators raced for the same key: the loser gets the same clear error.
        raise DialogExists(_("Dialog %(id)s already exists.") % {"id": key.dialog_id}) from exc
    return session, [welcome]


def _announce_created(session: Session, welcome: Message) -> None:
    publish.publish_to_chat(
        session, events.sessions_changed_frame(session_id=session.session_id, change="created")
    )
    publish.publish_to_chat(
        session,
        events.history_delta_frame(
            session_id=session.session_id, turn_id=None, base_revision=0, messages=[welcome]
        ),
    )


def session_rename(
    *, session: Session, title: str, source: str = TitleSource.USER, actor: Actor | None = None
) -> Session:
    """Rename a dialog. A rename by a person always wins over automatic titles (B4).
    `actor` (here and below): who, for the audit record (H5); None is the system."""
    clean = clean_title(title)

    def write() -> None:
        with transaction.atomic():
            live = Session.objects.filter(pk=session.pk, deleted_at__isnull=True)
            old = live.values_list("title", flat=True).first()  # H5: as stored, not as passed
            updated = live.update(
                title=clean, title_source=source, state_version=F("state_version") + 1
            )
            if not updated:
                raise NotFound(_("Dialog not found."))
            audit_dialog(
                actor=actor, action=Action.DIALOG_RENAME, session=session, old=old, new=clean
            )

    storage_retry(write, what="session_rename", session=session)
    session.refresh_from_db()
    publish.publish_to_chat(session, events.session_updated_frame(session=session))
    return session


def title_reset(*, session: Session, actor: Actor | None = None) -> Session:
    """Put the default title back (an operator's "regenerate title"), so the title job may
    replace it."""
    new = session.default_title

    def write() -> None:
        with transaction.atomic():
            Session.objects.filter(pk=session.pk).update(
                title=new,
                title_source=TitleSource.DEFAULT,
                title_attempts=0,
                state_version=F("state_version") + 1,
            )
            audit_dialog(
                actor=actor,
                action=Action.DIALOG_RENAME,
                session=session,
                old=session.title,
                new=new,
            )

    storage_retry(write, what="title_reset", session=session)
    session.refresh_from_db()
    publish.publish_to_chat(session, events.session_updated_frame(session=session))
    return session


def session_touch(*, session_pk: str) -> None:
    Session.objects.filter(pk=session_pk).update(last_active_at=timezone.now())


# --- Messages -----------------------------------------------------------------------------


@dataclass(slots=True)
class NewMessage:
    role: str
    content: str
    kind: str
    created_at: datetime | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    tool_name: str | None = None
    media_refs: list[Any] = field(default_factory=list)
    source: dict[str, Any] = field(default_factory=dict)
    status: str = ""


@dataclass(slots=True)
class Appended:
    session: Session
    base_revision: int
    messages: list[Message]

    @property
    def revision(self) -> int:
        return self.messages[-1].seq if self.messages else self.base_revision


def append_locked(
    locked: Session,
    messages: Sequence[NewMessage],
    *,
    turn: Turn | None = None,
    extra: Callable[[Session], None] | None = None,
    also: Sequence[str] = (),
    parent_seq: int | None | Literal[False] = False,
) -> Appended:
    """The write of `messages_append`, inside the caller's transaction on a session row it
    has locked (the engine records a turn's user message in the transaction that claims it,
    G6). `also`: more fields of `locked` the caller changed, saved in the same update of the
    row. Publishing the delta is the caller's (`announce_appended`). H1: the messages follow
    the dialog's head, one after the other, and the last becomes the head; `parent_seq`: the
    first follows that message instead (an edit's sibling), which forks the dialog."""
    base = locked.last_seq
    now = timezone.now()
    parent = branches.parent_of_append(locked, parent_seq)
    rows = []
    for offset, new in enumerate(messages, start=1):
        source = {"kind": new.kind, **new.source}
        rows.append(
            Message(
                session=locked,
                seq=base + offset,
                parent_seq=parent if offset == 1 else base + offset - 1,
                role=new.role,
                content=new.content,
                created_at=new.created_at or now,
                tool_calls=new.tool_calls,
                tool_call_id=new.tool_call_id or "",
                tool_name=new.tool_name or "",
                media_refs=new.media_refs,
                source=source,
                status=new.status,
                turn=turn,
            )
        )
    # G6: every turn writes here (its user message, its answer): one INSERT and one UPDATE
    # without the ORM's query compilation (`rows`).
    rows_insert(rows)
    if any(m.media_refs for m in messages):
        file_uses_record(session_pk=locked.pk, refs=[r for m in messages for r in m.media_refs])
    tree = branches.appended(locked, rows)  # the head, and the forks it made
    user_count = sum(1 for m in messages if m.kind in USER_KINDS)
    locked.last_seq = base + len(rows)
    locked.total_message_count += len(rows)
    locked.message_count += user_count
    locked.state_version += 1
    locked.last_active_at = now
    rows_update(
        locked,
        [
            "last_seq",
            *tree,
            "total_message_count",
            "message_count",
            "state_version",
            "last_active_at",
            *also,
        ],
    )
    if extra is not None:
        extra(locked)
    return Appended(session=locked, base_revision=base, messages=rows)


def lock_session(session_pk: str) -> Session | None:
    """The dialog's row, locked for the caller's transaction (FOR UPDATE where the database
    has it; SQLite's write transaction already serialises). Every write of a turn starts
    with it, so it is written in SQL: our own table, the id as a parameter."""
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    table = Session._meta.db_table
    sql = f'SELECT {rows_columns(Session, "s")} FROM "{table}" s WHERE s."id" = %s{lock}'  # noqa: S608
    with sql_cursor() as cursor:
        cursor.execute(sql, [session_pk])
        row = cursor.fetchone()
    return None if row is None else rows_from_row(Session, row)


def lock_sessions_free(session_pks: Sequence[str]) -> dict[str, Session]:
    """`lock_session` for many dialogs in one statement, on PostgreSQL: the rows no other
    transaction holds, locked in id order (SKIP LOCKED: a batch never waits for a lock, so
    it is never part of a circle of transactions waiting on each other), by id. A row held
    elsewhere, or gone, is not among them. One text whatever the number of ids."""
    table = Session._meta.db_table
    sql = (
        f'SELECT {rows_columns(Session, "s")} FROM "{table}" s'  # noqa: S608
        ' WHERE s."id" = ANY(%s) ORDER BY s."id" FOR UPDATE SKIP LOCKED'
    )
    with sql_cursor() as cursor:
        cursor.execute(sql, [sorted(set(session_pks))])
        found = [rows_from_row(Session, row) for row in cursor.fetchall()]
    return {str(s.pk): s for s in found}


def messages_append(
    *,
    session_pk: str,
    messages: Sequence[NewMessage],
    turn: Turn | None = None,
    require_generation: int | None = None,
    publish_delta: bool = True,
    extra: Callable[[Session], None] | None = None,
    session: Session | None = None,
    guard: Callable[[Session], None] | None = None,
    then: Callable[[], None] | None = None,
) -> Appended:
    """Append messages atomically; returns them with their seqs (A3, A4).

    `require_generation` makes the append conditional (C9): when the dialog was cleared or
    deleted under the caller, nothing is written and `StaleSession` is raised. `extra` runs
    inside the same transaction (a turn's status update commits with its messages).
    `session`, when the caller has it, names the clients to notify if the write fails.
    `guard` sees the locked session row before anything is written and may refuse by raising
    (G2: a turn's writes check its lease's epoch in the same transaction). `then` runs last
    inside the transaction, after the writes (a read that must see them, on the locked row).
    """
    if not messages:
        raise ValueError("nothing to append")
    probe = session if session is not None else Session.objects.filter(pk=session_pk).first()

    def write() -> Appended:
        with transaction.atomic():
            locked = lock_session(session_pk)
            if locked is None:
                raise Session.DoesNotExist(session_pk)
            if guard is not None:
                guard(locked)
            if require_generation is not None and (
                locked.generation != require_generation or locked.deleted_at is not None
            ):
                raise StaleSession()
            # G6: the messages, the row's update and what `extra` writes (a turn's end) go
            # as one statement on PostgreSQL (`rows.merged`): a turn's commit is the lock and
            # this, not one round trip per write.
            with rows_merged():
                appended = append_locked(locked, messages, turn=turn, extra=extra)
            if then is not None:
                then()
            if publish_delta:
                transaction.on_commit(lambda: announce_appended(appended, turn))
            return appended

    return storage_retry(write, what="messages_append", session=probe)


# A2: message_count counts the user's own messages as they enter history.
USER_KINDS = frozenset({MessageKind.USER_INPUT, MessageKind.STEER})


class StaleSession(Exception):
    """The dialog changed or was deleted under a conditional write (C9)."""


def appended_frame(appended: Appended, turn: Turn | None) -> dict[str, Any]:
    """The `history_delta` frame of an append (D2)."""
    return events.history_delta_frame(
        session_id=appended.session.session_id,
        turn_id=str(turn.pk) if turn else None,
        base_revision=appended.base_revision,
        messages=appended.messages,
    )


def announce_appended(appended: Appended, turn: Turn | None) -> None:
    publish.publish_to_chat(appended.session, appended_frame(appended, turn))


def messages_clear(*, session: Session) -> int:
    """Remove a dialog's messages; seqs are never reused (A3)."""

    def write() -> int:
        with transaction.atomic():
            deleted, _ = Message.objects.filter(session_id=session.pk).delete()
            Session.objects.filter(pk=session.pk).update(
                message_count=0,
                total_message_count=0,
                head_seq=0,
                forked=False,
                forks={},
                state_version=F("state_version") + 1,
                generation=F("generation") + 1,
            )
            return deleted

    count = storage_retry(write, what="messages_clear", session=session)
    session.refresh_from_db()
    return count


def validate_dialog_id(value: object) -> str:
    return validate_part(value, field="dialog_id")
