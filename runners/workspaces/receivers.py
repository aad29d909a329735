"""The workspaces' answers to the apps below them."""

from django.db import transaction
from django.dispatch import receiver

from runners.jobs import signals as job_signals
from runners.workspaces.models import Workspace


@receiver(job_signals.workspace_launch)
def _workspace_launch(sender, job, **kwargs):
    """The settings of the workspace this job started (read at its launch: its key is this start's)."""
    from runners.workspaces.services import home_of

    workspace = Workspace.objects.filter(job_id=job.id).select_related("tenant", "environment").first()
    if workspace is None:
        return None
    return {"workspace_id": workspace.id, "base_url": workspace.base_url, "key": workspace.key,
            "home": home_of(workspace), "image": workspace.environment.workspace_image or None}


@receiver(job_signals.attempts_ended)
def _attempts_ended(sender, job_ids, **kwargs):
    """A workspace's job ended or was preempted: the pass writes where the workspace stands soon after."""
    from runners.workspaces.services import kick_reconcile

    if Workspace.objects.filter(job_id__in=job_ids).exists():
        transaction.on_commit(kick_reconcile)
