"""Writes for notifications: members' mail choices, webhooks, recording events, mailing and delivering them.

The apps below announce what happened with signals (runners.notifications.receivers); a worker
then turns each into an ``Event`` recorded once under its key (``job_events``,
``environment_event``, ``quota_event``), mails the members who chose it and delivers it to each
subscribed webhook: a signed POST, tried again with exponential backoff until it is answered 2xx
or NOTIFY_WEBHOOK_MAX_ATTEMPTS are spent, every attempt written on its ``Delivery``.
"""

import hashlib
import hmac
import http.client
import io
import ipaddress
import json
import logging
import secrets
import socket
import ssl
import time
import urllib.parse
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.core.mail import EmailMessage, get_connection
from django.core.validators import URLValidator
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.urls import reverse
from django.utils import timezone

from audit.services import record
from common.dispatch import send_task
from common.errors import Invalid, NotFound
from quotas.models import Quota
from runners.environments.models import Environment, EnvironmentState
from runners.jobs.models import AttemptOutcome, Job, JobAttempt, JobState
from runners.notifications.models import (
    EMAIL_DEFAULTS,
    Delivery,
    DeliveryState,
    Event,
    EventKind,
    Outbox,
    Preference,
    Webhook,
)
from runners.notifications.selectors import email_recipients
from tenants.models import Membership, Role, Tenant
from tenants.services import require_role

logger = logging.getLogger(__name__)

DELIVER_TASK = "runners.tasks.notifications_deliver"
EVENT_TASK = "runners.tasks.notifications_event"
URL_MAX = 500
# How far back a job's preempted attempts are still announced (a message that waited for a broker).
PREEMPTION_LOOKBACK = timedelta(days=1)
# A delivery still pending this long after it was due lost its message: the sweep sends it again.
LOST_AFTER = timedelta(seconds=10)
# How long a try holds its delivery past its own deadline (a worker that died mid-try lets go after it).
CLAIM_MARGIN_S = 5
# Tries of one event's mail (a mail server down or hung past EMAIL_TIMEOUT) before it is given up.
MAIL_MAX_ATTEMPTS = 3
# Processed outbox rows are kept this long (to see what happened), then deleted by the sweep.
OUTBOX_KEEP = timedelta(days=1)
# After the sweep sends a message again it waits 2 x LOST_AFTER before the next, then 4 x, 8 x ... at
# most this long: a broker with a backlog gets a few copies of a lost message, not one per sweep.
SWEEP_WAIT_MAX = timedelta(minutes=10)
_url_validator = URLValidator(schemes=["http", "https"], message="Enter an http:// or https:// URL.")


# --- Members' choices ----------------------------------------------------------------------------


def preferences_set(*, user: AbstractBaseUser, tenant: Tenant, choices: dict[str, bool]) -> None:
    """Write the member's mail choice for each event kind named, all or none, with an audit entry of those
    that changed; a non-member's tenant is NotFound."""
    if not Membership.objects.filter(user=user, tenant=tenant).exists():
        raise NotFound("No such tenant.")
    for kind in choices:
        if kind not in EventKind.values:
            raise Invalid(kind, f"Not an event; the events are {', '.join(EventKind.values)}.")
    with transaction.atomic():
        rows = Preference.objects.select_for_update().filter(user=user, tenant=tenant)
        now = {kind: EMAIL_DEFAULTS[kind] for kind in EventKind.values} | dict(rows.values_list("event", "email"))
        for kind, email in choices.items():
            Preference.objects.update_or_create(user=user, tenant=tenant, event=kind, defaults={"email": bool(email)})
        changed = [kind for kind in EventKind.values if kind in choices and bool(choices[kind]) != now[kind]]
        if changed:
            record("preferences.changed", actor=user, tenant=tenant, object_type="preference", object_id=user.pk,
                   object_repr=f"{user.get_username()} in {tenant.slug}",
                   before={kind: now[kind] for kind in changed}, after={kind: bool(choices[kind]) for kind in changed})


# --- Webhooks ------------------------------------------------------------------------------------


