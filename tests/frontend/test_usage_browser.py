"""The usage pages in Chromium: the usage page and a job page draw their SVG charts with data, and an idle job stops from the usage page."""

import pytest

from tests.frontend.conftest import log_in, snap
from tests.frontend.test_usage_pages import RANGE, idle_job, scenario  # noqa: F401 (fixtures)

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _drawn(chart) -> int:
    """How many data points the chart says it holds, after checking it is on screen."""
    expect(chart).to_be_visible()
    return int(chart.get_attribute("data-points"))


def test_the_usage_page_draws_utilization_and_daily_cost_charts(page, live_server, scenario, tenant,  # noqa: F811
                                                                  screenshot_dir):
    log_in(page, live_server, "olivia")
    page.goto(f"{live_server.url}/tenants/acme/")
    page.get_by_role("link", name="Usage", exact=True).click()
    expect(page.get_by_role("heading", name="Usage")).to_be_visible()
    # The range form takes November, where the scenario ran.
    form = page.get_by_test_id("usage-range")
    form.get_by_label("Start").fill("2026-11-01")
    form.get_by_label("End").fill("2026-11-30")
    form.get_by_role("button", name="Show").click()
    expect(page).to_have_url(f"{live_server.url}/tenants/acme/usage/{RANGE}&threshold_pct=10.0&window_min=30.0")

    utilization = page.get_by_test_id("utilization-chart")
    assert _drawn(utilization) > 0
    assert utilization.locator("polyline").count() == 1
    assert utilization.get_attribute("role") == "img" and "GPU utilization" in utilization.get_attribute("aria-label")
    for testid in ("hours-chart", "cost-chart"):
        chart = page.get_by_test_id(testid)
        assert _drawn(chart) > 0 and chart.locator("rect").count() > 0
        box = chart.locator("rect").first.bounding_box()
        assert box and box["height"] > 1  # a bar, drawn
    expect(page.get_by_test_id("top-items")).to_contain_text("pretrain")
    expect(page.get_by_test_id("download-csv")).to_be_visible()
    snap(page, screenshot_dir / "usage-page.png")


def test_the_job_page_draws_each_replicas_gpu_utilization(page, live_server, scenario, tenant,  # noqa: F811
                                                         screenshot_dir):
    job = scenario["pretrain"]
    log_in(page, live_server, "olivia")
    page.goto(f"{live_server.url}/jobs/{job.id}/")
    utilization = page.get_by_test_id("gpu-utilization-chart")
    assert _drawn(utilization) > 0
    assert utilization.locator("polyline").count() == 2  # one line per replica
    assert _drawn(page.get_by_test_id("gpu-memory-chart")) > 0
    expect(page.get_by_test_id("job-cost").get_by_test_id("cost")).to_have_text("USD 24.00")
    snap(page, screenshot_dir / "job-usage.png")


def test_the_idle_stop_button_asks_then_cancels_and_comes_back(page, live_server, idle_job,  # noqa: F811
                                                              screenshot_dir):
    log_in(page, live_server, "olivia")
    page.goto(f"{live_server.url}/tenants/acme/usage/")
    row = page.get_by_test_id("idle-allocations").locator(f'tr[data-job="{idle_job.id}"]')
    expect(row).to_contain_text("forgotten")
    snap(page, screenshot_dir / "usage-idle.png")
    page.once("dialog", lambda dialog: dialog.accept())
    row.get_by_role("button", name="Stop forgotten").click()
    expect(page.get_by_role("status")).to_contain_text("Cancelling forgotten.")
    expect(page).to_have_url(f"{live_server.url}/tenants/acme/usage/")
    idle_job.refresh_from_db()
    assert idle_job.state == "cancelling"
