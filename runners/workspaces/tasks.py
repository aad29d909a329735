"""The workspaces' tasks: thin, by name (common.dispatch)."""

from celery import shared_task

from runners.workspaces import reconcile


@shared_task(name="runners.tasks.workspaces_reconcile")
def workspaces_reconcile(_kicked_at: float | None = None) -> dict:
    return reconcile.workspaces_reconcile_run()


@shared_task(name="runners.tasks.workspace_home_delete")
def workspace_home_delete(home: str) -> None:
    from runners.clusters.registry import get_backend

    get_backend().delete_workspace_home(home)
