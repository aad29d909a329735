"""Staff watch the cockpit's and the queue's figures follow the scheduler cycle in Chromium, without a reload."""

import pytest

from runners.jobs import services as jobs
from runners.scheduling import services as scheduling
from tests.frontend.conftest import assert_not_reloaded, log_in, mark_loaded, snap
from tests.support.jobs import give_quota, job_data, play_launch

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

LIVE_MS = 15_000


def test_staff_watch_a_job_admitted_then_preempted_on_the_cockpit_and_the_queue(
    page, live_server, flavors, tenant, other_tenant, owner, outsider, acme_env, globex_env, staff, screenshot_dir
):
    h100 = flavors["h100-80gb"]
    give_quota(tenant, h100, guaranteed=0, max=16)
    give_quota(other_tenant, h100, guaranteed=8, max=8)
    borrower = jobs.job_submit(actor=owner, data=job_data(
        acme_env, name="borrower", replicas=2, gpus_per_replica=8, topology={"level": "none", "mode": "preferred"}
    ))

    log_in(page, live_server, "sam")
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Cockpit").click()
    flavor_row = page.locator(f'[data-testid=cockpit-flavors] tr[data-flavor="{h100.name}"]')
    acme_row = page.locator(f'[data-testid=cockpit-tenants] tr[data-tenant="acme"][data-flavor="{h100.name}"]')
    h100_pool = page.locator('[data-pool="h100-pool"]')
    expect(page.get_by_test_id("queue-length")).to_have_text("1")
    expect(flavor_row.get_by_test_id("allocated")).to_have_text("0")
    expect(h100_pool.locator('[data-testid=cockpit-gpu][data-busy="true"]')).to_have_count(0)
    mark_loaded(page)

    # The cycle admits the borrower (acme has no guarantee: all 16 units are borrowed), and it runs.
    scheduling.cycle_run()
    play_launch(borrower)
    expect(flavor_row.get_by_test_id("allocated")).to_have_text("16", timeout=LIVE_MS)
    expect(flavor_row.get_by_test_id("free")).to_have_text("0")
    expect(page.get_by_test_id("queue-length")).to_have_text("0")
    expect(acme_row.get_by_test_id("borrowed")).to_have_text("16")
    expect(h100_pool.locator('[data-testid=cockpit-gpu][data-busy="true"]')).to_have_count(16)
    expect(h100_pool.locator(f'a[data-job="{borrower.id}"]').first).to_have_text("acme/borrower")
    assert_not_reloaded(page)
    snap(page, screenshot_dir / "cockpit-admitted.png")

    page.get_by_role("navigation", name="Main").get_by_role("link", name="Queue").click()
    borrower_row = page.locator(f'[data-testid=queue] tr[data-job="{borrower.id}"]')
    expect(borrower_row.get_by_test_id("job-state")).to_have_text("running")
    expect(borrower_row.get_by_test_id("borrowing")).to_have_text("borrowing 16")
    mark_loaded(page)

    # globex claims its guarantee: the next cycle preempts the borrower, and globex's job waits first in line.
    owed = jobs.job_submit(actor=outsider, data=job_data(globex_env, name="owed", replicas=1, gpus_per_replica=8,
                                                         priority=50))
    scheduling.cycle_run()
    expect(borrower_row.get_by_test_id("job-state")).to_have_text("preempted", timeout=LIVE_MS)
    expect(borrower_row.get_by_test_id("reason")).to_contain_text("Preempted for job")
    owed_row = page.locator(f'[data-testid=queue] tr[data-job="{owed.id}"]')
    expect(owed_row.get_by_test_id("place")).to_have_text("1")
    expect(owed_row.get_by_test_id("job-state")).to_have_text("queued")
    assert_not_reloaded(page)
    snap(page, screenshot_dir / "queue-preempted.png")

    page.get_by_role("navigation", name="Main").get_by_role("link", name="Cockpit").click()
    globex_row = page.locator(f'[data-testid=cockpit-tenants] tr[data-tenant="globex"][data-flavor="{h100.name}"]')
    expect(page.get_by_test_id("queue-length")).to_have_text("1")
    expect(globex_row.get_by_test_id("waiting")).to_contain_text("1")
    expect(flavor_row.get_by_test_id("queued-units")).to_have_text("8")
    # The preempted borrower still holds its GPUs until it has checkpointed and stopped.
    expect(h100_pool.locator(f'a[data-job="{borrower.id}"]').first).to_have_text("acme/borrower · preempted")
    expect(flavor_row.get_by_test_id("allocated")).to_have_text("16")
    snap(page, screenshot_dir / "cockpit-preempted.png")
