"""A tenant submits a training job in Chromium and watches it run live, with a real worker and real processes."""

import pytest

from runners.jobs.models import Job
from tests.frontend.conftest import assert_not_reloaded, log_in, mark_loaded, snap
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

RUN_TIMEOUT_MS = 90_000


def test_the_submit_form_starts_a_job_whose_page_shows_it_running_with_a_growing_loss_chart(
    page, live_server, celery_worker_factory, tenant, owner, screenshot_dir
):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    ready_environment(actor=owner, tenant=tenant)
    celery_worker_factory(beat=True, SCHEDULER_CYCLE_INTERVAL_S=1, JOB_RECONCILE_INTERVAL_S=1)

    log_in(page, live_server, "olivia")
    page.get_by_test_id("tenants").get_by_role("link", name="Acme ML").click()
    page.get_by_role("link", name="Jobs", exact=True).click()
    expect(page.get_by_test_id("quota-left").locator('tr[data-flavor="h100-80gb"] [data-testid="left"]')).to_have_text("16")
    form = page.get_by_test_id("submit-job")
    # Only flavors the tenant has quota for are offered.
    assert form.get_by_label("Flavor").locator("option").all_text_contents() == [
        "h100-80gb: 16 of 16 left (0 in use, 8 guaranteed)"
    ]
    form.get_by_label("Name", exact=True).fill("llm-pretrain")
    form.get_by_label("Replicas", exact=True).fill("2")
    form.get_by_label("GPUs per replica").fill("2")
    form.get_by_label("Keep replicas together").select_option("node")
    form.get_by_label("Topology is").select_option("required")
    form.get_by_label("Steps", exact=True).fill("400")
    form.get_by_label("Checkpoint every (steps)").fill("25")
    # One CPU a replica (one torch thread each): the trainers run, busy, until the test cancels them.
    form.get_by_text("Resources and limits").click()
    form.get_by_label("CPU per replica (millicores)").fill("1000")
    snap(page, screenshot_dir / "job-submit.png")
    form.get_by_role("button", name="Submit job").click()

    live = page.get_by_test_id("job-live")
    expect(page.get_by_role("heading", name="llm-pretrain")).to_be_visible()
    mark_loaded(page)
    expect(live.get_by_test_id("job-state")).to_have_text("running", timeout=RUN_TIMEOUT_MS)
    chart = live.get_by_test_id("loss-chart")
    expect(chart).to_be_visible(timeout=RUN_TIMEOUT_MS)
    first_points = int(chart.get_attribute("data-points"))
    # The chart grows while it trains, without a reload.
    page.wait_for_function(
        "n => { const c = document.querySelector('[data-testid=loss-chart]'); return c && +c.dataset.points > n; }",
        arg=first_points, timeout=RUN_TIMEOUT_MS,
    )
    assert_not_reloaded(page)
    job = Job.objects.get(name="llm-pretrain")
    assert job.spec["cpu_milli_per_replica"] == 1000
    nodes = {replica["node"] for replica in job.attempts.get().placement}
    assert len(nodes) == 1
    placed = live.locator(f'[data-node="{nodes.pop()}"] .gpu-slot.taken')
    expect(placed).to_have_count(4)
    expect(live.get_by_test_id("checkpoints")).to_be_visible(timeout=RUN_TIMEOUT_MS)
    expect(live.get_by_test_id("job-log")).to_contain_text("step")
    snap(page, screenshot_dir / "job-running.png")

    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_test_id("cancel-job").get_by_role("button", name="Cancel job").click()
    expect(page.get_by_test_id("job-live").get_by_test_id("job-state")).to_have_text("cancelled", timeout=RUN_TIMEOUT_MS)
    snap(page, screenshot_dir / "job-cancelled.png")
