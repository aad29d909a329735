"""In Chromium, with a real worker and real trainer processes: a job's log follows its newest line, and a
cancelled job is cloned from its page and submitted again."""

import re

import pytest

from runners.jobs import services as jobs
from runners.jobs.models import Job
from tests.frontend.conftest import assert_not_reloaded, log_in, mark_loaded, snap
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

RUN_TIMEOUT_MS = 90_000
AT_BOTTOM = "el => el.scrollHeight > el.clientHeight && el.scrollTop + el.clientHeight >= el.scrollHeight - 2"
STEP = re.compile(r"step (\d+)/")


def _steps(text: str) -> list[int]:
    return [int(found) for found in STEP.findall(text)]


def test_a_cancelled_job_is_cloned_from_its_page_and_its_log_ends_with_the_newest_line(
    page, live_server, celery_worker_factory, tenant, owner, screenshot_dir
):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    environment = ready_environment(actor=owner, tenant=tenant)
    celery_worker_factory(beat=True, SCHEDULER_CYCLE_INTERVAL_S=1, JOB_RECONCILE_INTERVAL_S=1)
    # One CPU (one torch thread): the trainer runs, busy, until the test cancels it, so a second thread
    # would only burn a second core while the page is read.
    job = jobs.job_submit(actor=owner, data=job_data(
        environment, name="sweep", replicas=1, steps=5000, checkpoint_every_steps=100, max_runtime_s=900,
        topology={"level": "none"}, cpu_milli_per_replica=1000))

    log_in(page, live_server, "olivia")
    page.goto(f"{live_server.url}/jobs/{job.id}/")
    mark_loaded(page)
    log = page.get_by_test_id("job-log")
    expect(page.get_by_test_id("log-follow")).to_be_checked()
    # Following: more lines come in without a reload, and the log stays at its newest one.
    page.wait_for_function(
        "() => { const el = document.querySelector('[data-testid=job-log]');"
        " return el.scrollHeight > el.clientHeight + 40 && /step \\d+\\//.test(el.textContent); }",
        timeout=RUN_TIMEOUT_MS,
    )
    assert log.evaluate(AT_BOTTOM)
    steps = _steps(log.text_content())
    assert steps == sorted(steps) and "PORTAL_METRIC" not in log.text_content()
    assert_not_reloaded(page)
    expect(log).to_have_attribute("tabindex", "0")
    snap(page, screenshot_dir / "job-log-following.png")

    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_test_id("cancel-job").get_by_role("button", name="Cancel job").click()
    expect(page.get_by_test_id("job-live").get_by_test_id("job-state")).to_have_text("cancelled", timeout=RUN_TIMEOUT_MS)

    # Loaded afresh once it is over: nothing to follow, and the log opens at its last line.
    page.reload()
    expect(page.get_by_test_id("log-follow")).to_have_count(0)
    log = page.get_by_test_id("job-log")
    assert log.evaluate(AT_BOTTOM)
    last = log.text_content().strip().splitlines()[-1]
    assert "stopping" in last or "exiting" in last or _steps(last), last
    expect(page.get_by_test_id("ran-for")).to_contain_text("Ran for")

    page.get_by_test_id("clone-job").click()
    form = page.get_by_test_id("submit-job")
    expect(page.get_by_test_id("clone-source")).to_contain_text("sweep")
    expect(form.get_by_label("Name", exact=True)).to_have_value("sweep-2")
    expect(form.get_by_label("Steps", exact=True)).to_have_value("5000")
    expect(form.get_by_label("Keep replicas together")).to_have_value("none")
    snap(page, screenshot_dir / "job-clone.png")
    form.get_by_role("button", name="Submit job").click()

    expect(page.get_by_role("heading", name="sweep-2")).to_be_visible()
    clone = Job.objects.get(name="sweep-2")
    assert page.url.endswith(f"/jobs/{clone.id}/")
    assert (clone.replicas, clone.spec["steps"], clone.spec["checkpoint_every_steps"]) == (1, 5000, 100)
    assert clone.spec["cpu_milli_per_replica"] == 1000
    assert clone.environment_id == environment.id and Job.objects.get(id=job.id).state == "cancelled"
