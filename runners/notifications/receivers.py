"""The notifications app's answers to the signals of the apps below it (connected in NotificationsConfig.ready()).

Each receiver writes an ``Outbox`` row inside the transaction that sent the signal (a row of this
app only, so it commits or rolls back with what it announces), then sends a task once that
transaction commits: the worker reads what the rows say then, records the event once under its
key, mails and delivers it. A message lost (a broker down at commit, a worker killed) leaves the
row unprocessed, and the beat sweep sends it again.
"""

import uuid

from django.dispatch import receiver
from django.utils import timezone

from common.dispatch import enqueue_on_commit
from quotas.signals import quota_changed
from runners.environments.signals import environment_failed
from runners.jobs.signals import attempts_ended
from runners.notifications.models import Outbox
from runners.workspaces.signals import workspace_stopped

EVENT_TASK = "runners.tasks.notifications_event"


def _record(source: str, ref, key: str = "", at: str = "") -> None:
    row = Outbox.objects.create(source=source, ref=ref, key=key, at=at)
    enqueue_on_commit(EVENT_TASK, "outbox", row.id)


@receiver(attempts_ended, dispatch_uid="notifications-on-ended-attempts")
def _attempts_ended(sender, *, job_ids, **kwargs) -> None:
    # Finished, failed or preempted is read from the job and its attempts after commit.
    _record("jobs", list(job_ids))


@receiver(environment_failed, dispatch_uid="notifications-on-environment-failed")
def _environment_failed(sender, *, environment_id, **kwargs) -> None:
    _record("environment", environment_id)


@receiver(quota_changed, dispatch_uid="notifications-on-quota-changed")
def _quota_changed(sender, *, tenant, **kwargs) -> None:
    # Every change is an event of its own: its key is made here, so a message delivered twice is one event.
    _record("quota", tenant.id, uuid.uuid4().hex, timezone.now().isoformat())


@receiver(workspace_stopped, dispatch_uid="notifications-on-workspace-stopped")
def _workspace_stopped(sender, *, workspace, reason, cause, **kwargs) -> None:
    # Each stop is an event of its own; what it says is read from the workspace then (its reason stays).
    _record("workspace", workspace.id, f"{cause}:{uuid.uuid4().hex}", timezone.now().isoformat())
