"""Reads. Every query that answers a client goes through here and is scoped to its owner
(F2): another user's dialog is simply not found."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone
from django.utils.translation import gettext as _

from chatcore.engine.errors import NotFound, ReadOnlyDialog
from chatcore.engine.ids import FIRST_PARTY_CHANNELS, SessionKey

from .models import ChannelChat, Message, Session, StagedInput, Turn, TurnStatus

HISTORY_PAGE_DEFAULT = 100
HISTORY_PAGE_MAX = 500


def live_sessions_for_owner(*, owner_id: int) -> QuerySet[Session]:
    return Session.objects.filter(owner_id=owner_id, deleted_at__isnull=True)


def session_get_for_owner(*, owner_id: int, session_id: str) -> Session:
    """Resolve a public `channel:chat_id:dialog_id` to the caller's live dialog."""
    try:
        key = SessionKey.parse(session_id)
    except Exception as exc:
        raise NotFound(_("Dialog not found.")) from exc
    session = (
        live_sessions_for_owner(owner_id=owner_id)
        .filter(channel=key.channel, chat_id=key.chat_id, dialog_id=key.dialog_id)
        .first()
    )
    if session is None:
        raise NotFound(_("Dialog not found."))
    return session


def dialog_get(*, owner_id: int, channel: str, chat_id: str, dialog_id: str) -> Session:
    session = (
        live_sessions_for_owner(owner_id=owner_id)
        .filter(channel=channel, chat_id=chat_id, dialog_id=dialog_id)
        .first()
    )
    if session is None:
        raise NotFound(_("Dialog %(id)s does not exist.") % {"id": dialog_id})
    return session


def dialog_list_for_chat(
    *, owner_id: int, channel: str, chat_id: str, limit: int = 10, offset: int = 0
) -> list[Session]:
    """The chat's live dialogs, most recently active first (B3 `/sessions`)."""
    qs = live_sessions_for_owner(owner_id=owner_id).filter(channel=channel, chat_id=chat_id)
    return list(qs.order_by("-last_active_at", "-created_at")[offset : offset + limit])


def session_list_for_owner(
    *,
    owner_id: int,
    channel: str | None = None,
    chat_id: str | None = None,
    limit: int = 10,
    offset: int = 0,
) -> tuple[list[Session], int]:
    qs = live_sessions_for_owner(owner_id=owner_id)
    if channel:
        qs = qs.filter(channel=channel)
    if chat_id:
        qs = qs.filter(chat_id=chat_id)
    qs = qs.order_by("-last_active_at", "-created_at")
    return list(qs[offset : offset + limit]), qs.count()


def dialog_most_recent_live(*, owner_id: int, channel: str, chat_id: str) -> Session | None:
    """B1: the most recently active live dialog of a chat if it is within the TTL."""
    ttl = timedelta(seconds=settings.CHAT["SESSION_TTL_SECONDS"])
    return (
        live_sessions_for_owner(owner_id=owner_id)
        .filter(channel=channel, chat_id=chat_id, last_active_at__gte=timezone.now() - ttl)
        .order_by("-last_active_at", "-created_at")
        .first()
    )


def messages_page(
    *, session_pk: str, before_seq: int | None = None, limit: int = HISTORY_PAGE_DEFAULT
) -> tuple[list[Message], bool]:
    """The most recent page of history (older than `before_seq` when given), oldest first."""
    limit = max(1, min(limit, HISTORY_PAGE_MAX))
    qs = Message.objects.filter(session_id=session_pk)
    if before_seq is not None:
        qs = qs.filter(seq__lt=before_seq)
    rows = list(qs.order_by("-seq")[: limit + 1])
    has_more = len(rows) > limit
    return list(reversed(rows[:limit])), has_more


def messages_from(
    *, session_pk: str, from_seq: int = 0, limit: int = HISTORY_PAGE_DEFAULT
) -> tuple[list[Message], bool]:
    """Messages with seq >= from_seq, ascending (API pagination, stable under appends)."""
    limit = max(1, min(limit, HISTORY_PAGE_MAX))
    rows = list(
        Message.objects.filter(session_id=session_pk, seq__gte=from_seq).order_by("seq")[
            : limit + 1
        ]
    )
    return rows[:limit], len(rows) > limit


def messages_for_context(*, session_pk: str, after_seq: int = 0) -> list[Message]:
    return list(Message.objects.filter(session_id=session_pk, seq__gt=after_seq).order_by("seq"))


def turn_queue(*, session_pk: str) -> list[Turn]:
    return list(
        Turn.objects.filter(session_id=session_pk, status=TurnStatus.QUEUED).order_by("number")
    )


def turn_running(*, session_pk: str) -> Turn | None:
    return Turn.objects.filter(session_id=session_pk, status=TurnStatus.RUNNING).first()


def turn_get_for_owner(*, owner_id: int, turn_id: str) -> Turn:
    try:
        return Turn.objects.select_related("session").get(pk=turn_id, owner_id=owner_id)
    except (Turn.DoesNotExist, ValueError, Exception) as exc:
        raise NotFound(_("Turn not found.")) from exc


def staged_for_session(*, session_pk: str) -> list[StagedInput]:
    return list(StagedInput.objects.filter(session_id=session_pk, status=StagedInput.Status.STAGED))


def external_write_allowed(*, user_id: int, session: Session) -> bool:
    """Whether a write from the web or the API may go into a chat-app dialog: yes unless the
    writer is the web user an operator linked the chat's account to read-only."""
    chat = (
        ChannelChat.objects.filter(channel=session.channel, chat_id=session.chat_id)
        .select_related("account")
        .first()
    )
    if chat is None or chat.account.user_id != user_id:
        return True
    return chat.account.writable


def dialog_check_writable(*, user_id: int, session: Session) -> None:
    """Refuse (`read_only`) any write of a web or API user into a chat-app dialog linked to
    them read-only: sends, steers, stop, retry, continue, rename, delete, compact."""
    if session.channel in FIRST_PARTY_CHANNELS:
        return
    if not external_write_allowed(user_id=user_id, session=session):
        raise ReadOnlyDialog()


def session_get_for_writer(*, owner_id: int, session_id: str) -> Session:
    """`session_get_for_owner` for a write: also refused when the dialog is read-only."""
    session = session_get_for_owner(owner_id=owner_id, session_id=session_id)
    dialog_check_writable(user_id=owner_id, session=session)
    return session


def linked_dialogs_for_user(*, user_id: int, limit: int = 50) -> list[tuple[Session, bool]]:
    """The chat-app dialogs of the accounts an operator linked to this web user, most
    recently active first, each with whether it is read-only for them (A1)."""
    sessions = list(
        live_sessions_for_owner(owner_id=user_id)
        .exclude(channel__in=FIRST_PARTY_CHANNELS)
        .order_by("-last_active_at", "-created_at")[:limit]
    )
    if not sessions:
        return []
    writable = dict(
        ((channel, chat_id), can_write)
        for channel, chat_id, can_write in ChannelChat.objects.filter(
            account__user_id=user_id
        ).values_list("channel", "chat_id", "account__writable")
    )
    return [(s, not writable.get((s.channel, s.chat_id), True)) for s in sessions]
