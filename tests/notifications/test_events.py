"""Events recorded from what the jobs, environments and quotas apps announce, mailed by each member's choice.

Jobs are moved through the jobs app's own services (submit, the cycle, an attempt's end, a preemption);
the worker's task is called here as a worker would call it, and mail lands in Django's locmem outbox.
"""

import json

import pytest
from django.core import mail
from django.db import transaction

from runners.environments import services as environments
from runners.environments.signals import environment_failed
from runners.jobs import attempts
from runners.jobs import services as jobs
from runners.jobs.models import Job
from runners.notifications import services, tasks
from runners.notifications.models import Delivery, DeliveryState, Event, EventKind, Preference, Webhook
from runners.scheduling import services as scheduling
from tests.notifications.hooks import HookReceiver, signed_by
from tests.support.backends import use_backend
from tests.support.jobs import give_quota, job_data

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def addresses(owner, teammate, viewer, outsider):
    for user in (owner, teammate, viewer, outsider):
        user.email = f"{user.username}@example.test"
        user.save()
    return {user.username: user.email for user in (owner, teammate, viewer, outsider)}


@pytest.fixture
def submit(settings, acme_env, flavors, tenant, owner):
    use_backend(settings, "quick_jobs")  # the local backend with timers for trainers
    settings.NOTIFY_WEBHOOK_ALLOW_PRIVATE = True  # the test receivers are on loopback
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)

    def make(name="train-1") -> Job:
        job = jobs.job_submit(actor=owner, data=job_data(acme_env, name=name, replicas=1, topology={"level": "none"},
                                                        max_retries=0))
        scheduling.cycle_run()
        job.refresh_from_db()
        assert job.state == "admitted", job.reason
        return job

    return make


def _end(job: Job, outcome: str, reason: str = "") -> Job:
    """Launch the job's attempt and end it as the reconcile would on the backend's word."""
    attempt = job.attempts.get(ended_at__isnull=True)
    attempts.job_launch_run(job_id=job.id, attempt_number=attempt.number)
    job.refresh_from_db()
    assert job.state == "running", job.reason
    assert attempts.attempt_end(job.id, attempt.id, outcome=outcome, reason=reason or f"Replica 0 {outcome}.")
    job.refresh_from_db()
    return job


def _preempt(job: Job) -> None:
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(id=job.id)
        assert attempts.job_preempt_locked(locked, "Reclaimed for globex's guarantee.") == "requeued"


def test_a_finished_job_is_one_event_mailed_only_to_members_who_chose_it(submit, tenant, teammate, addresses):
    Preference.objects.create(user=teammate, tenant=tenant, event=EventKind.JOB_FINISHED, email=True)
    job = _end(submit(), "succeeded")
    assert job.state == "succeeded"

    assert tasks.notifications_event("jobs", [job.id]) == {"events": 1}
    event = Event.objects.get()
    assert event.kind == "job_finished" and event.key == f"job:{job.id}:succeeded"
    assert event.payload == {
        "event": "job_finished", "tenant": "acme", "link": f"/jobs/{job.id}/",
        "occurred_at": job.finished_at.isoformat(),
        "object": {"type": "job", "id": job.id, "name": "train-1", "state": "succeeded", "reason": job.reason},
    }
    # Finishes are off by default: only tom, who turned them on, is mailed; each gets a mail of their own.
    assert [message.to for message in mail.outbox] == [[addresses["tom"]]]
    assert "train-1" in mail.outbox[0].subject and f"/jobs/{job.id}/" in mail.outbox[0].body

    # The same message again (redelivered), or another attempt's end read later: nothing new is sent.
    tasks.notifications_event("jobs", [job.id])
    assert Event.objects.count() == 1 and len(mail.outbox) == 1


def test_a_failed_job_mails_every_member_by_default_but_one_who_opted_out(submit, tenant, owner, addresses):
    Preference.objects.create(user=owner, tenant=tenant, event=EventKind.JOB_FAILED, email=False)
    job = _end(submit(), "failed", "Replica 0 exited with 1.")
    assert job.state == "failed"
    tasks.notifications_event("jobs", [job.id])
    event = Event.objects.get()
    assert event.kind == "job_failed" and event.payload["object"]["state"] == "failed"
    assert "exited with 1" in event.payload["object"]["reason"]
    # vera (a viewer) and tom keep the default; olivia opted out; oscar is another tenant's.
    assert sorted(message.to[0] for message in mail.outbox) == [addresses["tom"], addresses["vera"]]


