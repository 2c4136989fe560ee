"""The chatcore project: settings, ASGI and Celery apps, and the conversation engine."""

from .celery import app as celery_app

__all__ = ["celery_app"]
