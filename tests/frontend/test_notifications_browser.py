"""An owner adds a webhook in Chromium, a job finishes on a real worker, and the receiver on loopback gets a
delivery signed with the secret the page showed once; the page's delivery log shows it delivered."""

import hashlib
import hmac
import json

import pytest

from runners.jobs import services as jobs
from runners.notifications.models import Preference
from tests.frontend.conftest import log_in, snap
from tests.notifications.hooks import HookReceiver, signed_by
from tests.support.backends import use_backend
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment
from tests.support.worker import wait_for

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def test_an_owner_adds_a_webhook_and_a_finished_job_is_delivered_signed_and_logged(
    page, live_server, settings, celery_worker_factory, tenant, owner, screenshot_dir
):
    use_backend(settings, "quick_jobs")  # the job's replica is a timer: it finishes in a moment
    settings.NOTIFY_WEBHOOK_ALLOW_PRIVATE = True  # the receiver is on loopback
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    environment = ready_environment(actor=owner, tenant=tenant)
    celery_worker_factory(beat=True, SCHEDULER_CYCLE_INTERVAL_S=1, JOB_RECONCILE_INTERVAL_S=1,
                          NOTIFY_WEBHOOK_ALLOW_PRIVATE=True)

    with HookReceiver() as hook:
        log_in(page, live_server, "olivia")
        page.get_by_test_id("tenants").get_by_role("link", name="Acme ML").click()
        page.get_by_role("link", name="Notifications", exact=True).click()
        expect(page.get_by_role("heading", name="Notifications", exact=True)).to_be_visible()

        # Her own mail: finishes are off by default; she turns them on.
        choices = page.get_by_test_id("email-choices")
        expect(choices.get_by_label("Job failed")).to_be_checked()
        expect(choices.get_by_label("Job finished")).not_to_be_checked()
        choices.get_by_label("Job finished").check()
        choices.get_by_role("button", name="Save mail choices").click()
        expect(page.get_by_text("Saved your mail choices.")).to_be_visible()
        assert Preference.objects.get(user=owner, event="job_finished").email is True

        form = page.get_by_test_id("new-webhook-form")
        form.get_by_label("URL").fill("ftp://example.test/hook")
        form.get_by_role("button", name="Add webhook").click()
        expect(page.get_by_test_id("new-webhook-form")).to_contain_text("http:// or https://")

        form = page.get_by_test_id("new-webhook-form")
        form.get_by_label("URL").fill(hook.url)
        form.get_by_label("Job finished").check()
        snap(page, screenshot_dir / "notifications-new-webhook.png")
        form.get_by_role("button", name="Add webhook").click()
        secret = page.get_by_test_id("webhook-secret").inner_text().strip()
        assert len(secret) == 64
        snap(page, screenshot_dir / "notifications-secret.png")

        job = jobs.job_submit(actor=owner, data=job_data(environment, name="short-run", replicas=1, steps=20,
                                                        topology={"level": "none"}))
        wait_for(hook.delivered, timeout_s=90, message="the webhook to receive the finished job")

    [received] = hook.received
    assert signed_by(secret, received), "signed (timestamp and body) with the secret the page showed"
    timestamp = received.headers["X-Portal-Timestamp"]
    assert received.headers["X-Portal-Signature"] == "sha256=" + hmac.new(
        secret.encode(), f"{timestamp}.".encode() + received.body, hashlib.sha256).hexdigest()
    assert received.headers["X-Portal-Event"] == "job_finished"
    body = json.loads(received.body)
    assert body["object"] | {"reason": ""} == {"type": "job", "id": job.id, "name": "short-run", "state": "succeeded",
                                               "reason": ""}
    assert body["link"] == f"/jobs/{job.id}/"

    page.goto(f"{live_server.url}/tenants/acme/notifications/")
    expect(page.get_by_test_id("webhook-secret")).to_have_count(0)  # shown once: not on a later load
    row = page.get_by_test_id("deliveries").locator(f'tr[data-delivery="{received.headers["X-Portal-Delivery"]}"]')
    expect(row.get_by_test_id("delivery-state")).to_have_text("delivered")
    expect(row.get_by_test_id("delivery-attempts")).to_have_text("1")
    expect(row).to_contain_text("Job finished")
    expect(row).to_contain_text("204")
    snap(page, screenshot_dir / "notifications-log.png")

    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_test_id("webhook").get_by_role("button", name=f"Delete the webhook to {hook.url}").click()
    expect(page.get_by_text("No webhooks yet.")).to_be_visible()
