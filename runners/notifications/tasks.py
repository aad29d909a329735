"""Celery tasks of notifications: record and send an event, deliver one webhook call, sweep lost deliveries.

All three are idempotent and acknowledged late: a worker that dies mid-task leaves the message for
another, an event is recorded once under its key, and a delivery is claimed before each try.
"""

from celery import shared_task

from runners.notifications import services


@shared_task(name="runners.tasks.notifications_event", acks_late=True)
def notifications_event(source: str = "", ref=None, key: str = "", at: str = "") -> dict:
    """Record what happened (source "jobs": ref is a list of job ids; "environment": an environment id;
    "quota": a tenant id with the change's key and time), then mail and deliver each event."""
    if source == "jobs":
        events = services.job_events(list(ref or []))
    elif source == "environment" and ref is not None:
        events = [services.environment_event(int(ref))]
    elif source == "quota" and ref is not None and key:
        events = [services.quota_event(int(ref), key, at)]
    else:
        events = []
    events = [event for event in events if event is not None]
    for event in events:
        services.event_send(event)
    return {"events": len(events)}


@shared_task(name="runners.tasks.notifications_deliver", acks_late=True)
def notifications_deliver(delivery_id: int | None = None) -> str:
    """Try one webhook delivery; a failed try sends this task again after its backoff."""
    if delivery_id is None:
        return "missing"
    return services.delivery_attempt(int(delivery_id))


@shared_task(name="runners.tasks.notifications_sweep")
def notifications_sweep() -> int:
    """Send again the deliveries whose message was lost (a broker that was down, say)."""
    return services.deliveries_sweep()
