"""`issue_token USERNAME [--create-user] [--name NAME]`: issue an API bearer token (F2).

The plain token is printed once, as the last line of the output, so scripts can take it with
`tail -n 1`; only its hash is stored.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import models, transaction

from audit.trail import Actor
from sessions_app.models import ApiToken
from sessions_app.services import api_token_issue


class Command(BaseCommand):
    help = "Issue a new API bearer token for USERNAME; the token is the last line of the output."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username", help="the user the token acts for")
        parser.add_argument(
            "--create-user",
            action="store_true",
            help="create the user (without a password: API only) when it does not exist",
        )
        parser.add_argument("--name", default="", help="a label for the token, shown in the admin")

    def handle(self, *args: Any, **options: Any) -> None:
        username: str = options["username"]
        name: str = options["name"]
        max_name = ApiToken._meta.get_field("name").max_length or 100
        if len(name) > max_name:
            raise CommandError(f"--name is too long (at most {max_name} characters).")

        user_model = get_user_model()
        username_field = user_model._meta.get_field(user_model.USERNAME_FIELD)
        created = False
        with transaction.atomic():
            user = user_model._default_manager.filter(
                **{user_model.USERNAME_FIELD: username}
            ).first()
            if user is None:
                if not options["create_user"]:
                    raise CommandError(
                        f"No user named {username!r}. Pass --create-user to create one."
                    )
                try:
                    if isinstance(username_field, models.Field):
                        username_field.clean(username, None)
                except ValidationError as exc:
                    raise CommandError(
                        f"Invalid username {username!r}: {' '.join(exc.messages)}"
                    ) from exc
                # No password: this account signs in with tokens only; an operator can set a
                # password in the admin later.
                user = user_model._default_manager.create_user(
                    **{user_model.USERNAME_FIELD: username}, password=None
                )
                created = True
            elif not user.is_active:
                raise CommandError(f"User {username!r} is inactive; a token would not work.")
            # H5: a command is run by whoever has the server's shell: recorded as `system`.
            token, raw = api_token_issue(
                user=user, name=name, actor=Actor.system(via="manage.py issue_token")
            )

        if options["verbosity"] >= 1:
            if created:
                self.stdout.write(f"Created user {username!r} (no password; API only).")
            self.stdout.write(
                f"Issued token {token.prefix}… for {username!r}. It is shown once; "
                "send it as 'Authorization: Bearer <token>'."
            )
        self.stdout.write(raw)
