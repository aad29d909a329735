"""What a webhook may reach and how long a try may take; events kept in the outbox until processed; mail
tried again; timestamped signatures and absolute links.

Real receivers on loopback (tests.notifications.hooks), PostgreSQL and the tasks called as a worker would.
"""

import threading
import time
from datetime import timedelta

import pytest
from django.core import mail
from django.core.mail import get_connection
from django.db import connection, transaction
from django.utils import timezone

from common.errors import Invalid
from portal.celery import app
from quotas.services import quota_set
from runners.notifications import services, tasks
from runners.notifications.models import Delivery, Event, EventKind, Outbox, Preference
from tests.notifications import test_events
from tests.notifications.hooks import HookReceiver, RawServer, signed_by
from tests.notifications.test_events import _end

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

# The same fixtures as the events' tests: members with addresses, and a job submitted and admitted.
addresses = test_events.addresses
submit = test_events.submit


def _webhooks(slug: str) -> str:
    return f"/api/v1/tenants/{slug}/webhooks/"


def _failed_delivery(submit, owner, tenant, url: str) -> Delivery:
    services.webhook_create(actor=owner, tenant=tenant, url=url, events=["job_failed"])
    tasks.notifications_event("jobs", [_end(submit(), "failed").id])
    return Delivery.objects.get()


# --- What a webhook may reach (SSRF) -------------------------------------------------------------


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000/h", "http://localhost/h", "http://169.254.169.254/latest/meta-data/",
    "http://10.96.0.1/h", "http://192.168.1.5/h", "http://[::1]/h", "https://100.64.0.1/h", "http://0.0.0.0/h",
])
def test_a_webhook_to_a_non_public_address_is_a_400_naming_the_url(client_for, owner, tenant, url):
    response = client_for(owner).post(_webhooks("acme"), {"url": url, "events": ["job_failed"]}, format="json")
    assert response.status_code == 400 and "url" in response.json(), response.json()
    assert "public" in str(response.json()["url"])


def test_private_addresses_are_allowed_only_with_the_setting(settings, owner, tenant):
    with pytest.raises(Invalid):
        services.webhook_create(actor=owner, tenant=tenant, url="http://127.0.0.1:9/h", events=["job_failed"])
    settings.NOTIFY_WEBHOOK_ALLOW_PRIVATE = True
    assert services.webhook_create(actor=owner, tenant=tenant, url="http://127.0.0.1:9/h", events=["job_failed"])
    assert services.webhook_url_check("https://1.1.1.1/h") == "https://1.1.1.1/h"


def test_a_try_to_an_address_that_is_no_longer_allowed_sends_nothing(submit, settings, tenant, owner):
    """Checked again at send time (a name that resolves elsewhere now): refused, recorded, nothing sent."""
    with HookReceiver() as hook:
        delivery = _failed_delivery(submit, owner, tenant, hook.url)
        settings.NOTIFY_WEBHOOK_ALLOW_PRIVATE = False
        assert tasks.notifications_deliver(delivery.id) == "pending"
    assert hook.received == []
    delivery.refresh_from_db()
    assert delivery.status_code is None and delivery.error.startswith("Refused: 127.0.0.1 is a non-public address")


def test_a_tenant_has_at_most_the_set_number_of_webhooks(client_for, settings, owner, tenant):
    settings.NOTIFY_WEBHOOK_MAX_PER_TENANT = 2
    api = client_for(owner)
    for _ in range(2):
        hook = {"url": "https://hooks.example.test/p", "events": ["job_failed"]}
        assert api.post(_webhooks("acme"), hook, format="json").status_code == 201
    refused = api.post(_webhooks("acme"), hook, format="json")
    assert refused.status_code == 400 and "at most 2 webhooks" in str(refused.json()["url"]), refused.json()


# --- One try: every error recorded, a deadline in all, written only under its claim -------------------


def test_a_receiver_that_answers_garbage_is_tried_max_attempts_times_and_fails(submit, settings, tenant, owner):
    settings.NOTIFY_WEBHOOK_MAX_ATTEMPTS = 3
    with RawServer(b"SSH-2.0-OpenSSH_9.6\r\n") as server:
        delivery = _failed_delivery(submit, owner, tenant, server.url)
        states = []
        for _ in range(5):
            Delivery.objects.filter(id=delivery.id, next_try_at__isnull=False).update(next_try_at=timezone.now())
            states.append(tasks.notifications_deliver(delivery.id))
    assert states == ["pending", "pending", "failed", "failed", "failed"]
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts, delivery.status_code) == ("failed", 3, None)
    assert delivery.error.startswith("BadStatusLine"), delivery.error
    assert server.connections == 3


