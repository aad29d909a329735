"""The GPU portal: project settings, URL routing and the Celery app."""

# Before anything large is imported: the collector's thresholds for every process of the portal's.
from portal.collector import tune_collector

tune_collector()

from portal.celery import app as celery_app  # noqa: E402  (after the thresholds, so its import runs under them)

__all__ = ["celery_app"]
