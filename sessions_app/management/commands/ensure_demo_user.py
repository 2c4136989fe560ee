"""`ensure_demo_user [--reset]`: make sure the demo login of `make run` exists and print it.

The demo user is staff and superuser so a newcomer can look at the admin too. Running it again
changes nothing (a password changed since is kept) unless `--reset` is given.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction

from audit.trail import USER_FLAGS, Actor, audit_user_change

DEMO_USERNAME = "demo"


class Command(BaseCommand):
    help = "Make sure the demo login exists (staff, superuser) and print it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--reset",
            action="store_true",
            help="set the password (and staff/superuser/active flags) back even if changed",
        )
        parser.add_argument(
            "--port",
            type=int,
            default=None,
            help="port shown in the printed URL (default: $PORT or 8000)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        password = settings.DEMO_PASSWORD
        port = options["port"] or settings.PORT
        user_model = get_user_model()
        manager = user_model._default_manager

        with transaction.atomic():
            user = manager.filter(**{user_model.USERNAME_FIELD: DEMO_USERNAME}).first()
            if user is None:
                manager.create_superuser(
                    **{user_model.USERNAME_FIELD: DEMO_USERNAME},
                    email="demo@example.com",
                    password=password,
                )
                state = "created"
            elif options["reset"]:
                before = {flag: getattr(user, flag) for flag in USER_FLAGS}
                user.set_password(password)
                user.is_active = True
                user.is_staff = True
                user.is_superuser = True
                user.save()
                # H5: flags a command set back are recorded, as `system`.
                audit_user_change(
                    actor=Actor.system(via="manage.py ensure_demo_user"), user=user, before=before
                )
                state = "reset"
            else:
                state = "exists"
                if not user.check_password(password):
                    self.stdout.write(
                        f"Demo login: {DEMO_USERNAME} (its password was changed; "
                        "run `python manage.py ensure_demo_user --reset` to set it back)"
                    )
                    self.stdout.write(f"Open http://127.0.0.1:{port}/")
                    return

        if state != "exists":
            self.stdout.write(f"Demo user {state}.")
        self.stdout.write(f"Demo login: {DEMO_USERNAME} / {password}")
        self.stdout.write(f"Open http://127.0.0.1:{port}/ (admin: http://127.0.0.1:{port}/admin/)")
