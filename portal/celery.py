"""The Celery application; configuration comes from Django settings (CELERY_*)."""

import contextlib
import os

from celery import Celery
from celery.signals import task_failure
from celery.utils.threads import bound_open_broker_sockets
from celery.worker.consumer import Consumer
from celery.worker.consumer.consumer import COLLECT_SOCKET_TIMEOUT

from common.metrics import task_failed
from portal import logs  # noqa: F401  (connects the signals that carry a request's id into its tasks)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

app = Celery("portal")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


class PortalConsumer(Consumer):
    """Celery's consumer, with a workaround for a kombu 5.7 crash when the Redis broker goes away.

    A worker notices a lost Redis on whichever of its sockets fails first. When that is the
    pub/sub one (remote control) while the consumer's BRPOP is still pending, the consumer's
    channel closes badly: its close first reads the pending BRPOP reply, that read fails too, and
    the close stops there, its unacknowledged messages not restored. Celery then lets the
    transport go and closes the channel a second time; restoring those messages now needs the
    transport's settings, gone, and ``AttributeError("'NoneType' object has no attribute
    'hostname'")`` ends the worker ("Unrecoverable error"). So the pending reply is read (or its
    read fails) first, on a bounded socket; the channel then closes in one go, while the
    transport is still there.
    """

    def on_connection_error_after_connected(self, exc):
        channel = getattr(self.connection, "_default_channel", None)
        if channel is not None and getattr(channel, "_in_poll", None):
            bound_open_broker_sockets(self.connection, COLLECT_SOCKET_TIMEOUT)
            with contextlib.suppress(Exception):  # the broker is gone: the read fails, and the BRPOP is over
                channel._brpop_read()
        super().on_connection_error_after_connected(exc)


app.conf.worker_consumer = f"{__name__}:PortalConsumer"


@task_failure.connect
def _count_task_failure(sender=None, **kwargs) -> None:
    """Count a task run that raised, by task name, in the store every process shares (``/metrics``).

    Connected here because every worker process loads this app; a failure is counted in the
    worker that ran the task, which the web processes serving ``/metrics`` could not see otherwise.
    """
    task_failed(getattr(sender, "name", None) or "unknown")
