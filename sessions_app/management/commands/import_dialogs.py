"""`import_dialogs USERNAME FILE [--skip-invalid]`: import a whole ChatGPT data export's
`conversations.json` (or one `chatcore.dialog.v1` document) as dialogs of USERNAME (SPEC H2).

Every conversation is checked before the first is written; by default one bad conversation
stops the import with nothing written (`--skip-invalid` imports the others and lists the bad
ones). A progress bar on stderr counts the dialogs written; each is its own transaction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser, OutputWrapper

from audit.trail import Actor
from sessions_app import import_writes, importer


class ProgressBar:
    """`[#####.....] 12/40 Title`, redrawn in place on a terminal; on anything else a line
    at every tenth of the way, so logs stay short."""

    WIDTH = 30

    def __init__(self, total: int, stream: OutputWrapper) -> None:
        self.total = max(total, 1)
        self.stream = stream
        self.tty = stream.isatty()
        self.shown_tenth = -1

    def update(self, done: int, label: str = "") -> None:
        filled = self.WIDTH * done // self.total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        text = f"[{bar}] {done}/{self.total} {label[:40]}"
        if self.tty:
            end = "\n" if done >= self.total else ""
            self.stream.write("\r" + text.ljust(self.WIDTH + 60), ending=end)
        else:
            tenth = 10 * done // self.total
            if tenth != self.shown_tenth or done >= self.total:
                self.shown_tenth = tenth
                self.stream.write(text)
        self.stream.flush()


class Command(BaseCommand):
    help = "Import a ChatGPT conversations.json (or one chatcore.dialog.v1 file) for a user."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username", help="the user the dialogs will belong to")
        parser.add_argument("file", help="conversations.json of a ChatGPT data export")
        parser.add_argument(
            "--skip-invalid",
            action="store_true",
            help="import the valid conversations and list the others (default: import none)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        user_model = get_user_model()
        user = user_model._default_manager.filter(
            **{user_model.USERNAME_FIELD: options["username"]}
        ).first()
        if user is None:
            raise CommandError(f"No user named {options['username']!r}.")
        path = Path(options["file"])
        try:
            document = json.loads(path.read_bytes())
        except OSError as exc:
            raise CommandError(f"Cannot read {path}: {exc}") from exc
        except ValueError as exc:
            raise CommandError(f"{path} is not valid JSON: {exc}") from exc

        dialogs: list[tuple[str, importer.ImportedDialog]] = []
        problems: list[str] = []
        if isinstance(document, dict):
            try:
                dialogs.append(("1", importer.parse_document(document)))
            except importer.InvalidDocument as exc:
                raise CommandError(exc.message) from exc
        elif isinstance(document, list):
            for index, conversation in enumerate(document):
                try:
                    dialogs.extend(importer.chatgpt_conversations([conversation]))
                except importer.InvalidDocument as exc:
                    problems.append(f"[{index}]{exc.message.removeprefix('[0]')}")
        else:
            raise CommandError("The file holds neither a conversation nor a list of them.")
        if problems and not options["skip_invalid"]:
            shown = "\n".join(problems[:20])
            raise CommandError(
                f"{len(problems)} conversation(s) cannot be imported; nothing was written "
                f"(--skip-invalid imports the others):\n{shown}"
            )
        progress = ProgressBar(len(dialogs), self.stderr)
        actor = Actor.system(via="manage.py import_dialogs")
        for done, (label, dialog) in enumerate(dialogs, start=1):
            import_writes.dialog_import(owner=user, dialog=dialog, actor=actor)
            progress.update(done, label)
        for problem in problems:
            self.stderr.write(f"skipped {problem}")
        self.stdout.write(
            f"Imported {len(dialogs)} dialog(s) for {user.get_username()}"
            + (f"; skipped {len(problems)}." if problems else ".")
        )
