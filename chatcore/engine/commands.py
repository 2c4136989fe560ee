"""Slash commands (B3): one registry that every channel uses.

A command is not a model turn and never enters history (only `/new`'s welcome does). Each
command gets exactly one reply: a `CommandResult`, or a `ChatError` the channel turns into an
error frame. Commands run as their own short tasks, so a slow one never blocks another
dialog's input or `/stop`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.contrib.auth.models import User
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from audit.trail import Actor
from chatcore.common.dbthreads import on_db
from chatcore.common.errors import BadRequest, UnknownCommand
from chatcore.common.ids import validate_part
from sessions_app import selectors, services, usage
from sessions_app.models import Session

from . import rates
from .dialog_settings import catalog_for, dialog_settings_update
from .dialogs import delete_dialog
from .sessions import SessionStates, dialog_after_delete, dialog_create

if TYPE_CHECKING:
    from .engine import Engine


@dataclass
class CommandContext:
    owner: User
    channel: str
    chat_id: str
    current: Session | None
    engine: Engine | None = None
    # H5: who runs the command and from where, for the audit trail (default: the owner).
    actor: Actor | None = None

    @property
    def audit_actor(self) -> Actor:
        return self.actor or Actor.of_user(self.owner)


@dataclass
class CommandResult:
    command: str
    content: str
    ok: bool = True
    # The dialog that is current after the command (changed by /new, /switch, /delete).
    current: Session | None = None
    # Which state frames the channel should send: "sessions", "history", "session".
    effects: set[str] = field(default_factory=set)


Handler = Callable[[CommandContext, str], Awaitable[CommandResult]]


@dataclass(frozen=True)
class Command:
    name: str
    usage: str
    help: Any
    handler: Handler
    takes_args: bool
    # Changes the dialog it runs on (refused on a dialog that is read-only for the writer).
    writes: bool = False


REGISTRY: dict[str, Command] = {}


def command(
    name: str, *, usage: str, help: Any, takes_args: bool = False, writes: bool = False
) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        REGISTRY[name] = Command(name, usage, help, fn, takes_args, writes)
        return fn

    return register


def is_command(text: str) -> bool:
    return text.startswith("/")


def writes_dialog(text: str) -> bool:
    """Whether a command line changes the dialog it runs on (/rename, /delete, /compact,
    /stop); /new and /switch only change which dialog is current."""
    cmd = REGISTRY.get(parse(text)[0])
    return cmd is not None and cmd.writes


def parse(text: str) -> tuple[str, str]:
    head, _sep, rest = text.strip()[1:].partition(" ")
    return head.strip().lower(), rest.strip()


async def run_command(ctx: CommandContext, text: str) -> CommandResult:
    name, args = parse(text)
    cmd = REGISTRY.get(name)
    if cmd is None:
        raise UnknownCommand(
            _("Unknown command /%(name)s. Type /help for the list of commands.") % {"name": name}
        )
    if name != "stop":
        # F7: /compact starts model work (the send rate); every other command is a write
        # (the second budget). /stop only ever reduces work and is never refused.
        budget = rates.SEND if name == "compact" else rates.WRITE
        await rates.acharge(ctx.owner.pk, budget, ctx.engine.cfg if ctx.engine else None)
    if args and not cmd.takes_args:
        raise BadRequest(
            _("/%(name)s takes no arguments. Usage: %(usage)s") % {"name": name, "usage": cmd.usage}
        )
    return await cmd.handler(ctx, args)


def _require_current(ctx: CommandContext) -> Session:
    if ctx.current is None:
        raise BadRequest(_("No current dialog."))
    return ctx.current


def _line(session: Session, current: Session | None) -> str:
    marker = "*" if current is not None and current.pk == session.pk else "-"
    return ngettext(
        "%(marker)s %(id)s — %(title)s (%(n)d message)",
        "%(marker)s %(id)s — %(title)s (%(n)d messages)",
        session.message_count,
    ) % {
        "marker": marker,
        "id": session.dialog_id,
        "title": session.title,
        "n": session.message_count,
    }


def _states(ctx: CommandContext) -> SessionStates | None:
    """The histories this process holds, which a dialog a command creates joins."""
    return ctx.engine.states if ctx.engine is not None else None


@command("new", usage="/new [title]", help=gettext_lazy("Start a new dialog"), takes_args=True)
async def _new(ctx: CommandContext, args: str) -> CommandResult:
    current = ctx.current

    def create() -> Session:
        # H4: a new dialog of the chat keeps the model its last dialog used.
        model: str | None = ""
        if current is not None:
            model = Session.objects.filter(pk=current.pk).values_list("model", flat=True).first()
        return dialog_create(
            owner=ctx.owner,
            channel=ctx.channel,
            chat_id=ctx.chat_id,
            title=args or None,
            states=_states(ctx),
            model=model or "",
        )

    session = await on_db(create)()
    return CommandResult(
        "new",
        _("Created dialog %(id)s: %(title)s") % {"id": session.dialog_id, "title": session.title},
        current=session,
        effects={"sessions", "history"},
    )


@command("sessions", usage="/sessions", help=gettext_lazy("List the 10 most recent dialogs"))
async def _sessions(ctx: CommandContext, args: str) -> CommandResult:
    items = await on_db(selectors.dialog_list_for_chat)(
        owner_id=ctx.owner.pk, channel=ctx.channel, chat_id=ctx.chat_id, limit=10
    )
    if not items:
        return CommandResult("sessions", _("No dialogs yet."))
    lines = [_("Your dialogs (most recent first):")] + [_line(s, ctx.current) for s in items]
    return CommandResult("sessions", "\n".join(lines))


@command(
    "switch",
    usage="/switch <dialog_id>",
    help=gettext_lazy("Switch to another dialog"),
    takes_args=True,
)
async def _switch(ctx: CommandContext, args: str) -> CommandResult:
    if not args or " " in args:
        raise BadRequest(_("Usage: /switch <dialog_id>"))
    dialog_id = validate_part(args, field="dialog_id")
    # B1: switching to a dialog that does not exist is an error, never a creation.
    session = await on_db(selectors.dialog_get)(
        owner_id=ctx.owner.pk, channel=ctx.channel, chat_id=ctx.chat_id, dialog_id=dialog_id
    )
    return CommandResult(
        "switch",
        _("Switched to %(id)s: %(title)s") % {"id": session.dialog_id, "title": session.title},
        current=session,
        effects={"sessions", "history"},
    )


@command(
    "rename",
    usage="/rename <title>",
    help=gettext_lazy("Rename the current dialog"),
    takes_args=True,
    writes=True,
)
async def _rename(ctx: CommandContext, args: str) -> CommandResult:
    session = _require_current(ctx)
    if not args:
        raise BadRequest(_("Usage: /rename <title>"))
    session = await on_db(services.session_rename)(
        session=session, title=args, actor=ctx.audit_actor
    )
    return CommandResult(
        "rename",
        _("Renamed to: %(title)s") % {"title": session.title},
        current=session,
        effects={"session"},
    )


@command("delete", usage="/delete", help=gettext_lazy("Delete the current dialog"), writes=True)
async def _delete(ctx: CommandContext, args: str) -> CommandResult:
    session = _require_current(ctx)
    await delete_dialog(engine=ctx.engine, session=session, by=ctx.audit_actor)
    current = await on_db(dialog_after_delete)(
        owner=ctx.owner, channel=ctx.channel, chat_id=ctx.chat_id, states=_states(ctx)
    )
    return CommandResult(
        "delete",
        _("Deleted dialog %(id)s. Current dialog: %(current)s")
        % {"id": session.dialog_id, "current": current.dialog_id},
        current=current,
        effects={"sessions", "history"},
    )


@command("info", usage="/info", help=gettext_lazy("Show the current dialog"))
async def _info(ctx: CommandContext, args: str) -> CommandResult:
    session = _require_current(ctx)

    def gather() -> tuple[Session, int, bool, dict[str, int]]:
        fresh = Session.objects.get(pk=session.pk)
        queued = len(selectors.turn_queue(session_pk=session.pk))
        running = selectors.turn_running(session_pk=session.pk) is not None
        return fresh, queued, running, usage.session_usage(session_pk=session.pk)

    fresh, queued, running, used = await on_db(gather)()
    lines = [
        _("Dialog: %(id)s") % {"id": fresh.dialog_id},
        _("Session: %(sid)s") % {"sid": fresh.session_id},
        _("Title: %(title)s") % {"title": fresh.title},
        _("Created: %(t)s") % {"t": fresh.created_at.strftime("%Y-%m-%d %H:%M UTC")},
        _("Last active: %(t)s") % {"t": fresh.last_active_at.strftime("%Y-%m-%d %H:%M UTC")},
        _("Messages: %(user)d from you, %(total)d in total")
        % {"user": fresh.message_count, "total": fresh.total_message_count},
        _("Status: %(status)s, %(queued)d queued")
        % {"status": _("running") if running else _("idle"), "queued": queued},
        # H4: the dialog's model, its own instructions and what its turns used.
        _("Model: %(model)s") % {"model": fresh.effective_model},
        _("System prompt: %(chars)d characters") % {"chars": len(fresh.system_prompt)},
        _(
            "Tokens used: %(prompt)d prompt (%(cached)d cached), %(completion)d completion "
            "in %(turns)d answers"
        )
        % {
            "prompt": used["prompt_tokens"],
            "cached": used["cached_tokens"],
            "completion": used["completion_tokens"],
            "turns": used["turns"],
        },
    ]
    return CommandResult("info", "\n".join(lines))


@command(
    "stop",
    usage="/stop",
    help=gettext_lazy("Stop the running answer and drop queued messages"),
    writes=True,
)
async def _stop(ctx: CommandContext, args: str) -> CommandResult:
    session = _require_current(ctx)
    if ctx.engine is None:
        raise BadRequest(_("Nothing to stop."))
    result = await ctx.engine.stop(session)
    return CommandResult("stop", result.describe())


@command(
    "compact",
    usage="/compact",
    help=gettext_lazy("Summarise older history to free context"),
    writes=True,
)
async def _compact(ctx: CommandContext, args: str) -> CommandResult:
    session = _require_current(ctx)
    if ctx.engine is not None:
        await on_db(ctx.engine.scheduler.schedule)(
            "compact_session", session_pk=session.pk, manual=True
        )
    else:
        from . import background

        await on_db(background.request_compaction)(session_pk=session.pk, manual=True)
    return CommandResult("compact", _("Compaction started; you will be told when it is done."))


@command(
    "model",
    usage="/model [name]",
    help=gettext_lazy("Show the models, or choose the current dialog's"),
    takes_args=True,
    writes=True,
)
async def _model(ctx: CommandContext, args: str) -> CommandResult:
    """H4: what a chat app or the terminal has for the web chat's model picker."""
    session = _require_current(ctx)
    catalog = catalog_for(ctx.engine)
    if args:
        # Its `session_updated` reaches the chat's clients through the chat group.
        session = await dialog_settings_update(engine=ctx.engine, session=session, model=args)
        return CommandResult(
            "model",
            _("This dialog now uses %(model)s.") % {"model": session.effective_model},
            current=session,
        )
    fresh = await on_db(Session.objects.get)(pk=session.pk)
    lines = [_("Models (the current dialog's is marked):")] + [
        f"{'*' if name == fresh.effective_model else '-'} {name}" for name in await catalog.aids()
    ]
    return CommandResult("model", "\n".join(lines))


@command("help", usage="/help", help=gettext_lazy("Show this help"))
async def _help(ctx: CommandContext, args: str) -> CommandResult:
    lines = [_("Commands:")] + [f"{c.usage} — {c.help}" for c in REGISTRY.values()]
    return CommandResult("help", "\n".join(lines))


def describe_registry() -> list[dict[str, Any]]:
    return [{"name": c.name, "usage": c.usage, "help": str(c.help)} for c in REGISTRY.values()]
