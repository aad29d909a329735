"""Celery tasks of the node caches: the sync that brings the portal's rows to what each node's cache holds."""

from celery import shared_task

from runners.nodecache import services


@shared_task(name="runners.nodecache.tasks.caches_sync")
def caches_sync(_kicked_at: float | None = None) -> dict:
    """Read every node's cache and bring its rows to it (a reconcile: safe to run twice, or at once)."""
    return services.caches_sync()
