"""Writes of a dialog's settings (SPEC H4): its model and its system prompt.

The model is checked against the catalog by the caller (`chatcore.engine.dialog_settings`);
here the write, published after commit as `session_updated` with what changed.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils.translation import gettext as _

from audit.trail import Action, Actor, audit_dialog
from chatcore.common import events, publish
from chatcore.common.errors import BadRequest, NotFound
from chatcore.common.ids import storable_text
from chatcore.common.llm_models import SYSTEM_PROMPT_MAX

from .models import Session
from .storage import storage_retry


def settings_changes(session: Session) -> dict[str, Any]:
    """The fields of `session_updated` that carry a dialog's settings."""
    return {"model": session.effective_model, "system_prompt": session.system_prompt}


def session_settings_update(
    *,
    session: Session,
    model: str | None = None,
    system_prompt: str | None = None,
    actor: Actor | None = None,
) -> Session:
    """Set the dialog's `model` and/or `system_prompt` (None: unchanged; an empty prompt
    clears it). Messages are untouched: the next turn asks the new model with the new
    instructions. An operator's change (`actor`, from the admin) is recorded (H5); the
    owner's own choices are not in the audit vocabulary."""
    fields: dict[str, Any] = {}
    if model is not None:
        fields["model"] = model
    if system_prompt is not None:
        if len(system_prompt) > SYSTEM_PROMPT_MAX:
            raise BadRequest(
                _("The system prompt is too long (at most %(max)d characters).")
                % {"max": SYSTEM_PROMPT_MAX}
            )
        if not storable_text(system_prompt):
            raise BadRequest(_("The system prompt must be text without NUL characters."))
        fields["system_prompt"] = system_prompt.strip()
    if not fields:
        return session

    def write() -> None:
        with transaction.atomic():
            updated = Session.objects.filter(pk=session.pk, deleted_at__isnull=True).update(
                state_version=F("state_version") + 1, **fields
            )
            if not updated:
                raise NotFound(_("Dialog not found."))
            if actor is not None:
                # The prompt's length, not its text: the trail keeps no conversation.
                changed = {k: len(v) if k == "system_prompt" else v for k, v in fields.items()}
                audit_dialog(actor=actor, action=Action.DIALOG_SETTINGS, session=session, **changed)

    storage_retry(write, what="session_settings_update", session=session)
    session.refresh_from_db()
    publish.publish_to_chat(
        session, events.session_updated_frame(session=session, **settings_changes(session))
    )
    return session
