"""The data of chat apps (synchronous ORM; callers use `sync_to_async`): accounts, chats and
their current dialog, durable de-duplication of inbound events, and streaming deliveries.

Ownership (A1): every dialog of a platform chat is owned by the Django identity of the
account that connected the chat (the first account whose message reached the bot from it).
An account's identity is the user an operator linked it to, else its own service user, so
linking an account moves its chats' dialogs to that user (they appear in the user's dialog
lists), and unlinking moves them back.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.utils import timezone

from audit.trail import Actor, audit_account_link
from chatcore.common.errors import NotFound
from chatcore.common.ids import validate_part
from chatcore.engine.sessions import resolve_dialog
from sessions_app.channel_models import (
    ChannelAccount,
    ChannelChat,
    ChannelDelivery,
    ChannelEvent,
)
from sessions_app.models import (
    Message,
    MessageStatus,
    Role,
    Session,
    Turn,
    TurnStatus,
)

SERVICE_USER_PREFIX = "chatapp"


@dataclass
class ChatContext:
    """Who wrote, whose chat it is, and the chat's current dialog."""

    sender: User  # the engine acts for this identity: per-user limits apply to it (F6, F7)
    owner: User  # owns the chat's dialogs (A1)
    chat: ChannelChat
    current: Session


# A taken event that was neither accepted nor released (its process died in between) is
# handled again by a redelivery once its claim is this old.
EVENT_CLAIM_TIMEOUT = timedelta(seconds=30)


@dataclass(frozen=True)
class EventClaim:
    """This process's hold on one inbound event until its work is accepted."""

    channel: str
    event_id: str
    token: str


class EventAlreadyAccepted(Exception):
    """Another handler took over the event (its claim timed out) and accepted it."""


def event_take(
    *, channel: str, event_id: str, stale_after: timedelta = EVENT_CLAIM_TIMEOUT
) -> EventClaim | None:
    """Take an inbound event to handle it; None when it was accepted before (a redelivery)
    or another handler holds a fresh claim on it. The unique row makes this hold across
    processes and restarts (D5)."""
    token = uuid.uuid4().hex
    now = timezone.now()
    try:
        with transaction.atomic():
            ChannelEvent.objects.create(
                channel=channel, event_id=event_id, claim=token, claimed_at=now
            )
        return EventClaim(channel, event_id, token)
    except IntegrityError:
        pass
    # Taken before but never accepted, by a handler that is gone: take it over.
    taken = ChannelEvent.objects.filter(
        channel=channel,
        event_id=event_id,
        done_at__isnull=True,
        claimed_at__lt=now - stale_after,
    ).update(claim=token, claimed_at=now)
    return EventClaim(channel, event_id, token) if taken else None


def event_accept(claim: EventClaim) -> None:
    """Mark the event handled. Called inside the transaction that accepts its work (the turn
    enqueued, the input staged), so the two commit together or not at all; raises
    `EventAlreadyAccepted` (rolling that transaction back) when the claim is no longer ours."""
    marked = ChannelEvent.objects.filter(
        channel=claim.channel, event_id=claim.event_id, claim=claim.token, done_at__isnull=True
    ).update(done_at=timezone.now())
    if not marked:
        raise EventAlreadyAccepted(f"{claim.channel}:{claim.event_id}")


def event_release(claim: EventClaim) -> None:
    """Give the event back (its work could not be stored): the platform's redelivery is
    then handled at once instead of after the claim timeout."""
    ChannelEvent.objects.filter(
        channel=claim.channel, event_id=claim.event_id, claim=claim.token, done_at__isnull=True
    ).delete()


def events_purge(*, older_than: timedelta) -> int:
    deleted, _rows = ChannelEvent.objects.filter(
        received_at__lt=timezone.now() - older_than
    ).delete()
    return deleted


def account_get_or_create(
    *, channel: str, external_id: str, display_name: str = ""
) -> ChannelAccount:
    """The account of a platform user, made on first contact with its own service user."""
    account = (
        ChannelAccount.objects.select_related("user", "service_user")
        .filter(channel=channel, external_id=external_id)
        .first()
    )
    now = timezone.now()
    if account is not None:
        changes = {"last_seen_at": now}
        if display_name and display_name != account.display_name:
            changes["display_name"] = display_name  # type: ignore[assignment]
        ChannelAccount.objects.filter(pk=account.pk).update(**changes)
        return account
    try:
        with transaction.atomic():
            service = get_user_model().objects.create(
                username=f"{SERVICE_USER_PREFIX}.{channel}.{external_id}"[:150],
                first_name=display_name[:150],
            )
            service.set_unusable_password()
            service.save(update_fields=["password"])
            return ChannelAccount.objects.create(
                channel=channel,
                external_id=external_id,
                display_name=display_name[:200],
                service_user=service,
            )
    except IntegrityError:
        # Another process made it first.
        return ChannelAccount.objects.select_related("user", "service_user").get(
            channel=channel, external_id=external_id
        )


def identity(account: ChannelAccount) -> User:
    return account.user if account.user is not None else account.service_user


