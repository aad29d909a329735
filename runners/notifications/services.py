"""Writes for notifications: members' mail choices, webhooks, recording events, mailing and delivering them.

The apps below announce what happened with signals (runners.notifications.receivers); a worker
then turns each into an ``Event`` recorded once under its key (``job_events``,
``environment_event``, ``quota_event``), mails the members who chose it and delivers it to each
subscribed webhook: a signed POST, tried again with exponential backoff until it is answered 2xx
or NOTIFY_WEBHOOK_MAX_ATTEMPTS are spent, every attempt written on its ``Delivery``.
"""

import hashlib
import hmac
import json
import logging
import secrets
import urllib.error
import urllib.request
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.core.mail import EmailMessage, get_connection
from django.core.validators import URLValidator
from django.db import IntegrityError, transaction
from django.urls import reverse
from django.utils import timezone

from common.dispatch import send_task
from common.errors import Invalid, NotFound
from quotas.models import Quota
from runners.environments.models import Environment, EnvironmentState
from runners.jobs.models import AttemptOutcome, Job, JobAttempt, JobState
from runners.notifications.models import (
    Delivery,
    DeliveryState,
    Event,
    EventKind,
    Preference,
    Webhook,
)
from runners.notifications.selectors import email_recipients
from tenants.models import Membership, Role, Tenant
from tenants.services import require_role

logger = logging.getLogger(__name__)

DELIVER_TASK = "runners.tasks.notifications_deliver"
URL_MAX = 500
# How far back a job's preempted attempts are still announced (a message that waited for a broker).
PREEMPTION_LOOKBACK = timedelta(days=1)
# A delivery still pending this long after it was due lost its message: the sweep sends it again.
LOST_AFTER = timedelta(seconds=10)
# How long a try holds its delivery past its own timeout (a worker that died mid-try lets go after it).
CLAIM_MARGIN_S = 5
_url_validator = URLValidator(schemes=["http", "https"], message="Enter an http:// or https:// URL.")


# --- Members' choices ----------------------------------------------------------------------------


def preferences_set(*, user: AbstractBaseUser, tenant: Tenant, choices: dict[str, bool]) -> None:
    """Write the member's mail choice for each event kind named; a non-member's tenant is NotFound."""
    if not Membership.objects.filter(user=user, tenant=tenant).exists():
        raise NotFound("No such tenant.")
    for kind, email in choices.items():
        if kind not in EventKind.values:
            raise Invalid(kind, f"Not an event; the events are {', '.join(EventKind.values)}.")
        Preference.objects.update_or_create(user=user, tenant=tenant, event=kind, defaults={"email": bool(email)})


# --- Webhooks ------------------------------------------------------------------------------------


def webhook_url_check(url: str) -> str:
    url = (url or "").strip()
    if len(url) > URL_MAX:
        raise Invalid("url", f"At most {URL_MAX} characters.")
    try:
        _url_validator(url)
    except ValidationError:
        raise Invalid("url", "Enter an http:// or https:// URL.") from None
    return url


def webhook_events_check(events) -> list[str]:
    if not isinstance(events, (list, tuple)) or not events:
        raise Invalid("events", f"Pick at least one event: {', '.join(EventKind.values)}.")
    unknown = [event for event in events if event not in EventKind.values]
    if unknown:
        raise Invalid("events", f"{unknown[0]!r} is not an event; the events are {', '.join(EventKind.values)}.")
    return [kind for kind in EventKind.values if kind in events]


def webhook_create(*, actor: AbstractBaseUser, tenant: Tenant, url: str, events: list[str]) -> Webhook:
    """A new webhook of the tenant (owners), with a secret the portal makes; the caller shows it once."""
    require_role(user=actor, tenant=tenant, at_least=Role.OWNER)
    return Webhook.objects.create(
        tenant=tenant, url=webhook_url_check(url), events=webhook_events_check(events),
        secret=secrets.token_hex(32), created_by=actor if actor.is_authenticated else None,
    )


def webhook_delete(*, actor: AbstractBaseUser, webhook: Webhook) -> None:
    """Delete a webhook and its delivery log (owners); pending deliveries are never tried again."""
    require_role(user=actor, tenant=webhook.tenant, at_least=Role.OWNER)
    webhook.delete()


# --- Events --------------------------------------------------------------------------------------


def _payload(kind: str, tenant: Tenant, occurred_at: datetime, link: str, **obj) -> dict:
    return {"event": kind, "tenant": tenant.slug, "object": obj, "occurred_at": occurred_at.isoformat(), "link": link}


