"""Celery tasks of datasets: pack a version registered from a storage URL; the sweep of open versions.

Sent by name (``runners.datasets.tasks.version_register``) through common.dispatch, after the commit that
opened the version (and again by the sweep when that message was lost); ``versions_sweep`` runs on the beat.
tests/data/task_names.txt lists both.
"""

from celery import shared_task

from runners.datasets import services


@shared_task(name="runners.datasets.tasks.version_register", acks_late=True, time_limit=6 * 3600)
def version_register(version_id: int) -> str:
    """Pack, store and seal the version (a version no longer open is left as it is, so a repeat does nothing)."""
    return services.version_register_run(version_id)


@shared_task(name="runners.datasets.tasks.versions_sweep")
def versions_sweep() -> dict:
    """Discard abandoned pushes and their parts, send lost registrations again (services.versions_sweep)."""
    return services.versions_sweep()