def webhook_url_check(url: str) -> str:
    """The URL, stripped, if it is http(s) and its host resolves to public addresses only (or not yet at all:
    it is checked again at each try); a loopback, private, link-local or other non-global address is refused
    unless NOTIFY_WEBHOOK_ALLOW_PRIVATE."""
    url = (url or "").strip()
    if len(url) > URL_MAX:
        raise Invalid("url", f"At most {URL_MAX} characters.")
    try:
        _url_validator(url)
    except ValidationError:
        raise Invalid("url", "Enter an http:// or https:// URL.") from None
    parts = urllib.parse.urlsplit(url)
    try:
        _addresses(parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
    except _Refused as exc:
        raise Invalid("url", str(exc)) from None
    except OSError:
        pass  # does not resolve (yet): every try resolves and checks it again
    return url


class _Refused(Exception):
    """The host is (or resolves to) an address webhooks may not reach."""


def _addresses(host: str, port: int) -> list[str]:
    """The host's addresses, every one of them public (_public), or _Refused; OSError if it does not resolve.

    NOTIFY_WEBHOOK_ALLOW_PRIVATE lets any address through (a receiver on the cluster's own network)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    for address in addresses:
        _check_address(host, address)
    return addresses


# NAT64 prefixes: the well-known one (its last 32 bits are the IPv4 address) and the local-use one, refused whole.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")


def _public(address: str) -> bool:
    """Whether an address is global and unicast, an IPv6 one embedding IPv4 (IPv4-compatible, mapped, NAT64,
    6to4) judged by the IPv4 address it carries as well."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if not ip.is_global or ip.is_multicast:
        return False
    if ip.version == 4:
        return True
    if ip in _NAT64_LOCAL:
        return False
    value = int(ip)
    embedded = ip.ipv4_mapped or ip.sixtofour
    if embedded is None and (ip in _NAT64 or value >> 32 == 0):  # NAT64, or IPv4-compatible (::a.b.c.d)
        embedded = ipaddress.IPv4Address(value & 0xFFFFFFFF)
    return embedded is None or _public(str(embedded))


def _check_address(host: str, address: str) -> None:
    """_Refused unless the address is public (or NOTIFY_WEBHOOK_ALLOW_PRIVATE lets every address through)."""
    if not settings.NOTIFY_WEBHOOK_ALLOW_PRIVATE and not _public(address):
        raise _Refused(f"{host} is a non-public address ({address}); webhooks go to public addresses only.")


def webhook_events_check(events) -> list[str]:
    if not isinstance(events, (list, tuple)) or not events:
        raise Invalid("events", f"Pick at least one event: {', '.join(EventKind.values)}.")
    unknown = [event for event in events if event not in EventKind.values]
    if unknown:
        raise Invalid("events", f"{unknown[0]!r} is not an event; the events are {', '.join(EventKind.values)}.")
    return [kind for kind in EventKind.values if kind in events]


def webhook_create(*, actor: AbstractBaseUser, tenant: Tenant, url: str, events: list[str]) -> Webhook:
    """A new webhook of the tenant (owners), with a secret the portal makes; the caller shows it once.

    A tenant has at most NOTIFY_WEBHOOK_MAX_PER_TENANT (counted under the tenant's row lock)."""
    require_role(user=actor, tenant=tenant, at_least=Role.OWNER)
    url, events = webhook_url_check(url), webhook_events_check(events)
    with transaction.atomic():
        Tenant.objects.select_for_update().filter(id=tenant.id).first()
        limit = settings.NOTIFY_WEBHOOK_MAX_PER_TENANT
        if Webhook.objects.filter(tenant=tenant).count() >= limit:
            raise Invalid("url", f"A tenant has at most {limit} webhooks; delete one before adding another.")
        webhook = Webhook.objects.create(
            tenant=tenant, url=url, events=events,
            secret=secrets.token_hex(32), created_by=actor if actor.is_authenticated else None,
        )
        record("webhook.created", actor=actor, tenant=tenant, obj=webhook, after=_webhook_audit_fields(webhook))
        return webhook


def _webhook_audit_fields(webhook: Webhook) -> dict:
    """What the audit log keeps of a webhook: never its secret."""
    return {"url": webhook.url, "events": webhook.events, "active": webhook.active}


def webhook_delete(*, actor: AbstractBaseUser, webhook: Webhook) -> None:
    """Delete a webhook and its delivery log (owners); pending deliveries are never tried again. Of two
    deletes at once, the second deletes nothing: NotFound, and no second audit entry."""
    require_role(user=actor, tenant=webhook.tenant, at_least=Role.OWNER)
    with transaction.atomic():
        _total, deleted = Webhook.objects.filter(id=webhook.id).delete()
        if not deleted.get(Webhook._meta.label):
            raise NotFound("No such webhook.")
        record("webhook.deleted", actor=actor, tenant=webhook.tenant, obj=webhook, object_id=webhook.id,
               before=_webhook_audit_fields(webhook))


# --- Events --------------------------------------------------------------------------------------


def _payload(kind: str, tenant: Tenant, occurred_at: datetime, link: str, **obj) -> dict:
    # An absolute link when the portal's public address is set (PORTAL_PUBLIC_URL); the path otherwise.
    if settings.PORTAL_PUBLIC_URL:
        link = settings.PORTAL_PUBLIC_URL.rstrip("/") + link
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


def workspace_event(workspace_id: int, key: str, at: str) -> Event | None:
    """The event of a workspace the portal stopped (the idle cull, a preemption), for its owner only."""
    from runners.workspaces.models import Workspace

    workspace = Workspace.objects.select_related("tenant", "owner").filter(id=workspace_id).first()
    if workspace is None:
        return None
    occurred_at = datetime.fromisoformat(at) if at else timezone.now()
    payload = _payload(EventKind.WORKSPACE_STOPPED, workspace.tenant, occurred_at, reverse("workspace",
                       args=[workspace.tenant.slug, workspace.id]), type="workspace", id=workspace.id,
                       name=workspace.name, state=workspace.state, reason=workspace.reason,
                       owner=workspace.owner.get_username(), cause=key.split(":", 1)[0])
    return event_record(tenant=workspace.tenant, kind=EventKind.WORKSPACE_STOPPED, key=f"workspace:{workspace.id}:{key}",
                        payload=payload, occurred_at=occurred_at)


def outbox_process(outbox_id: int) -> int:
    """Record and send the events of one outbox row (what a receiver wrote in the signal's transaction);
    how many events. Idempotent: events are recorded once under their keys, so a row processed twice
    (a message delivered twice, the sweep beside a slow worker) sends nothing twice."""
    row = Outbox.objects.filter(id=outbox_id).first()
    if row is None:
        return 0
    events = events_of(row.source, row.ref, row.key, row.at)
    for event in events:
        event_send(event)
    Outbox.objects.filter(id=row.id, processed_at__isnull=True).update(processed_at=timezone.now())
    return len(events)


def events_of(source: str, ref, key: str = "", at: str = "") -> list[Event]:
    """The events of what happened (source "jobs": ref is a list of job ids; "environment": an environment id;
    "quota": a tenant id with the change's key and time)."""
    if source == "jobs":
        events = job_events(list(ref or []))
    elif source == "environment" and ref is not None:
        events = [environment_event(int(ref))]
    elif source == "quota" and ref is not None and key:
        events = [quota_event(int(ref), key, at)]
    elif source == "workspace" and ref is not None and key:
        events = [workspace_event(int(ref), key, at)]
    else:
        events = []
    return [event for event in events if event is not None]


def event_send(event: Event) -> None:
    """Mail the event (once) and send each of its pending, due deliveries to a worker."""
    _event_mail(event)
    due = Delivery.objects.filter(event=event, state=DeliveryState.PENDING, next_try_at__lte=timezone.now())
    for delivery_id in due.values_list("id", flat=True):
        send_task(DELIVER_TASK, delivery_id)


def _event_mail(event: Event) -> None:
    """Mail the event unless it was mailed, given up, or claimed by a try whose claim still holds.

    The claim (email_claimed_until, NOTIFY_MAIL_CLAIM_S on) makes two messages for one event send one
    mail; a worker that dies between the claim and the mail lets go when the claim runs out, and the
    sweep mails it then. The outcome is written only while this try's claim still holds."""
    now = timezone.now()
    claimed_until = now + timedelta(seconds=settings.NOTIFY_MAIL_CLAIM_S)
    unclaimed = Q(email_claimed_until__isnull=True) | Q(email_claimed_until__lt=now)
    if not Event.objects.filter(unclaimed, id=event.id, emailed_at__isnull=True, email_attempts__lt=MAIL_MAX_ATTEMPTS
                                ).update(email_claimed_until=claimed_until, sweeps=0, sweep_after=None):
        return
    attempts = Event.objects.filter(id=event.id).values_list("email_attempts", flat=True).get()
    error = _mail(event)
    if error:
        # Let go of the claim so the sweep mails it again, until MAIL_MAX_ATTEMPTS are spent;
        # the last error stays on the event (and in the admin) either way.
        fields = {"email_attempts": attempts + 1, "email_error": error[:1000],
                  "emailed_at": None if attempts + 1 < MAIL_MAX_ATTEMPTS else timezone.now()}
    else:
        fields = {"emailed_at": timezone.now()}
    if not Event.objects.filter(id=event.id, email_claimed_until=claimed_until).update(email_claimed_until=None,
                                                                                       **fields):
        logger.warning("Event %s: this mail outlived its claim; another try's outcome stands.", event.key)


def _mail(event: Event) -> str:
    """Mail the event to the members who chose it; the error ("" when sent or nobody is to be mailed)."""
    owner = event.payload["object"].get("owner") if event.kind == EventKind.WORKSPACE_STOPPED else None
    recipients = email_recipients(event.tenant, event.kind, only=owner)
    if not recipients:
        return ""
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
        get_connection().send_messages(messages)  # bounded by EMAIL_TIMEOUT (SMTP)
    except Exception as exc:  # the mail server is down: the webhooks still go; the sweep mails it again
        logger.error("Could not mail event %s: %s", event.key, exc)
        return f"{type(exc).__name__}: {exc}"
    return ""


# --- Delivering ----------------------------------------------------------------------------------


def body_bytes(payload: dict) -> bytes:
    """The exact bytes POSTed, and signed: compact JSON with sorted keys."""
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()


def signature(secret: str, body: bytes, timestamp: int | str) -> str:
    """The X-Portal-Signature header: sha256=<hex HMAC-SHA256 of "<X-Portal-Timestamp>." + the raw body,
    keyed with the secret>; signing the time lets receivers refuse a replayed (old) delivery."""
    return "sha256=" + hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def backoff_s(attempts: int) -> float:
    """Seconds before the next try after `attempts` failed ones: base, 2 x base, 4 x base ..."""
    return settings.NOTIFY_WEBHOOK_BACKOFF_S * 2 ** (attempts - 1)


class _DeadlineReader(io.RawIOBase):
    """Reads a socket, each read given only what is left of the try's deadline (a server that drips one
    byte at a time cannot hold a try past it, whatever each read's own timeout)."""

    def __init__(self, sock, deadline: float):
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("No answer within NOTIFY_WEBHOOK_TIMEOUT_S.")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class _DeadlineSocket:
    """The connection's socket with every send and read bounded by the try's deadline."""

    def __init__(self, sock, deadline: float):
        self._sock, self._deadline = sock, deadline

    def sendall(self, data) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("Could not send within NOTIFY_WEBHOOK_TIMEOUT_S.")
        self._sock.settimeout(left)
        self._sock.sendall(data)

    def makefile(self, mode="rb", *args, **kwargs):
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def __getattr__(self, name):
        return getattr(self._sock, name)


def _connection(parts: urllib.parse.SplitResult, address: str, deadline: float) -> http.client.HTTPConnection:
    """A connection to the checked address (not a second lookup of the name), sending the URL's Host header;
    https verifies the certificate against the URL's host name (SNI too)."""
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    base = http.client.HTTPSConnection if https else http.client.HTTPConnection

    class Pinned(base):
        def connect(self):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("Could not connect within NOTIFY_WEBHOOK_TIMEOUT_S.")
            sock = socket.create_connection((address, port), timeout=left)
            try:  # the address the connection actually uses decides, whatever was resolved
                _check_address(parts.hostname or "", sock.getpeername()[0])
            except _Refused:
                sock.close()
                raise
            if https:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
            self.sock = _DeadlineSocket(sock, deadline)

    return Pinned(parts.hostname, port, timeout=settings.NOTIFY_WEBHOOK_TIMEOUT_S)


def _post(url: str, body: bytes, headers: dict) -> tuple[int | None, str]:
    """POST once within NOTIFY_WEBHOOK_TIMEOUT_S in all: (status code, error); the status is None when no
    answer came. Redirects are not followed (a 3xx is an answer like any other non-2xx)."""
    deadline = time.monotonic() + settings.NOTIFY_WEBHOOK_TIMEOUT_S
    connection = None
    try:
        parts = urllib.parse.urlsplit(url)
        addresses = _addresses(parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        connection = _connection(parts, addresses[0], deadline)
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        status = response.status
    except _Refused as exc:
        return None, f"Refused: {exc}"[:1000]
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"[:1000]
    except Exception as exc:  # anything else is this try's error too, never a retry forever
        logger.exception("Webhook POST to %s failed", url)
        return None, f"{type(exc).__name__}: {exc}"[:1000]
    finally:
        if connection is not None:
            connection.close()
    return status, "" if 200 <= status < 300 else f"Answered {status}."


def delivery_attempt(delivery_id: int) -> str:
    """Try one delivery now, if it is pending and due; record the answer and schedule the next try.

    The claim (a conditional update pushing next_try_at past this try's deadline) makes two
    messages for one delivery (a retry and the sweep's) send it once; a message that finds it
    claimed or waiting for its backoff sends nothing. The answer is written only while the claim
    still holds (next_try_at and attempts as this try left them): a try that outlived its claim,
    which another try has taken over since, writes nothing. Returns the delivery's state ("missing" if gone).
    """
    now = timezone.now()
    claimed_until = now + timedelta(seconds=settings.NOTIFY_WEBHOOK_TIMEOUT_S + CLAIM_MARGIN_S)
    claimed = Delivery.objects.filter(
        id=delivery_id, state=DeliveryState.PENDING, next_try_at__lte=now + timedelta(seconds=1)
    ).update(next_try_at=claimed_until, sweeps=0, sweep_after=None)
    if not claimed:
        return _state(delivery_id)
    delivery = Delivery.objects.select_related("webhook").get(id=delivery_id)
    body = body_bytes(delivery.payload)
    timestamp = int(time.time())
    status, error = _post(delivery.webhook.url, body, {
        "Content-Type": "application/json",
        "User-Agent": "gpu-portal-webhooks",
        "X-Portal-Event": delivery.kind,
        "X-Portal-Delivery": str(delivery.id),
        "X-Portal-Timestamp": str(timestamp),
        "X-Portal-Signature": signature(delivery.webhook.secret, body, timestamp),
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
    written = Delivery.objects.filter(
        id=delivery_id, state=DeliveryState.PENDING, next_try_at=claimed_until, attempts=delivery.attempts
    ).update(**fields)
    if not written:
        logger.warning("Delivery %s: this try outlived its claim; another try's answer stands.", delivery_id)
        return _state(delivery_id)
    if "state" in fields:
        return fields["state"]
    send_task(DELIVER_TASK, delivery_id, countdown=delay)
    return DeliveryState.PENDING


def _state(delivery_id: int) -> str:
    return Delivery.objects.filter(id=delivery_id).values_list("state", flat=True).first() or "missing"


def _to_send_again(queryset, now: datetime) -> list[int]:
    """The ids (at most 1000) of the rows the sweep sends again now: those not waiting after its last send.
    Each is marked sent again, to wait twice as long as before (at most SWEEP_WAIT_MAX) before the next."""
    waited = Q(sweep_after__isnull=True) | Q(sweep_after__lte=now)
    rows = list(queryset.filter(waited).order_by("id").values_list("id", "sweeps")[:1000])
    by_sweeps: dict[int, list[int]] = {}
    for row_id, sweeps in rows:
        by_sweeps.setdefault(sweeps, []).append(row_id)
    for sweeps, ids in by_sweeps.items():
        wait = min(LOST_AFTER * 2 ** min(sweeps + 1, 20), SWEEP_WAIT_MAX)
        queryset.model.objects.filter(id__in=ids).update(sweeps=sweeps + 1, sweep_after=now + wait)
    return [row_id for row_id, _ in rows]


def deliveries_sweep() -> int:
    """Send again every pending delivery whose message must have been lost (well past due), every outbox
    row left unprocessed and every event whose mail is still to go and unclaimed (a broker that was down,
    a worker killed mid-task, a mail server down); delete outbox rows processed long ago. How many were sent.

    What it sent once waits before it is sent again (2, 4, 8 ... x LOST_AFTER): its message may only be
    queued behind a backlog, which a copy at every sweep would make longer."""
    now = timezone.now()
    cutoff = now - LOST_AFTER
    ids = _to_send_again(Delivery.objects.filter(state=DeliveryState.PENDING, next_try_at__lte=cutoff), now)
    for delivery_id in ids:
        send_task(DELIVER_TASK, delivery_id)
    rows = _to_send_again(Outbox.objects.filter(processed_at__isnull=True, created_at__lte=cutoff), now)
    for outbox_id in rows:
        send_task(EVENT_TASK, "outbox", outbox_id)
    unclaimed = Q(email_claimed_until__isnull=True) | Q(email_claimed_until__lt=now)
    unmailed = _to_send_again(Event.objects.filter(unclaimed, emailed_at__isnull=True,
                                                   email_attempts__lt=MAIL_MAX_ATTEMPTS, created_at__lte=cutoff), now)
    for event_id in unmailed:
        send_task(EVENT_TASK, "event", event_id)
    Outbox.objects.filter(processed_at__lte=now - OUTBOX_KEEP).delete()
    return len(ids) + len(rows) + len(unmailed)
