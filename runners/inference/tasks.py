"""Celery task of inference endpoints: the reconcile (read the replicas, autoscale, roll out, drain)."""

from celery import shared_task

from runners.inference import reconcile


@shared_task(name="runners.tasks.endpoints_reconcile")
def endpoints_reconcile(_kicked_at: float | None = None) -> dict:
    return reconcile.endpoints_reconcile_run()
