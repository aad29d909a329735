"""The quota, partition and node-pool pages in a real Chromium, with a real Celery worker."""

import re
from decimal import Decimal

import pytest

from quotas.models import PriceCard, Quota
from runners.clusters.models import Gpu, NodePool, PartitionChange, PartitionProfile
from tests.frontend.conftest import assert_not_reloaded as _assert_not_reloaded
from tests.frontend.conftest import log_in as _log_in
from tests.frontend.conftest import mark_loaded as _mark_loaded
from tests.frontend.conftest import snap

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

# Starting a worker on two busy cores takes a while; the change itself is quick.
APPLY_TIMEOUT_MS = 90_000



def _set_quota(page, tenant: str, flavor: str, *, guaranteed: int, max: int) -> None:
    """Fill in and send the Quotas page's form."""
    form = page.get_by_test_id("set-quota")
    form.get_by_label("Tenant").select_option(tenant)
    form.get_by_label("Flavor").select_option(flavor)
    form.get_by_label("Guaranteed").fill(str(guaranteed))
    form.get_by_label("Max", exact=True).fill(str(max))
    form.get_by_role("button", name="Set quota").click()

@pytest.fixture
def flavors(flavor_factory):
    """The demo's flavors with prices: the whole H100 the quota is set on, and a few neighbours."""
    made = {}
    for name, kind, model, mig_profile, price in [
        ("h100-80gb", "whole", "H100-80GB", "", "4.20"),
        ("a100-40gb-3g.20gb", "mig", "A100-40GB", "3g.20gb", "1.10"),
        ("a100-40gb-1g.5gb", "mig", "A100-40GB", "1g.5gb", "0.40"),
        ("t4-shared", "timeslice", "T4", "", "0.15"),
    ]:
        made[name] = flavor_factory(name=name, kind=kind, gpu_model=model, mig_profile=mig_profile)
        PriceCard.objects.create(flavor=made[name], price_per_hour=Decimal(price), effective_from="2026-01-01T00:00Z")
    return made


@pytest.fixture
def other_profiles(db):
    """Profiles the demo ships for the other pools, so the page shows every kind of drawing."""
    PartitionProfile.objects.create(name="a100-mixed", gpu_model="A100-40GB", kind="mig",
                                    layout=["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"])
    PartitionProfile.objects.create(name="t4-share-4", gpu_model="T4", kind="timeslice", replicas=4)
    PartitionProfile.objects.create(name="h100-whole", gpu_model="H100-80GB", kind="whole")


