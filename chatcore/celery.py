"""The Celery app. In scaled mode workers run `celery -A chatcore worker` against Redis; in
embedded mode the same job functions run in-process (see `chatcore.engine.scheduler`)."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatcore.settings")

app = Celery("chatcore")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