def test_a_receiver_that_drips_its_answer_cannot_hold_a_try_past_its_timeout(submit, settings, tenant, owner):
    settings.NOTIFY_WEBHOOK_TIMEOUT_S = 1
    # Each byte well within the timeout of one read, the whole answer far past it.
    with RawServer(b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100 + b"\r\n\r\n", drip_s=0.1) as server:
        delivery = _failed_delivery(submit, owner, tenant, server.url)
        started = time.monotonic()
        assert tasks.notifications_deliver(delivery.id) == "pending"
        took = time.monotonic() - started
    assert took < 3, f"the try took {took:.1f}s"
    delivery.refresh_from_db()
    assert delivery.attempts == 1 and delivery.error.startswith("TimeoutError"), delivery.error


@pytest.mark.django_db(transaction=True)
def test_a_try_that_outlived_its_claim_does_not_overwrite_the_try_that_took_over(submit, settings, tenant, owner):
    settings.NOTIFY_WEBHOOK_TIMEOUT_S = 5
    with HookReceiver(hold_first=True) as hook:
        delivery = _failed_delivery(submit, owner, tenant, hook.url)
        outcome = {}

        def first_try():
            try:
                outcome["first"] = services.delivery_attempt(delivery.id)
            finally:
                connection.close()

        slow = threading.Thread(target=first_try)
        slow.start()
        assert hook.held.wait(10), "the first try reached the receiver"
        # Its claim ran out (as a try past timeout + margin would find it): the next try takes over.
        Delivery.objects.filter(id=delivery.id).update(next_try_at=timezone.now() - timedelta(seconds=1))
        assert services.delivery_attempt(delivery.id) == "delivered"
        hook.release.set()  # the first try now ends without an answer
        slow.join(15)
    assert outcome["first"] == "delivered", "the stale try reports the state it found, not its own"
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts, delivery.status_code, delivery.error) == ("delivered", 1, 204, "")
    assert delivery.next_try_at is None


# --- The outbox: nothing lost between the signal and the worker -----------------------------------


def test_the_receiver_writes_an_outbox_row_in_the_signals_transaction(submit):
    job = _end(submit(), "failed")
    row = Outbox.objects.get()  # the after-commit message never went (the test's transaction is open)
    assert (row.source, row.ref, row.processed_at) == ("jobs", [job.id], None)
    assert Event.objects.count() == 0

    assert tasks.notifications_event("outbox", row.id) == {"events": 1}
    row.refresh_from_db()
    assert row.processed_at is not None and Event.objects.get().key == f"job:{job.id}:failed"
    assert tasks.notifications_event("outbox", row.id) == {"events": 1} and Event.objects.count() == 1


def test_a_rolled_back_change_leaves_no_outbox_row(tenant, flavors, staff):
    with pytest.raises(RuntimeError), transaction.atomic():
        quota_set(actor=staff, tenant=tenant, flavor=flavors["h100-80gb"], guaranteed=4, max=8)
        assert Outbox.objects.filter(source="quota").exists()
        raise RuntimeError("rolled back")
    assert not Outbox.objects.exists()


def test_the_sweep_processes_outbox_rows_whose_message_was_lost(submit, settings, addresses):
    job = _end(submit(), "failed")
    row = Outbox.objects.get()
    assert tasks.notifications_sweep() == 0, "not yet: its own message may still be on its way"
    Outbox.objects.filter(id=row.id).update(created_at=timezone.now() - timedelta(minutes=1))
    settings.CELERY_TASK_ALWAYS_EAGER = True
    app.conf.task_always_eager = True
    try:
        assert tasks.notifications_sweep() == 1
    finally:
        app.conf.task_always_eager = False
    row.refresh_from_db()
    assert row.processed_at is not None
    assert Event.objects.get().key == f"job:{job.id}:failed" and len(mail.outbox) == 3
    Outbox.objects.filter(id=row.id).update(processed_at=timezone.now() - timedelta(days=2))
    tasks.notifications_sweep()
    assert not Outbox.objects.exists(), "processed rows are deleted after a day"


