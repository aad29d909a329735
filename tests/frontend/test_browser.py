"""The browser pages in a real Chromium, against a live server and a real Celery worker."""

import re

import pytest

from runners.environments.models import Environment, EnvironmentState
from tests.frontend.conftest import LIVE_TIMEOUT_MS, snap
from tests.frontend.conftest import assert_not_reloaded as _assert_not_reloaded
from tests.frontend.conftest import log_in as _log_in
from tests.frontend.conftest import mark_loaded as _mark_loaded

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

@pytest.fixture
def provisioning_worker(settings, celery_worker_factory):
    # Set before the worker starts: it reads the delay from the environment it is given,
    # and one second makes `provisioning` last long enough to be seen on the page.
    settings.LOCAL_PROVISION_DELAY_S = 1
    return celery_worker_factory()


def test_an_owner_creates_an_environment_sees_it_become_ready_live_and_deletes_it(
    page, live_server, owner, tenant, provisioning_worker, celery_worker_factory, screenshot_dir
):
    _log_in(page, live_server, "olivia", screenshot_dir)
    page.get_by_role("link", name="Acme ML").click()
    form = page.get_by_test_id("new-environment")
    form.get_by_label("Name").fill("Train_1")
    form.get_by_role("button", name="Create environment").click()
    expect(page.get_by_test_id("new-environment").locator("#id_name-errors")).to_contain_text("DNS-1123 label")
    snap(page, screenshot_dir / "tenant-form-error.png")

    form = page.get_by_test_id("new-environment")
    form.get_by_label("Name").fill("train")
    form.get_by_role("button", name="Create environment").click()

    expect(page).to_have_url(re.compile(r"/environments/\d+/$"))
    _mark_loaded(page)
    state = page.get_by_test_id("environment-status").get_by_test_id("state")
    assert state.inner_text() in ("requested", "provisioning"), "the page was rendered before the worker finished"
    expect(state).to_have_text("ready", timeout=LIVE_TIMEOUT_MS)
    _assert_not_reloaded(page)
    snap(page, screenshot_dir / "environment.png")

    environment = Environment.objects.get(tenant=tenant, name="train")
    page.locator(".crumbs").get_by_role("link", name="Acme ML").click()
    expect(page.locator(f"#environment-row-{environment.id}").get_by_test_id("state")).to_have_text("ready")
    snap(page, screenshot_dir / "tenant.png")
    page.get_by_role("navigation").get_by_role("link", name="Dashboard").click()
    expect(page.locator(f"#environment-row-{environment.id}")).to_be_visible()
    snap(page, screenshot_dir / "dashboard.png")

    page.locator(f"#environment-row-{environment.id}").get_by_role("link", name="train").click()
    page.get_by_role("link", name="Delete…").click()
    expect(page.get_by_role("heading", name="Delete train?")).to_be_visible()
    # Local teardown is instant; with no worker running, the row stays `deleting`
    # long enough to prove that it goes away live rather than on the next page load.
    provisioning_worker.stop()
    page.get_by_role("button", name="Delete environment").click()

    expect(page).to_have_url(f"{live_server.url}/tenants/acme/")
    expect(page.get_by_role("status")).to_contain_text("Deleting train")
    row = page.locator(f"#environment-row-{environment.id}")
    expect(row.get_by_test_id("state")).to_have_text("deleting")
    snap(page, screenshot_dir / "tenant-deleting.png")
    _mark_loaded(page)
    celery_worker_factory()
    expect(row).to_have_count(0, timeout=LIVE_TIMEOUT_MS)
    expect(page.get_by_text("No environments yet.")).to_be_visible()
    _assert_not_reloaded(page)
    environment.refresh_from_db()
    assert environment.state == EnvironmentState.DELETED


def test_dashboard_rows_follow_state_changes_live_for_a_viewer(page, live_server, owner, viewer, tenant):
    # Rows are made directly rather than through the service, so no task waits in the
    # queue for a worker this test does not start; the test plays the worker's part.
    environment = Environment.objects.create(
        tenant=tenant, name="serve", namespace="acme-serve", backend="local", created_by=owner
    )
    _log_in(page, live_server, "vera")
    row = page.locator(f"#environment-row-{environment.id}")
    expect(row.get_by_test_id("state")).to_have_text("requested")
    _mark_loaded(page)

    Environment.objects.filter(id=environment.id).update(state=EnvironmentState.PROVISIONING)
    expect(row.get_by_test_id("state")).to_have_text("provisioning", timeout=LIVE_TIMEOUT_MS)
    Environment.objects.filter(id=environment.id).update(state=EnvironmentState.DELETED)
    expect(row).to_have_count(0, timeout=LIVE_TIMEOUT_MS)
    _assert_not_reloaded(page)

    page.get_by_role("link", name="Acme ML").click()
    expect(page.get_by_test_id("members")).to_contain_text("vera")
    expect(page.get_by_test_id("new-environment")).to_have_count(0)
    expect(page.get_by_role("button", name="Remove")).to_have_count(0)
