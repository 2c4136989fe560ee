"""`ensure_demo_user [--staff] [--reset]`: make sure the demo login of `make run` exists and
print it.

The demo login is for a server on this machine only (F8): the command makes none once
DJANGO_SECRET_KEY is set (a deployment; it says so and `make run` goes on), and while the
built-in key is in use `serve` listens on loopback only. It is a plain user unless `--staff`
is given (`make run` gives it, so a newcomer can look at the admin too). Running it again
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
    help = "Make sure the demo login of a local `make run` exists and print it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--staff",
            action="store_true",
            help="make the demo login staff and superuser (make run: the admin too)",
        )
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
        if settings.SECRET_KEY != settings.DEV_SECRET_KEY:
            # Not an error: `make run` goes on serving, without a login of a known password.
            self.stderr.write(
                "No demo login: it is for `make run` on this machine only, and "
                "DJANGO_SECRET_KEY is set (a deployment, which `serve` may bind beyond "
                "loopback). Create logins with `python manage.py createsuperuser`."
            )
            return
        password = settings.DEMO_PASSWORD
        port = options["port"] or settings.PORT
        staff = bool(options["staff"])
        user_model = get_user_model()
        manager = user_model._default_manager

        with transaction.atomic():
            user = manager.filter(**{user_model.USERNAME_FIELD: DEMO_USERNAME}).first()
            if user is None:
                create = manager.create_superuser if staff else manager.create_user
                create(
                    **{user_model.USERNAME_FIELD: DEMO_USERNAME},
                    email="demo@example.com",
                    password=password,
                )
                state = "created"
            elif options["reset"]:
                before = {flag: getattr(user, flag) for flag in USER_FLAGS}
                user.set_password(password)
                user.is_active = True
                user.is_staff = staff
                user.is_superuser = staff
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
        admin = f" (admin: http://127.0.0.1:{port}/admin/)" if staff else ""
        self.stdout.write(f"Open http://127.0.0.1:{port}/{admin}")