def test_each_preempted_attempt_is_its_own_event_and_a_cancel_is_none(submit, addresses):
    job = submit()
    _preempt(job)
    tasks.notifications_event("jobs", [job.id])
    scheduling.cycle_run()
    job.refresh_from_db()
    assert job.state == "admitted"
    _preempt(job)
    tasks.notifications_event("jobs", [job.id])
    tasks.notifications_event("jobs", [job.id])

    events = list(Event.objects.order_by("id"))
    first, second = job.attempts.order_by("number")
    assert [event.key for event in events] == [f"attempt:{first.id}:preempted", f"attempt:{second.id}:preempted"]
    assert [event.payload["object"]["attempt"] for event in events] == [1, 2]
    assert all(event.payload["object"]["reason"] == "Reclaimed for globex's guarantee." for event in events)
    assert len(mail.outbox) == 2 * 3  # preemptions are on by default for olivia, tom and vera

    cancelled = submit("train-2")
    jobs.job_cancel(actor=cancelled.tenant.memberships.get(role="owner").user, job=cancelled)
    tasks.notifications_event("jobs", [cancelled.id])
    assert Event.objects.count() == 2


def test_an_environment_that_fails_for_good_sends_the_signal_and_is_one_event(settings, tenant, owner, addresses):
    use_backend(settings, "refusing_for_good")
    environment = environments.environment_request(actor=owner, tenant=tenant, name="broken")
    sent = []
    environment_failed.connect(lambda sender, **kwargs: sent.append(kwargs["environment_id"]), weak=False,
                               dispatch_uid="test-environment-failed")
    try:
        assert environments.environment_provision_run(environment_id=environment.id) == "failed"
        assert environments.environment_provision_run(environment_id=environment.id) == "failed"
        environments.environment_provision_give_up(environment_id=environment.id, reason="again")
    finally:
        environment_failed.disconnect(dispatch_uid="test-environment-failed")
    assert sent == [environment.id], "sent once, when the state became failed"

    tasks.notifications_event("environment", environment.id)
    tasks.notifications_event("environment", environment.id)
    event = Event.objects.get()
    assert event.kind == "environment_failed" and event.payload["link"] == f"/environments/{environment.id}/"
    assert "admission webhook denied" in event.payload["object"]["reason"]
    assert sorted(message.to[0] for message in mail.outbox) == sorted(
        [addresses["olivia"], addresses["tom"], addresses["vera"]]
    )


def test_a_quota_change_is_an_event_when_members_chose_it(tenant, flavors, staff, teammate, addresses,
                                                           django_capture_on_commit_callbacks):
    from quotas.services import quota_set

    Preference.objects.create(user=teammate, tenant=tenant, event=EventKind.QUOTA_CHANGED, email=True)
    with django_capture_on_commit_callbacks() as callbacks:
        quota_set(actor=staff, tenant=tenant, flavor=flavors["h100-80gb"], guaranteed=4, max=8)
    assert callbacks, "the receiver enqueues after commit"
    assert not Event.objects.exists(), "nothing is recorded inside the change's transaction"

    services.quota_event(tenant.id, "change-1", "2026-12-04T10:00:00+00:00")
    event = services.quota_event(tenant.id, "change-1", "2026-12-04T10:00:00+00:00")
    services.event_send(event)
    assert Event.objects.count() == 1
    assert event.payload["object"]["quotas"] == [{"flavor": "h100-80gb", "guaranteed": 4, "max": 8}]
    assert event.payload["link"] == "/tenants/acme/quota/"
    assert [message.to for message in mail.outbox] == [[addresses["tom"]]]


def test_only_the_tenants_subscribed_webhooks_get_a_delivery_signed_with_their_secret(
    submit, tenant, other_tenant, owner, outsider
):
    with HookReceiver() as hook:
        wanted = services.webhook_create(actor=owner, tenant=tenant, url=hook.url, events=["job_failed"])
        services.webhook_create(actor=owner, tenant=tenant, url=hook.url, events=["job_finished"])
        services.webhook_create(actor=outsider, tenant=other_tenant, url=hook.url, events=["job_failed"])
        job = _end(submit(), "failed")
        tasks.notifications_event("jobs", [job.id])
        delivery = Delivery.objects.get()
        assert delivery.webhook == wanted and delivery.state == DeliveryState.PENDING
        assert tasks.notifications_deliver(delivery.id) == "delivered"
        assert tasks.notifications_deliver(delivery.id) == "delivered", "a second message sends nothing"

    [received] = hook.received
    assert signed_by(wanted.secret, received)
    assert not signed_by(Webhook.objects.get(tenant=other_tenant).secret, received)
    assert received.headers["X-Portal-Event"] == "job_failed"
    assert received.headers["X-Portal-Delivery"] == str(delivery.id)
    assert received.headers["Content-Type"] == "application/json"
    assert json.loads(received.body) == delivery.payload
    delivery.refresh_from_db()
    assert (delivery.attempts, delivery.status_code, delivery.error) == (1, 204, "")
    assert delivery.delivered_at is not None


