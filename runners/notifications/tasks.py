"""Celery tasks of notifications: record and send an event, deliver one webhook call, sweep what was lost.

The first two are idempotent and acknowledged late, and a message whose worker was lost goes back
to the queue (reject_on_worker_lost): an event is recorded once under its key, and a delivery is
claimed before each try. What a receiver announced is in the outbox until processed, so a message
that is lost all the same (a broker down at commit, a task that raised) is sent again by the sweep.
"""

from celery import shared_task

from runners.notifications import services
from runners.notifications.models import Event


@shared_task(name="runners.tasks.notifications_event", acks_late=True, reject_on_worker_lost=True)
def notifications_event(source: str = "", ref=None, key: str = "", at: str = "") -> dict:
    """Record what happened, then mail and deliver each event. Source "outbox": ref is the id of the outbox
    row a receiver wrote; "event": an event already recorded, whose mail is to be tried again; "jobs",
    "environment", "quota": what happened, named in the message itself (as before the outbox)."""
    if source == "outbox" and ref is not None:
        return {"events": services.outbox_process(int(ref))}
    if source == "event" and ref is not None:
        event = Event.objects.filter(id=int(ref)).select_related("tenant").first()
        if event is not None:
            services.event_send(event)
        return {"events": int(event is not None)}
    events = services.events_of(source, ref, key, at)
    for event in events:
        services.event_send(event)
    return {"events": len(events)}


@shared_task(name="runners.tasks.notifications_deliver", acks_late=True, reject_on_worker_lost=True)
def notifications_deliver(delivery_id: int | None = None) -> str:
    """Try one webhook delivery; a failed try sends this task again after its backoff."""
    if delivery_id is None:
        return "missing"
    return services.delivery_attempt(int(delivery_id))


@shared_task(name="runners.tasks.notifications_sweep")
def notifications_sweep() -> int:
    """Send again the deliveries, outbox rows and mails whose message was lost (a broker that was down, say)."""
    return services.deliveries_sweep()
