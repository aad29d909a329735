"""The Celery application; configuration comes from Django settings (CELERY_*)."""

import os

from celery import Celery
from celery.signals import task_failure

from common.metrics import task_failed
from portal import logs  # noqa: F401  (connects the signals that carry a request's id into its tasks)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

app = Celery("portal")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@task_failure.connect
def _count_task_failure(sender=None, **kwargs) -> None:
    """Count a task run that raised, by task name, in the store every process shares (``/metrics``).

    Connected here because every worker process loads this app; a failure is counted in the
    worker that ran the task, which the web processes serving ``/metrics`` could not see otherwise.
    """
    task_failed(getattr(sender, "name", None) or "unknown")