def test_the_sweep_sends_a_lost_message_again_once_not_at_every_sweep(submit, settings, tenant, owner, addresses):
    """A broker with a backlog: the row, the delivery and the mail wait well past LOST_AFTER, their messages
    still queued. The sweep sends each again once, then waits longer before the next (it used to send
    every one of them again at every sweep, adding to the backlog each time)."""
    services.webhook_create(actor=owner, tenant=tenant, url="http://127.0.0.1:9/h", events=["job_failed"])
    job = _end(submit(), "failed")  # an outbox row, its message unprocessed
    services.events_of("jobs", [job.id])  # its event and delivery recorded, neither mailed nor tried yet
    long_ago = timezone.now() - timedelta(minutes=1)
    Outbox.objects.update(created_at=long_ago)
    Event.objects.update(created_at=long_ago)
    Delivery.objects.update(next_try_at=long_ago)
    assert tasks.notifications_sweep() == 3
    assert tasks.notifications_sweep() == 0, "sent again already: not at every sweep"
    # Past the wait the sweep set, they are sent again (once more).
    for model in (Outbox, Event, Delivery):
        model.objects.update(sweep_after=long_ago)
    assert tasks.notifications_sweep() == 3
    assert tasks.notifications_sweep() == 0


# --- Mail: a timeout, and tried again ---------------------------------------------------------------


def test_smtp_has_a_timeout():
    assert get_connection("django.core.mail.backends.smtp.EmailBackend").timeout == 10


def test_mail_that_failed_is_tried_again_a_bounded_number_of_times(submit, settings, tenant, teammate, addresses):
    with RawServer(b"") as closed:
        port = int(closed.url.split(":")[2].split("/")[0])
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", port  # nothing listens there now
    Preference.objects.create(user=teammate, tenant=tenant, event=EventKind.JOB_FAILED, email=True)
    tasks.notifications_event("jobs", [_end(submit(), "failed").id])
    event = Event.objects.get()
    assert (event.email_attempts, event.emailed_at) == (1, None)
    assert "ConnectionRefused" in event.email_error

    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    assert tasks.notifications_event("event", event.id) == {"events": 1}
    event.refresh_from_db()
    assert event.emailed_at is not None and len(mail.outbox) == 3
    assert tasks.notifications_event("event", event.id) == {"events": 1} and len(mail.outbox) == 3, "mailed once"


def test_mail_is_given_up_after_its_last_attempt(submit, settings, tenant, addresses):
    with RawServer(b"") as closed:
        port = int(closed.url.split(":")[2].split("/")[0])
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", port
    tasks.notifications_event("jobs", [_end(submit(), "failed").id])
    event = Event.objects.get()
    for _ in range(services.MAIL_MAX_ATTEMPTS + 2):
        tasks.notifications_event("event", event.id)
    event.refresh_from_db()
    assert event.email_attempts == services.MAIL_MAX_ATTEMPTS and event.emailed_at is not None
    assert event.email_error


# --- Signed with a timestamp; absolute links ----------------------------------------------------------


def test_a_delivery_is_signed_with_its_timestamp(submit, tenant, owner):
    with HookReceiver() as hook:
        delivery = _failed_delivery(submit, owner, tenant, hook.url)
        assert tasks.notifications_deliver(delivery.id) == "delivered"
    [received] = hook.received
    timestamp = int(received.headers["X-Portal-Timestamp"])
    assert abs(time.time() - timestamp) < 60
    assert received.headers["X-Portal-Signature"] == services.signature(delivery.webhook.secret, received.body,
                                                                         timestamp)
    assert signed_by(delivery.webhook.secret, received)
    replayed = type(received)(received.at, {**received.headers, "X-Portal-Timestamp": str(timestamp - 3600)},
                              received.body, received.answered)
    assert not signed_by(delivery.webhook.secret, replayed), "an old timestamp does not verify"


def test_links_are_absolute_when_the_public_url_is_set(submit, settings):
    settings.PORTAL_PUBLIC_URL = "https://portal.example.com/"
    job = _end(submit(), "failed")
    tasks.notifications_event("jobs", [job.id])
    assert Event.objects.get().payload["link"] == f"https://portal.example.com/jobs/{job.id}/"


def test_a_message_whose_worker_was_lost_goes_back_to_the_queue():
    for task in (tasks.notifications_event, tasks.notifications_deliver):
        assert task.acks_late and task.reject_on_worker_lost, task.name
