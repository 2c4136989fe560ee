"""The durable facts of the platform: dialogs, messages, turns, staged inputs, compactions,
memory notes and API tokens (SPEC A2). Writes go through `services`, reads through
`selectors`."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.db.models.functions import Length
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from chatcore.common.ids import new_uuid
from chatcore.common.llm_models import default_model

from .choices import TERMINAL_STATUSES as TERMINAL_STATUSES
from .choices import MessageKind as MessageKind
from .choices import MessageStatus, Role, TitleSource, TurnMode, TurnStatus


def _new_pk() -> str:
    return new_uuid().hex


class Session(models.Model):
    """One dialog of a chat (A1). The primary key is opaque so a deleted `default` dialog can
    be created again; the public id is `{channel}:{chat_id}:{dialog_id}` of a live dialog."""

    id = models.CharField(primary_key=True, max_length=32, default=_new_pk, editable=False)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="dialogs",
        verbose_name=_("owner"),
    )
    channel = models.CharField(_("channel"), max_length=64)
    chat_id = models.CharField(_("chat id"), max_length=64)
    dialog_id = models.CharField(_("dialog id"), max_length=64)
    title = models.CharField(_("title"), max_length=200)
    title_source = models.CharField(
        _("title source"), max_length=16, choices=TitleSource.choices, default=TitleSource.DEFAULT
    )
    # B4: failed attempts at the title now due (reset when a title commits); at most
    # 1 + CHAT["TITLE_RETRIES"] attempts per title.
    title_attempts = models.PositiveSmallIntegerField(_("title attempts"), default=0)
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    last_active_at = models.DateTimeField(_("last active"), default=timezone.now, db_index=True)
    # A2: message_count counts user messages only; total counts everything in history.
    message_count = models.PositiveIntegerField(
        _("user messages"), default=0, help_text=_("Only the messages the user sent.")
    )
    total_message_count = models.PositiveIntegerField(_("all messages"), default=0)
    # A3/D2: highest seq ever assigned = the history revision. Never goes back.
    last_seq = models.BigIntegerField(_("last seq"), default=0)
    # Bumped by every change of history, title or lifecycle; background jobs commit only if
    # it is unchanged (B4, B5, C9).
    state_version = models.BigIntegerField(_("state version"), default=0)
    # Bumped only when history is cleared or the dialog deleted/restored: a running turn whose
    # generation changed is stale and commits nothing (C9).
    generation = models.BigIntegerField(_("generation"), default=0)
    # C1: per-session FIFO order of accepted sends.
    turn_counter = models.BigIntegerField(_("turn counter"), default=0)
    # C3: the database lease of the process running this session's turns.
    lease_owner = models.CharField(_("lease owner"), max_length=96, blank=True, default="")
    lease_expires_at = models.DateTimeField(_("lease expires"), null=True, blank=True)
    # G2: the fencing token of the lease, increased at every acquisition; every write of a
    # turn checks it in its own transaction (chatcore.engine.lease).
    lease_epoch = models.BigIntegerField(_("lease epoch"), default=0)
    # H1: the last message of the active path (0: no message yet); every append moves it to
    # the new message, a `branch` or a regenerate's start moves it to another leaf.
    head_seq = models.BigIntegerField(_("head seq"), default=0)
    # H1: set once the dialog's messages stop being one straight line (an edit, a regenerate
    # or a branch switch); until then the active path is simply every message in seq order.
    forked = models.BooleanField(_("forked"), default=False)
    # H1: the forks: for each message with several children (its seq as text, "" for none),
    # their seqs, oldest first; the `siblings` of pages are read from here, not the tree.
    forks = models.JSONField(_("forks"), default=dict, blank=True)
    # C8: the session plan tool's state.
    plan = models.TextField(_("plan"), blank=True, default="")
    # H4: the dialog's model ("" = the server's default, `LLM_MODEL`) and its own
    # instructions, sent in the first (system) message after the platform's.
    model = models.CharField(_("model"), max_length=200, blank=True, default="")
    system_prompt = models.TextField(_("system prompt"), blank=True, default="")
    deleted_at = models.DateTimeField(_("deleted at"), null=True, blank=True, db_index=True)

    class Meta:
        verbose_name = _("dialog")
        verbose_name_plural = _("dialogs")
        constraints = [
            models.UniqueConstraint(
                fields=["channel", "chat_id", "dialog_id"],
                condition=Q(deleted_at__isnull=True),
                name="uniq_live_dialog",
            )
        ]
        indexes = [
            models.Index(fields=["channel", "chat_id", "deleted_at"], name="idx_sessions_chat"),
        ]
        ordering = ["-last_active_at"]

    def __str__(self) -> str:
        return f"{self.session_id} ({self.title})"

    @property
    def session_id(self) -> str:
        return f"{self.channel}:{self.chat_id}:{self.dialog_id}"

    @property
    def is_deleted(self) -> bool:
        return self.deleted_at is not None

    @property
    def default_title(self) -> str:
        return f"Dialog {self.dialog_id}"

    @property
    def effective_model(self) -> str:
        """H4: the model a turn of this dialog asks (its own, else the default)."""
        return self.model or default_model()


class Message(models.Model):
    id = models.UUIDField(primary_key=True, default=new_uuid, editable=False)
    # Indexed by the (session, seq) constraint and index below, which lead with it.
    session = models.ForeignKey(
        Session,
        on_delete=models.CASCADE,
        related_name="messages",
        db_index=False,
        verbose_name=_("dialog"),
    )
    seq = models.BigIntegerField(_("seq"))
    # H1: the message this one follows on its branch (null for a dialog's first); siblings
    # share it. Never rewritten, like the rest of the row.
    parent_seq = models.BigIntegerField(_("parent seq"), null=True, blank=True)
    role = models.CharField(_("role"), max_length=16, choices=Role.choices)
    content = models.TextField(_("content"), blank=True, default="")
    media_refs = models.JSONField(_("media"), default=list, blank=True)
    tool_call_id = models.CharField(_("tool call id"), max_length=128, blank=True, default="")
    tool_name = models.CharField(_("tool name"), max_length=128, blank=True, default="")
    tool_calls = models.JSONField(_("tool calls"), null=True, blank=True)
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    # D5: kind, channel, sender id, reply_to, client_msg_id; hidden from the model (C8).
    source = models.JSONField(_("source"), default=dict, blank=True)
    status = models.CharField(
        _("status"),
        max_length=16,
        choices=MessageStatus.choices,
        default=MessageStatus.COMPLETE,
        blank=True,
    )
    turn = models.ForeignKey(
        "Turn",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="messages",
        verbose_name=_("turn"),
    )
    # The content's length in characters, kept by the database on every write: a turn's
    # context window sums it over the dialog's history (`selectors.TurnContextStatement`)
    # without reading any message's text, which cost time in proportion to the whole
    # history's size before every first token.
    content_chars = models.GeneratedField(
        expression=Length("content"), output_field=models.IntegerField(), db_persist=True
    )

    class Meta:
        verbose_name = _("message")
        verbose_name_plural = _("messages")
        constraints = [
            models.UniqueConstraint(fields=["session", "seq"], name="uniq_message_seq"),
        ]
        indexes = [
            # The window's sum reads this index alone (newest first), not the messages' rows.
            models.Index(fields=["session", "seq", "content_chars"], name="idx_message_chars")
        ]
        ordering = ["seq"]

    def __str__(self) -> str:
        # An answer that only calls tools is named by its calls (the admin's row titles).
        calls = [str((c.get("function") or {}).get("name", "?")) for c in self.tool_calls or []]
        return f"#{self.seq} {self.role}: {self.content[:40] or ', '.join(calls)}"

    @property
    def kind(self) -> str:
        return str(self.source.get("kind", ""))


class Turn(models.Model):
    """One accepted send (C1, C2): queued durably before it is acknowledged, run at most once,
    ended by exactly one terminal."""

    id = models.UUIDField(primary_key=True, default=new_uuid, editable=False)
    # Both indexed by the composite indexes below, which lead with them: an index of their
    # own is one more for every turn's insert and end to keep.
    session = models.ForeignKey(
        Session,
        on_delete=models.CASCADE,
        related_name="turns",
        db_index=False,
        verbose_name=_("dialog"),
    )
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="+",
        db_index=False,
        verbose_name=_("owner"),
    )
    number = models.BigIntegerField(_("number"))
    mode = models.CharField(
        _("mode"), max_length=10, choices=TurnMode.choices, default=TurnMode.SEND
    )
    status = models.CharField(
        _("status"), max_length=16, choices=TurnStatus.choices, default=TurnStatus.QUEUED
    )
    reason = models.CharField(_("reason"), max_length=16, blank=True, default="")
    error_kind = models.CharField(_("error kind"), max_length=32, blank=True, default="")
    error_message = models.TextField(_("error message"), blank=True, default="")
    content = models.TextField(_("content"), blank=True, default="")
    client_msg_id = models.CharField(_("client message id"), max_length=128, blank=True, default="")
    source = models.JSONField(_("source"), default=dict, blank=True)
    received_at = models.DateTimeField(_("received"), default=timezone.now)
    retry_of = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        verbose_name=_("retry of"),
    )
    # C11: partial answer checkpoint (not a message) and tool progress.
    partial_text = models.TextField(_("partial text"), blank=True, default="")
    cancel_requested = models.BooleanField(_("cancel requested"), default=False)
    usage = models.JSONField(_("usage"), default=dict, blank=True)
    # H4: the model a completed turn asked (its usage is that model's).
    model = models.CharField(_("model"), max_length=200, blank=True, default="")
    started_at = models.DateTimeField(_("started"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished"), null=True, blank=True)

    class Meta:
        verbose_name = _("turn")
        verbose_name_plural = _("turns")
        constraints = [
            models.UniqueConstraint(fields=["session", "number"], name="uniq_turn_number"),
        ]
        indexes = [
            models.Index(fields=["session", "status", "number"], name="idx_turn_queue"),
            # F7: a user's running turns are counted at every claim.
            models.Index(fields=["owner", "status"], name="idx_turn_owner_status"),
            # F7: the turns queued in all dialogs (the global admission bound), the running
            # ones of the process's sweeps.
            models.Index(fields=["status"], name="idx_turn_status"),
        ]
        ordering = ["number"]

    def __str__(self) -> str:
        return f"turn {self.id} ({self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


class StagedInput(models.Model):
    """Steer and inject text waiting for the next step boundary of a running turn (C4, C5)."""

    class Mode(models.TextChoices):
        STEER = "steer", "steer"
        INJECT = "inject", "inject"

    class Status(models.TextChoices):
        STAGED = "staged", "staged"
        RECORDED = "recorded", "recorded"
        DROPPED = "dropped", "dropped"

    id = models.UUIDField(primary_key=True, default=new_uuid, editable=False)
    # Indexed by `idx_staged_session`, which leads with it.
    session = models.ForeignKey(
        Session, on_delete=models.CASCADE, related_name="staged_inputs", db_index=False
    )
    mode = models.CharField(max_length=8, choices=Mode.choices)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.STAGED)
    content = models.TextField()
    client_msg_id = models.CharField(max_length=128, blank=True, default="")
    source = models.JSONField(default=dict, blank=True)
    received_at = models.DateTimeField(default=timezone.now)
    recorded_in = models.ForeignKey(
        Turn, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["received_at"]
        indexes = [models.Index(fields=["session", "status"], name="idx_staged_session")]

    def __str__(self) -> str:
        return f"{self.mode} ({self.status}): {self.content[:40]}"


class Compaction(models.Model):
    """A summary of history up to `through_seq` (B5). Stored messages are never rewritten."""

    id = models.BigAutoField(primary_key=True)
    # Indexed by `idx_compaction_through`, which leads with it.
    session = models.ForeignKey(
        Session, on_delete=models.CASCADE, related_name="compactions", db_index=False
    )
    through_seq = models.BigIntegerField()
    summary = models.TextField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-through_seq"]
        # Every turn's context reads a dialog's newest compaction.
        indexes = [models.Index(fields=["session", "through_seq"], name="idx_compaction_through")]

    def __str__(self) -> str:
        return f"summary through #{self.through_seq}"


class MemoryNote(models.Model):
    """A note the `remember` tool keeps for its owner across dialogs (C8)."""

    id = models.BigAutoField(primary_key=True)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="memory_notes",
        verbose_name=_("owner"),
    )
    content = models.TextField(_("content"))
    created_at = models.DateTimeField(_("created"), default=timezone.now)

    class Meta:
        verbose_name = _("memory note")
        verbose_name_plural = _("memory notes")
        ordering = ["created_at"]

    def __str__(self) -> str:
        return self.content[:60]


class ApiToken(models.Model):
    """A bearer token for the REST API and WebSocket (F2). Only its SHA-256 is stored."""

    id = models.BigAutoField(primary_key=True)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="api_tokens",
        verbose_name=_("user"),
    )
    name = models.CharField(_("name"), max_length=100, blank=True, default="")
    prefix = models.CharField(_("prefix"), max_length=12, editable=False)
    key_hash = models.CharField(_("key hash"), max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    last_used_at = models.DateTimeField(_("last used"), null=True, blank=True)
    revoked_at = models.DateTimeField(_("revoked at"), null=True, blank=True)

    class Meta:
        verbose_name = _("API token")
        verbose_name_plural = _("API tokens")
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user})"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None


# Chat apps (Telegram, Feishu) live in their own module; imported here so Django registers
# them.
from .channel_models import ChannelAccount as ChannelAccount  # noqa: E402
from .channel_models import ChannelChat as ChannelChat  # noqa: E402
from .channel_models import ChannelDelivery as ChannelDelivery  # noqa: E402
from .channel_models import ChannelEvent as ChannelEvent  # noqa: E402

# H3: uploaded files live in their own module; imported here so Django registers them.
from .file_models import File, FileKind, FileUse  # noqa: E402, F401

# H2: share links live in their own module; imported here so Django registers them.
from .share_models import Share as Share  # noqa: E402
