"""In Chromium: a replica picked from the running attempt is followed into the next attempt after a
requeue, and the Download link follows with it."""

from datetime import timedelta

import pytest
from django.utils import timezone

from runners.clusters.registry import get_backend
from runners.jobs import services as jobs
from runners.jobs.models import Job, JobAttempt
from runners.scheduling import services as scheduling
from tests.frontend.conftest import LIVE_TIMEOUT_MS, assert_not_reloaded, log_in, mark_loaded
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _write_log(job, attempt, rank, lines):
    folder = get_backend().jobs.attempt_dir(job.id, attempt)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank-{rank}.log").write_text("".join(f"{line}\n" for line in lines))


def test_following_a_picked_replica_moves_to_the_next_attempt_and_its_download(page, live_server, tenant, owner):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    environment = ready_environment(actor=owner, tenant=tenant)
    job = jobs.job_submit(actor=owner, data=job_data(environment, name="llm", replicas=2))
    scheduling.cycle_run()
    first = job.attempts.get()
    JobAttempt.objects.filter(id=first.id).update(started_at=timezone.now() - timedelta(minutes=1))
    Job.objects.filter(id=job.id).update(state="running")
    for rank in (0, 1):
        _write_log(job, 1, rank, [f"a1 r{rank} starting"])

    log_in(page, live_server, owner.username)
    page.goto(f"{live_server.url}/jobs/{job.id}/")
    page.get_by_test_id("log-picker").get_by_role("link", name="replica 1").click()
    expect(page.get_by_test_id("job-log")).to_have_text("a1 r1 starting\n")
    expect(page.get_by_test_id("log-follow")).to_be_checked()
    mark_loaded(page)

    # Requeued: attempt 1 ends, attempt 2 runs on.
    JobAttempt.objects.filter(id=first.id).update(ended_at=timezone.now(), outcome="preempted")
    JobAttempt.objects.create(job=job, number=2, placement=first.placement, started_at=timezone.now())
    _write_log(job, 2, 1, ["a2 r1 starting"])

    card = page.get_by_test_id("job-log-card")
    expect(page.get_by_test_id("job-log")).to_have_text("a2 r1 starting\n", timeout=LIVE_TIMEOUT_MS)
    expect(card.locator("[data-log-label]")).to_have_text("attempt 2, replica 1")
    expect(page.get_by_test_id("log-download")).to_have_attribute(
        "href", f"/jobs/{job.id}/log/download/?attempt=2&rank=1")
    assert_not_reloaded(page)