def event_record(*, tenant: Tenant, kind: str, key: str, payload: dict, occurred_at: datetime) -> Event:
    """The event under this key, written once with a pending delivery for each subscribed webhook."""
    existing = Event.objects.filter(key=key).first()
    if existing is not None:
        return existing
    try:
        with transaction.atomic():
            event = Event.objects.create(tenant=tenant, kind=kind, key=key, payload=payload, occurred_at=occurred_at)
            now = timezone.now()
            Delivery.objects.bulk_create([
                Delivery(webhook=webhook, event=event, kind=kind, payload=payload, next_try_at=now)
                for webhook in Webhook.objects.filter(tenant=tenant, active=True)
                if kind in webhook.events
            ])
    except IntegrityError:  # a second worker recorded it at the same moment
        return Event.objects.get(key=key)
    return event


def job_events(job_ids: list[int]) -> list[Event]:
    """The events of these jobs now: a terminal state (finished or failed), and each preempted attempt.

    Read after the attempts' end committed; each event is keyed by what it is about, so reading the
    same job again (a second attempt ended, a message delivered twice) adds nothing already sent.
    Inference replicas (serving jobs) are their endpoint's business and announce nothing here.
    """
    events = []
    since = timezone.now() - PREEMPTION_LOOKBACK
    jobs = Job.objects.filter(id__in=job_ids, kind=Job.Kind.TRAINING).select_related("tenant")
    for job in jobs:
        link = reverse("job", args=[job.id])
        preempted = JobAttempt.objects.filter(job=job, outcome=AttemptOutcome.PREEMPTED, ended_at__gte=since)
        for attempt in preempted.order_by("number"):
            payload = _payload(EventKind.JOB_PREEMPTED, job.tenant, attempt.ended_at, link, type="job", id=job.id,
                               name=job.name, state="preempted", reason=attempt.reason, attempt=attempt.number)
            events.append(event_record(tenant=job.tenant, kind=EventKind.JOB_PREEMPTED, key=f"attempt:{attempt.id}:preempted",
                                       payload=payload, occurred_at=attempt.ended_at))
        kind = {JobState.SUCCEEDED: EventKind.JOB_FINISHED, JobState.FAILED: EventKind.JOB_FAILED}.get(job.state)
        if kind is not None:
            at = job.finished_at or job.state_changed_at
            payload = _payload(kind, job.tenant, at, link, type="job", id=job.id, name=job.name, state=job.state,
                               reason=job.reason)
            events.append(event_record(tenant=job.tenant, kind=kind, key=f"job:{job.id}:{job.state}", payload=payload,
                                       occurred_at=at))
    return events


def environment_event(environment_id: int) -> Event | None:
    """The event of an environment that failed (once per environment), or None if it is not failed."""
    environment = Environment.objects.select_related("tenant").filter(id=environment_id).first()
    if environment is None or environment.state != EnvironmentState.FAILED:
        return None
    at = environment.state_changed_at
    payload = _payload(EventKind.ENVIRONMENT_FAILED, environment.tenant, at, reverse("environment", args=[environment.id]),
                       type="environment", id=environment.id, name=environment.name, state=environment.state,
                       reason=environment.status_message)
    return event_record(tenant=environment.tenant, kind=EventKind.ENVIRONMENT_FAILED,
                        key=f"environment:{environment.id}:failed", payload=payload, occurred_at=at)


def quota_event(tenant_id: int, key: str, at: str) -> Event | None:
    """The event of one quota change (the key the receiver made for it); the payload has the quotas now."""
    tenant = Tenant.objects.filter(id=tenant_id).first()
    if tenant is None:
        return None
    occurred_at = datetime.fromisoformat(at) if at else timezone.now()
    quotas = [{"flavor": quota.flavor.name, "guaranteed": quota.guaranteed, "max": quota.max}
              for quota in Quota.objects.filter(tenant=tenant).select_related("flavor").order_by("flavor__name")]
    state = "; ".join(f"{q['flavor']}: {q['guaranteed']} guaranteed, {q['max']} max" for q in quotas) or "no quota"
    payload = _payload(EventKind.QUOTA_CHANGED, tenant, occurred_at, reverse("tenant-quota", args=[tenant.slug]),
                       type="quota", id=tenant.id, name=tenant.slug, state=state,
                       reason="The tenant's quota changed.", quotas=quotas)
    return event_record(tenant=tenant, kind=EventKind.QUOTA_CHANGED, key=f"quota:{key}", payload=payload,
                        occurred_at=occurred_at)


def event_send(event: Event) -> None:
    """Mail the event (once) and send each of its pending, due deliveries to a worker."""
    if Event.objects.filter(id=event.id, emailed_at__isnull=True).update(emailed_at=timezone.now()):
        _mail(event)
    due = Delivery.objects.filter(event=event, state=DeliveryState.PENDING, next_try_at__lte=timezone.now())
    for delivery_id in due.values_list("id", flat=True):
        send_task(DELIVER_TASK, delivery_id)


