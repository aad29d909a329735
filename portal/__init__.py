"""The GPU portal: project settings, URL routing and the Celery app."""

from portal.celery import app as celery_app

__all__ = ["celery_app"]
