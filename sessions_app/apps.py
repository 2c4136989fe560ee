from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class SessionsAppConfig(AppConfig):
    name = "sessions_app"
    verbose_name = _("Conversations")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import logins

        logins.connect_signals()
