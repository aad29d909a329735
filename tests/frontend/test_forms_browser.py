"""In Chromium: the error summary takes the focus and leads to each field; flash messages can be
dismissed, and one about a state goes when the page's live update shows another."""

import re

import pytest

from tests.conftest import PASSWORD
from tests.frontend.conftest import LIVE_TIMEOUT_MS, assert_not_reloaded, log_in, mark_loaded, snap
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

playwright_sync = pytest.importorskip("playwright.sync_api")
axe_playwright = pytest.importorskip("axe_playwright_python.sync_playwright")
expect = playwright_sync.expect

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _serious(page) -> list[str]:
    return [f"{violation['id']}: {node['target']}" for violation in axe_playwright.Axe().run(page).response["violations"]
            if violation["impact"] in ("serious", "critical") for node in violation["nodes"]]


def test_a_refused_job_form_on_a_phone_sums_up_every_error_and_leads_to_each_field(
    browser, live_server, tenant, owner, screenshot_dir
):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8)
    ready_environment(actor=owner, tenant=tenant)
    context = browser.new_context(viewport={"width": 390, "height": 844})
    page = context.new_page()
    log_in(page, live_server, owner.username)
    page.goto(f"{live_server.url}/tenants/acme/jobs/")
    form = page.get_by_test_id("submit-job")
    form.get_by_label("Name").fill("Bad_Name")
    form.get_by_label("Replicas", exact=True).fill("0")
    form.get_by_role("button", name="Submit job").click()

    errors = page.get_by_test_id("error-summary")
    expect(errors).to_be_focused()
    expect(errors.get_by_role("heading")).to_have_text("There are 2 problems")
    snap(page, screenshot_dir / "job-form-errors-390.png")
    assert _serious(page) == []
    assert page.evaluate("document.documentElement.scrollWidth") <= 390

    errors.get_by_role("link", name=re.compile(r"^Replicas: ")).click()
    expect(page.locator("#id_replicas")).to_be_focused()
    expect(page.locator("#id_replicas")).to_have_attribute("aria-invalid", "true")
    # The error is read with the field: it describes it.
    assert "Ensure this value is greater than or equal to 1." in page.locator("#id_replicas").evaluate(
        "input => input.getAttribute('aria-describedby').split(' ').map(id => document.getElementById(id).textContent).join(' ')")
    context.close()


def test_the_menu_button_folds_the_top_bar_on_a_phone(browser, live_server, owner):
    context = browser.new_context(viewport={"width": 390, "height": 844})
    page = context.new_page()
    log_in(page, live_server, owner.username)
    menu = page.get_by_role("button", name="Menu")
    nav = page.get_by_role("navigation", name="Main")
    expect(menu).to_have_attribute("aria-expanded", "false")
    expect(nav).to_be_hidden()
    menu.click()
    expect(menu).to_have_attribute("aria-expanded", "true")
    expect(nav.get_by_role("link", name="API tokens")).to_be_visible()
    nav.get_by_role("link", name="API tokens").click()
    expect(page.get_by_role("heading", name="API tokens", exact=True)).to_be_visible()
    context.close()

    # Without JavaScript there is no button to press: the menu wraps under the brand instead.
    context = browser.new_context(viewport={"width": 390, "height": 844}, java_script_enabled=False)
    page = context.new_page()
    log_in_without_js = page.goto(f"{live_server.url}/login/")
    assert log_in_without_js.ok
    page.get_by_label("Username").fill(owner.username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("navigation", name="Main").get_by_role("link", name="API tokens")).to_be_visible()
    expect(page.get_by_role("button", name="Menu")).to_be_hidden()
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    context.close()


def test_a_message_can_be_dismissed_and_is_a_status_of_paragraphs(page, live_server, owner):
    log_in(page, live_server, owner.username)
    page.goto(f"{live_server.url}/tokens/")
    form = page.get_by_test_id("new-token-form")
    form.get_by_label("Name").fill("laptop")
    form.get_by_role("button", name="Create token").click()
    page.get_by_role("button", name="Revoke laptop").click()
    status = page.get_by_role("status")
    expect(status).to_contain_text("Revoked the token 'laptop'")
    assert status.evaluate("box => box.tagName") == "DIV" and status.locator("li").count() == 0
    assert _serious(page) == []
    status.get_by_role("button", name="Dismiss this message").click()
    expect(page.get_by_text("Revoked the token 'laptop'")).to_have_count(0)


@pytest.mark.worker
def test_the_provisioning_message_goes_once_the_environment_is_ready(
    page, live_server, settings, owner, tenant, celery_worker_factory
):
    settings.LOCAL_PROVISION_DELAY_S = 1  # provisioning lasts long enough to be seen
    celery_worker_factory()
    log_in(page, live_server, owner.username)
    page.goto(f"{live_server.url}/tenants/acme/")
    form = page.get_by_test_id("new-environment")
    form.get_by_label("Name").fill("train")
    form.get_by_role("button", name="Create environment").click()
    expect(page).to_have_url(re.compile(r"/environments/\d+/$"))
    mark_loaded(page)
    message = page.locator("[data-message]", has_text="a worker is provisioning it now")
    state = page.get_by_test_id("environment-status").get_by_test_id("state")
    assert state.inner_text() in ("requested", "provisioning"), "the page was rendered before the worker finished"
    expect(message).to_be_visible()
    # The view names the states the message describes (extra_tags="state:..."): it stays while the badge
    # shows one of them and goes as soon as the live update shows ready.
    expect(message).to_have_attribute("data-state", "requested provisioning")
    # What the page showed at each change: the badge, and whether the message was still there.
    page.evaluate("""() => {
        window.seen = [];
        new MutationObserver(() => {
            const badge = document.querySelector('[data-testid="environment-status"] [data-testid="state"]');
            window.seen.push([badge && badge.textContent.trim(), !!document.querySelector('[data-message][data-state]')]);
        }).observe(document.body, {childList: true, subtree: true, characterData: true});
    }""")

    expect(state).to_have_text("ready", timeout=LIVE_TIMEOUT_MS)
    expect(message).to_have_count(0)
    seen = page.evaluate("window.seen")
    assert all(present for badge, present in seen if badge in ("requested", "provisioning")), seen
    assert_not_reloaded(page)