def test_a_failed_try_is_recorded_and_waits_for_its_backoff(submit, tenant, owner, settings):
    settings.NOTIFY_WEBHOOK_BACKOFF_S = 60
    settings.NOTIFY_WEBHOOK_MAX_ATTEMPTS = 2
    with HookReceiver(fail_first=5, fail_status=503) as hook:
        services.webhook_create(actor=owner, tenant=tenant, url=hook.url, events=["job_failed"])
        tasks.notifications_event("jobs", [_end(submit(), "failed").id])
        delivery = Delivery.objects.get()
        assert tasks.notifications_deliver(delivery.id) == "pending"
        delivery.refresh_from_db()
        assert (delivery.attempts, delivery.status_code, delivery.error) == (1, 503, "Answered 503.")
        wait = (delivery.next_try_at - delivery.created_at).total_seconds()
        assert 59 < wait < 70, "the first retry waits NOTIFY_WEBHOOK_BACKOFF_S"
        assert tasks.notifications_deliver(delivery.id) == "pending", "not due yet: nothing sent"
        assert len(hook.received) == 1
        # Due now (as the countdown message would find it): the last attempt fails for good.
        Delivery.objects.filter(id=delivery.id).update(next_try_at=delivery.created_at)
        assert tasks.notifications_deliver(delivery.id) == "failed"
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts, delivery.next_try_at) == ("failed", 2, None)
    assert services.backoff_s(1) == 60 and services.backoff_s(3) == 240


def test_an_unreachable_url_is_an_error_on_the_delivery(submit, tenant, owner):
    with HookReceiver() as hook:
        url = hook.url  # closed when the block ends: nothing listens there afterwards
    services.webhook_create(actor=owner, tenant=tenant, url=url, events=["job_failed"])
    tasks.notifications_event("jobs", [_end(submit(), "failed").id])
    delivery = Delivery.objects.get()
    assert tasks.notifications_deliver(delivery.id) == "pending"
    delivery.refresh_from_db()
    assert delivery.status_code is None and "Connection refused" in delivery.error


def test_the_signature_is_the_hmac_of_the_timestamp_and_the_exact_body():
    body = services.body_bytes({"b": 1, "a": "é"})
    assert body == b'{"a":"\\u00e9","b":1}'
    assert services.signature("k", body, 1700000000) == "sha256=" + __import__("hmac").new(
        b"k", b"1700000000." + body, "sha256").hexdigest()
    assert services.signature("k", body, 1700000000) != services.signature("other", body, 1700000000)
    assert services.signature("k", body, 1700000000) != services.signature("k", body, 1700000001), "replays differ"


def test_a_webhook_needs_an_owner_an_http_url_and_known_events(tenant, owner, teammate):
    from common.errors import Invalid, NotAllowed

    with pytest.raises(NotAllowed):
        services.webhook_create(actor=teammate, tenant=tenant, url="https://example.test/h", events=["job_failed"])
    for url in ("ftp://example.test/h", "javascript:alert(1)", "not a url", "https://" + "a" * 500 + ".test/"):
        with pytest.raises(Invalid) as refused:
            services.webhook_create(actor=owner, tenant=tenant, url=url, events=["job_failed"])
        assert "url" in refused.value.message_dict
    for events in ([], ["job_exploded"], "job_failed"):
        with pytest.raises(Invalid) as refused:
            services.webhook_create(actor=owner, tenant=tenant, url="https://example.test/h", events=events)
        assert "events" in refused.value.message_dict
    webhook = services.webhook_create(actor=owner, tenant=tenant, url=" https://example.test/h ",
                                      events=["quota_changed", "job_failed", "job_failed"])
    assert webhook.url == "https://example.test/h" and webhook.events == ["job_failed", "quota_changed"]
    assert len(webhook.secret) == 64