def test_an_admin_sets_a_quota_and_applies_a_mig_profile_and_the_tenant_sees_the_quota(
    page, live_server, settings, staff, owner, tenant, other_tenant, inventory, flavors, other_profiles, celery_worker_factory,
    screenshot_dir,
):
    # The quota is a guarantee of whole H100s, so it is set while the pool still has them:
    # once the pool is cut into MIG instances, whole-GPU capacity is 0 and it would be refused.
    Quota.objects.create(tenant=other_tenant, flavor=flavors["t4-shared"], guaranteed=8, max=16)
    _log_in(page, live_server, "sam")

    # 1. The quota table: an over-capacity guarantee is refused at the field, then a good one is set.
    page.get_by_role("navigation").get_by_role("link", name="Quotas").click()
    expect(page.get_by_role("heading", name="Quotas", exact=True)).to_be_visible()
    _set_quota(page, "acme", "h100-80gb", guaranteed=20, max=24)
    expect(page.locator("#id_guaranteed-errors")).to_contain_text("the cluster holds 16")
    snap(page, screenshot_dir / "quotas-error.png")
    assert not Quota.objects.filter(tenant=tenant).exists()

    form = page.get_by_test_id("set-quota")
    form.get_by_label("Guaranteed").fill("4")
    form.get_by_label("Max", exact=True).fill("8")
    form.get_by_role("button", name="Set quota").click()
    expect(page.get_by_role("status")).to_contain_text("h100-80gb is now 4 guaranteed, 8 max")
    expect(page.get_by_test_id("quota-acme-h100-80gb")).to_have_text("4 / 8")
    snap(page, screenshot_dir / "quotas.png")

    # 2. A MIG profile for the H100s: the preview says why two 4g do not fit, then draws 4g + 3g.
    page.get_by_role("navigation").get_by_role("link", name="Partitions").click()
    form = page.get_by_test_id("new-profile")
    form.get_by_label("Name").fill("h100-4g-3g")
    form.get_by_label("GPU model").select_option("H100-80GB")
    form.get_by_label("Kind").select_option("mig")
    form.get_by_label("Layout").fill("4g.40gb, 4g.40gb")
    form.get_by_role("button", name="Preview").click()
    expect(page.get_by_test_id("why-not")).to_contain_text("too many instances of 4g.40gb")
    page.get_by_test_id("new-profile").locator("..").screenshot(path=str(screenshot_dir / "partitions-why-not.png"))
    # Editing the layout redraws the preview by itself, without pressing Preview again.
    form.get_by_label("Layout").fill("4g.40gb, 3g.40gb")
    preview = page.get_by_test_id("preview")
    expect(preview.get_by_test_id("gpu-instance")).to_have_count(2)
    assert preview.get_by_test_id("gpu-instance").evaluate_all(
        "blocks => blocks.map(b => [b.dataset.profile, b.dataset.start, b.dataset.span])"
    ) == [["4g.40gb", "0", "4"], ["3g.40gb", "4", "4"]]
    snap(page, screenshot_dir / "partitions-preview.png")
    form.get_by_role("button", name="Save profile").click()
    expect(page).to_have_url(f"{live_server.url}/partitions/#profile-h100-4g-3g")
    saved = page.locator("#profile-h100-4g-3g")
    expect(saved.get_by_test_id("gpu-instance")).to_have_count(2)
    saved.get_by_text("GPU Operator config this applies").click()
    expect(saved).to_contain_text("nvidia.com/mig.config=h100-4g-3g")
    saved.screenshot(path=str(screenshot_dir / "partitions-operator-config.png"))
    snap(page, screenshot_dir / "partitions.png")

    # 3. Apply it to the H100 pool and watch the change finish without a reload.
    page.get_by_role("navigation").get_by_role("link", name="Node pools").click()
    snap(page, screenshot_dir / "node-pools.png")
    page.get_by_role("link", name="h100-pool").click()
    snap(page, screenshot_dir / "node-pool-before.png")
    form = page.get_by_test_id("apply-profile")
    form.get_by_label("Profile").select_option("h100-4g-3g")
    # Choosing the profile previews, beside the form, what it does to each flavor's capacity.
    preview = page.get_by_test_id("capacity-preview")
    whole = preview.locator('tr[data-flavor="h100-80gb"]')
    expect(whole.get_by_test_id("capacity-before")).to_have_text("16")
    expect(whole.get_by_test_id("capacity-after")).to_have_text("0")
    expect(whole.get_by_test_id("unbacked")).to_contain_text("acme (4)")
    expect(preview.get_by_text("new flavor")).to_have_count(2)
    preview.screenshot(path=str(screenshot_dir / "node-pool-capacity-preview.png"))
    assert not PartitionChange.objects.exists(), "the preview changed nothing"
    form.get_by_label("Wait: refuse while work runs").check()
    page.once("dialog", lambda dialog: dialog.accept())  # the "Re-partition every GPU?" question
    form.get_by_role("button", name="Apply profile").click()
    # acme's 4 whole H100s would have no capacity left: refused until the admin agrees to lower them.
    form = page.get_by_test_id("apply-profile")
    expect(form).to_contain_text("shrink_guarantees")
    assert not PartitionChange.objects.exists()
    form.get_by_label("Profile").select_option("h100-4g-3g")
    form.get_by_label("Lower guarantees that no longer fit, in proportion").check()
    page.once("dialog", lambda dialog: dialog.accept())
    form.get_by_role("button", name="Apply profile").click()

    live = page.get_by_test_id("pool-live")
    expect(live.get_by_test_id("change-state")).to_have_text("pending")
    _mark_loaded(page)
    # No worker ran so far, so the page shows the change before it moves; start one now.
    settings.PARTITION_POLL_INTERVAL_S = 0.05
    celery_worker_factory()
    expect(live.get_by_test_id("change-state")).to_have_text("succeeded", timeout=APPLY_TIMEOUT_MS)
    _assert_not_reloaded(page)
    expect(live.get_by_test_id("current-profile")).to_have_text("h100-4g-3g")
    expect(live.get_by_test_id("change-message")).to_have_text("Pool h100-pool now runs h100-4g-3g.")
    expect(live.locator('[data-step="uncordoning"]')).to_have_count(2)
    expect(live.locator('[data-kind="mig"]')).to_have_count(16)
    expect(live.get_by_test_id("node-schedulable").first).to_have_text("schedulable")
    snap(page, screenshot_dir / "node-pool.png")
    change = PartitionChange.objects.get()
    assert change.state == "succeeded" and NodePool.objects.get(name="h100-pool").partition_profile.name == "h100-4g-3g"
    assert Gpu.objects.get(node__name="h100-node-2", index=7).mig_layout == [["4g.40gb", 0], ["3g.40gb", 4]]

    # The pool has no whole H100s left, and acme's guarantee was lowered to fit: 0 of 0.
    page.get_by_role("navigation").get_by_role("link", name="Quotas").click()
    expect(page.get_by_test_id("quota-table").locator('tfoot td[data-flavor="h100-80gb"]')).to_contain_text("0 of 0")
    snap(page, screenshot_dir / "quotas-after-repartition.png")
    # The new slices have flavors (discovered after the change) and can be given as quota.
    _set_quota(page, "acme", "h100-80gb-mig-4g.40gb", guaranteed=6, max=10)
    expect(page.get_by_role("status")).to_contain_text("h100-80gb-mig-4g.40gb is now 6 guaranteed, 10 max")
    assert Quota.objects.get(tenant=tenant, flavor__name="h100-80gb-mig-4g.40gb").guaranteed == 6

    # 4. The tenant's owner sees the new quota on the tenant's own page.
    page.get_by_role("button", name="Log out").click()
    _log_in(page, live_server, "olivia")
    expect(page.get_by_role("navigation").get_by_role("link", name="Quotas")).to_have_count(0)
    page.get_by_role("link", name="Acme ML").click()
    page.get_by_role("link", name="Quota", exact=True).click()
    expect(page).to_have_url(re.compile(r"/tenants/acme/quota/$"))
    row = page.get_by_test_id("tenant-quotas").locator('tr[data-flavor="h100-80gb"]')
    expect(row.get_by_test_id("guaranteed")).to_have_text("0")
    expect(row.get_by_test_id("capacity")).to_have_text("0")
    expect(row.get_by_test_id("max")).to_have_text("8")
    expect(row).to_contain_text("USD 4.20")
    sliced = page.get_by_test_id("tenant-quotas").locator('tr[data-flavor="h100-80gb-mig-4g.40gb"]')
    expect(sliced.get_by_test_id("guaranteed")).to_have_text("6")
    expect(sliced.get_by_test_id("capacity")).to_have_text("16")
    expect(page.get_by_test_id("tenant-quotas")).not_to_contain_text("t4-shared")
    snap(page, screenshot_dir / "tenant-quota.png")
