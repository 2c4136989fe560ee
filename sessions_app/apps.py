from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class SessionsAppConfig(AppConfig):
    name = "sessions_app"
    verbose_name = _("Conversations")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_delete

        from . import files, logins
        from .file_models import File

        logins.connect_signals()
        # H3: a deleted file's bytes leave storage with it.
        post_delete.connect(files.delete_bytes_on_commit, sender=File, dispatch_uid="file_bytes")