def _mail(event: Event) -> None:
    recipients = email_recipients(event.tenant, event.kind)
    if not recipients:
        return
    obj = event.payload["object"]
    subject = f"[GPU portal] {event.tenant.slug}: {EventKind(event.kind).label.lower()}: {obj.get('name', '')}"
    body = "\n".join([
        f"{EventKind(event.kind).label} in {event.tenant.name} ({event.tenant.slug}).",
        "",
        f"{obj.get('type', 'object').capitalize()}: {obj.get('name', '')} (id {obj.get('id')})",
        f"State: {obj.get('state', '')}",
        f"Reason: {obj.get('reason', '') or '-'}",
        f"When: {event.payload['occurred_at']}",
        f"Link: {event.payload['link']}",
        "",
        "You get this mail because of your notification choices on the tenant's Notifications page.",
    ])
    messages = [EmailMessage(subject, body, settings.DEFAULT_FROM_EMAIL, [address]) for address in recipients]
    try:
        get_connection().send_messages(messages)
    except Exception as exc:  # the mail server is down: the webhooks still go; the mail is not retried
        logger.error("Could not mail event %s: %s", event.key, exc)


# --- Delivering ----------------------------------------------------------------------------------


def body_bytes(payload: dict) -> bytes:
    """The exact bytes POSTed, and signed: compact JSON with sorted keys."""
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()


def signature(secret: str, body: bytes) -> str:
    """The X-Portal-Signature header: sha256=<hex HMAC-SHA256 of the raw body, keyed with the secret>."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def backoff_s(attempts: int) -> float:
    """Seconds before the next try after `attempts` failed ones: base, 2 x base, 4 x base ..."""
    return settings.NOTIFY_WEBHOOK_BACKOFF_S * 2 ** (attempts - 1)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # a 3xx is an answer like any other non-2xx: not followed, tried again later


def _post(url: str, body: bytes, headers: dict) -> tuple[int | None, str]:
    """POST once: (status code, error); the status is None when no answer came."""
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    opener = urllib.request.build_opener(_NoRedirects)
    try:
        with opener.open(request, timeout=settings.NOTIFY_WEBHOOK_TIMEOUT_S) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
        exc.close()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return None, f"{type(exc).__name__}: {reason}"[:1000]
    return status, "" if 200 <= status < 300 else f"Answered {status}."


def delivery_attempt(delivery_id: int) -> str:
    """Try one delivery now, if it is pending and due; record the answer and schedule the next try.

    The claim (a conditional update pushing next_try_at past this try's timeout) makes two
    messages for one delivery (a retry and the sweep's) send it once; a message that finds it
    claimed or waiting for its backoff sends nothing. Returns the delivery's state ("missing" if gone).
    """
    now = timezone.now()
    lease = timedelta(seconds=settings.NOTIFY_WEBHOOK_TIMEOUT_S + CLAIM_MARGIN_S)
    claimed = Delivery.objects.filter(
        id=delivery_id, state=DeliveryState.PENDING, next_try_at__lte=now + timedelta(seconds=1)
    ).update(next_try_at=now + lease)
    if not claimed:
        return Delivery.objects.filter(id=delivery_id).values_list("state", flat=True).first() or "missing"
    delivery = Delivery.objects.select_related("webhook").get(id=delivery_id)
    body = body_bytes(delivery.payload)
    status, error = _post(delivery.webhook.url, body, {
        "Content-Type": "application/json",
        "User-Agent": "gpu-portal-webhooks",
        "X-Portal-Event": delivery.kind,
        "X-Portal-Delivery": str(delivery.id),
        "X-Portal-Signature": signature(delivery.webhook.secret, body),
    })
    attempts = delivery.attempts + 1
    fields = {"attempts": attempts, "status_code": status, "error": error}
    if not error:
        fields.update(state=DeliveryState.DELIVERED, delivered_at=timezone.now(), next_try_at=None)
    elif attempts >= settings.NOTIFY_WEBHOOK_MAX_ATTEMPTS:
        fields.update(state=DeliveryState.FAILED, next_try_at=None)
    else:
        delay = backoff_s(attempts)
        fields.update(next_try_at=timezone.now() + timedelta(seconds=delay))
    Delivery.objects.filter(id=delivery_id).update(**fields)
    if "state" in fields:
        return fields["state"]
    send_task(DELIVER_TASK, delivery_id, countdown=delay)
    return DeliveryState.PENDING


def deliveries_sweep() -> int:
    """Send again every pending delivery whose message must have been lost (well past due); how many."""
    overdue = Delivery.objects.filter(state=DeliveryState.PENDING, next_try_at__lte=timezone.now() - LOST_AFTER)
    ids = list(overdue.values_list("id", flat=True)[:1000])
    for delivery_id in ids:
        send_task(DELIVER_TASK, delivery_id)
    return len(ids)
