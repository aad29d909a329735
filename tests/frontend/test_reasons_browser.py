"""In Chromium: a job's reasons read as sentences (the attempts' "Why" column has room, not one word per
line) and the time beside a waiting job's reason is local time with how far off it is."""

import pytest

from runners.jobs import attempts
from runners.jobs import services as jobs
from runners.scheduling import services as scheduling
from tests.frontend.conftest import log_in, snap
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, play_launch, ready_environment

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]




def test_a_preempted_jobs_page_shows_its_reasons_as_sentences_and_its_start_in_local_time(
    page, live_server, tenant, other_tenant, owner, outsider, screenshot_dir
):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=0, max=16)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    acme_env = ready_environment(actor=owner, tenant=tenant)
    globex_env = ready_environment(actor=outsider, tenant=other_tenant, name="vision")
    borrower = jobs.job_submit(actor=owner, data=job_data(acme_env, name="borrower", replicas=2, gpus_per_replica=8,
                                                          topology={"level": "none", "mode": "preferred"}))
    scheduling.cycle_run()
    attempt = play_launch(borrower)
    owed = jobs.job_submit(actor=outsider,
                           data=job_data(globex_env, name="train-resnet", replicas=1, gpus_per_replica=8))
    scheduling.cycle_run()
    borrower.refresh_from_db()
    assert attempts.attempt_end(borrower.id, attempt.id, outcome="preempted", reason=borrower.reason)
    scheduling.cycle_run()  # the owed job starts; the borrower waits for idle GPUs, reserved
    borrower.refresh_from_db()
    assert borrower.state == "queued" and borrower.projected_start is not None

    log_in(page, live_server, "olivia")
    page.goto(f"{live_server.url}/jobs/{borrower.id}/")
    when = page.get_by_test_id("reason-when")
    expect(when).to_contain_text("Expected to start in about ")
    expect(when).to_contain_text(" UTC.")
    # The attempt's reason names the other tenant's job, as text the reader cannot follow anywhere.
    why = page.get_by_test_id("attempts").locator("td.reason-cell").first
    expect(why).to_contain_text("Preempted for job train-resnet of tenant globex")
    assert why.locator("a").count() == 0
    assert page.locator(f'a[href$="/jobs/{owed.id}/"]').count() == 0
    snap(page, screenshot_dir / "job-reasons.png")
    # Room for the sentence: at least 15rem wide, so a line holds several words.
    box = why.bounding_box()
    assert box["width"] >= 15 * 16 * 0.95, box
    line_height = float(why.evaluate("cell => parseFloat(getComputedStyle(cell).lineHeight) || 20"))
    words = len(why.inner_text().split())
    assert box["height"] / line_height < words / 3, (box, line_height, words)
    # On a phone the column keeps its room too, and the table scrolls sideways instead.
    page.set_viewport_size({"width": 400, "height": 900})
    page.reload()
    box = page.get_by_test_id("attempts").locator("td.reason-cell").first.bounding_box()
    assert box["width"] >= 15 * 16 * 0.95, box
    # The table scrolls inside its card; the page itself does not get wider than the phone.
    assert page.evaluate("document.documentElement.scrollWidth") <= 400
    snap(page, screenshot_dir / "job-reasons-phone.png")