def chat_context(
    *,
    channel: str,
    chat_id: str,
    is_group: bool,
    chat_title: str,
    sender_id: str,
    sender_name: str,
) -> ChatContext:
    """The account, the chat (connected by this account when new) and its current dialog:
    the persisted one while it lives, else B1 (most recent within the TTL, else new)."""
    validate_part(chat_id, field="chat_id")
    account = account_get_or_create(
        channel=channel, external_id=sender_id, display_name=sender_name
    )
    chat = (
        ChannelChat.objects.select_related("account__user", "account__service_user")
        .filter(channel=channel, chat_id=chat_id)
        .first()
    )
    if chat is None:
        try:
            with transaction.atomic():
                chat = ChannelChat.objects.create(
                    channel=channel,
                    chat_id=chat_id,
                    is_group=is_group,
                    title=chat_title[:200],
                    account=account,
                )
        except IntegrityError:
            chat = ChannelChat.objects.get(channel=channel, chat_id=chat_id)
        chat = ChannelChat.objects.select_related("account__user", "account__service_user").get(
            pk=chat.pk
        )
    owner = identity(chat.account)
    current = None
    if chat.current_dialog_id:
        try:
            current = resolve_dialog(
                owner=owner, channel=channel, chat_id=chat_id, dialog_id=chat.current_dialog_id
            )
        except NotFound:
            current = None
    if current is None:
        current = resolve_dialog(owner=owner, channel=channel, chat_id=chat_id)
        chat_set_current(chat=chat, dialog_id=current.dialog_id)
    return ChatContext(sender=identity(account), owner=owner, chat=chat, current=current)


def chat_set_current(*, chat: ChannelChat, dialog_id: str) -> None:
    """Persist the chat's current dialog (it survives restarts)."""
    if chat.current_dialog_id != dialog_id:
        ChannelChat.objects.filter(pk=chat.pk).update(current_dialog_id=dialog_id)
        chat.current_dialog_id = dialog_id


def account_link(
    *, account: ChannelAccount, user: User | None, writable: bool, actor: Actor | None = None
) -> ChannelAccount:
    """An operator links an account to a web user (or unlinks it with None): the dialogs of
    the chats this account connected move to its new identity. `actor` is recorded (H5)."""
    with transaction.atomic():
        locked = ChannelAccount.objects.select_for_update().get(pk=account.pk)
        audit_account_link(
            actor=actor, account=locked, old_user=locked.user, user=user, writable=writable
        )
        locked.user = user
        locked.writable = writable
        locked.save(update_fields=["user", "writable"])
        new_owner = user.pk if user is not None else locked.service_user_id
        for chat in ChannelChat.objects.filter(account=locked):
            Session.objects.filter(channel=chat.channel, chat_id=chat.chat_id).update(
                owner_id=new_owner
            )
    return ChannelAccount.objects.select_related("user", "service_user").get(pk=account.pk)


# --- deliveries (D4) ----------------------------------------------------------------------


def delivery_record(
    *, turn_id: str, channel: str, chat_id: str, message_id: str, target: dict[str, object]
) -> None:
    ChannelDelivery.objects.update_or_create(
        turn_id=turn_id,
        defaults={
            "channel": channel,
            "chat_id": chat_id,
            "message_id": message_id,
            "target": target,
            "finished_at": None,
        },
    )


def delivery_claim(*, turn_id: str) -> bool:
    """Claim the right to show a turn's terminal on its platform message: exactly one
    claimer wins, whether the process running the turn or the one that recovered it."""
    return bool(
        ChannelDelivery.objects.filter(turn_id=turn_id, finished_at__isnull=True).update(
            finished_at=timezone.now()
        )
    )


def deliveries_orphaned(
    *, channel: str, grace: timedelta
) -> list[tuple[ChannelDelivery, Turn, str]]:
    """Deliveries left open by a process that died: their turn ended (closed by the process
    that recovered it) at least `grace` ago and nobody showed its terminal. Each comes with
    the turn's partial answer as history keeps it (C11)."""
    rows = (
        ChannelDelivery.objects.filter(
            channel=channel,
            finished_at__isnull=True,
            turn__status__in=(TurnStatus.COMPLETED, TurnStatus.CANCELLED, TurnStatus.FAILED),
            turn__finished_at__lt=timezone.now() - grace,
        )
        .select_related("turn")
        .order_by("created_at")[:50]
    )
    out = []
    for row in rows:
        partial = (
            Message.objects.filter(turn_id=row.turn_id, role=Role.ASSISTANT)
            .exclude(status=MessageStatus.COMPLETE)
            .order_by("-seq")
            .values_list("content", flat=True)
            .first()
        )
        out.append((row, row.turn, partial or row.turn.partial_text))
    return out


def is_bot_message(*, channel: str, chat_id: str, message_id: str) -> bool:
    """Whether a platform message is one of the bot's streamed answers."""
    return ChannelDelivery.objects.filter(
        channel=channel, chat_id=chat_id, message_id=message_id
    ).exists()


def running_turn_of_message(*, channel: str, chat_id: str, message_id: str) -> bool:
    """Whether a platform message streams a turn that is still running or queued (a reply
    to it steers that turn, C4)."""
    return ChannelDelivery.objects.filter(
        channel=channel,
        chat_id=chat_id,
        message_id=message_id,
        turn__status__in=(TurnStatus.RUNNING, TurnStatus.QUEUED),
    ).exists()
