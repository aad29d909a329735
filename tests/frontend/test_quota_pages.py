"""Quota, partition and node-pool pages through Django's test client."""

import re
from decimal import Decimal

import pytest

from quotas.models import PriceCard, Quota
from runners.clusters.models import NodePool, PartitionChange, PartitionProfile
from runners.clusters.registry import get_backend

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def h100_flavor(flavor_factory):
    flavor = flavor_factory(name="h100-80gb")
    PriceCard.objects.create(flavor=flavor, price_per_hour=Decimal("4.2"), effective_from="2026-01-01T00:00Z")
    return flavor


@pytest.fixture
def h100_mig(db):
    return PartitionProfile.objects.create(
        name="h100-4g-3g", gpu_model="H100-80GB", kind="mig", layout=["4g.40gb", "3g.40gb"]
    )


@pytest.fixture
def staff_client(client, staff):
    client.force_login(staff)
    return client


def _quota_post(client, **fields):
    data = {"tenant": "acme", "flavor": "h100-80gb", "guaranteed": "4", "max": "8", "fair_share_weight": "1",
            "max_priority": "100", **fields}
    return client.post("/quotas/set/", data)


def _field_errors(response, field: str) -> str:
    """The text of the error list rendered next to one field; empty when there is none."""
    match = re.search(rf'<ul class="field-errors" id="id_{field}-errors">(.*?)</ul>', response.content.decode(), re.S)
    return re.sub(r"<[^>]+>", " ", match.group(1)) if match else ""


def _instances(html: str) -> list[tuple[str, int, int]]:
    """(profile, start, span) of every drawn GPU instance, in page order."""
    return [
        (profile, int(start), int(span))
        for profile, start, span in re.findall(r'data-profile="([^"]+)" data-start="(\d+)" data-span="(\d+)"', html)
    ]


# --- Who may see what ---------------------------------------------------------


@pytest.mark.parametrize("url", ["/quotas/", "/partitions/", "/node-pools/"])
def test_each_staff_page_renders_for_staff_and_is_in_their_nav(staff_client, inventory, h100_flavor, h100_mig, url):
    response = staff_client.get(url)
    assert response.status_code == 200
    html = response.content.decode()
    for link in ('href="/quotas/">Quotas<', 'href="/partitions/">Partitions<', 'href="/node-pools/">Node pools<'):
        assert link in html


def test_the_node_pool_page_renders_for_staff(staff_client, inventory, h100_mig):
    pool = NodePool.objects.get(name="h100-pool")
    response = staff_client.get(f"/node-pools/{pool.id}/")
    assert response.status_code == 200
    html = response.content.decode()
    assert 'data-node="h100-node-1"' in html and 'data-node="h100-node-2"' in html
    assert html.count('data-kind="whole"') == 16, "every GPU of the pool is drawn, whole for now"
    assert '<option value="h100-4g-3g">' in html
    assert "data-poll-url" not in html, "nothing is in flight, so nothing polls"


@pytest.mark.parametrize("persona", ["owner", "viewer", "outsider"])
@pytest.mark.parametrize(
    "url", ["/quotas/", "/partitions/", "/partitions/preview/?gpu_model=H100-80GB&kind=whole", "/node-pools/"]
)
def test_non_staff_get_a_404_on_staff_pages(client, request, persona, url, inventory):
    client.force_login(request.getfixturevalue(persona))
    response = client.get(url)
    assert response.status_code == 404
    assert b'href="/quotas/"' not in client.get("/").content, "non-staff get no nav entry for the staff pages"


def test_non_staff_cannot_post_to_the_staff_forms(client, owner, inventory, h100_flavor, h100_mig):
    client.force_login(owner)
    pool = NodePool.objects.get(name="h100-pool")
    assert _quota_post(client).status_code == 404
    assert client.post(f"/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g", "drain": "wait"}).status_code == 404
    assert client.get(f"/node-pools/{pool.id}/live/").status_code == 404
    assert not Quota.objects.exists() and not PartitionChange.objects.exists()


def test_anonymous_visitors_are_sent_to_log_in(client):
    response = client.get("/quotas/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


# --- The quota table ------------------------------------------------------------


def test_the_quota_table_shows_tenants_by_flavors_with_capacity_and_price(
    staff_client, staff, tenant, other_tenant, inventory, h100_flavor
):
    Quota.objects.create(tenant=tenant, flavor=h100_flavor, guaranteed=4, max=8)
    html = staff_client.get("/quotas/").content.decode()
    assert 'data-tenant="acme"' in html and 'data-tenant="globex"' in html
    cell = re.search(r'data-testid="quota-acme-h100-80gb">(.*?)</td>', html, re.S).group(1)
    assert "4 / 8" in cell
    assert "capacity 16" in html and "USD 4.20/h" in html
    assert "in use: tracked once jobs run" in html.lower()
    assert "4 of 16" in html, "the footer totals the guarantees against capacity"


def test_clicking_a_cell_fills_the_form_with_its_quota(staff_client, tenant, inventory, h100_flavor):
    Quota.objects.create(tenant=tenant, flavor=h100_flavor, guaranteed=3, max=9)
    html = staff_client.get("/quotas/?tenant=acme&flavor=h100-80gb").content.decode()
    assert '<option value="acme" selected>Acme ML (acme)</option>' in html
    assert 'name="guaranteed" value="3"' in html and 'name="max" value="9"' in html


def test_a_quota_can_be_removed_from_its_cell(staff_client, tenant, inventory, h100_flavor):
    quota = Quota.objects.create(tenant=tenant, flavor=h100_flavor, guaranteed=3, max=9)
    html = staff_client.get("/quotas/?tenant=acme&flavor=h100-80gb").content.decode()
    assert f'action="/quotas/{quota.id}/remove/"' in html and "data-confirm=" in html
    response = staff_client.post(f"/quotas/{quota.id}/remove/")
    assert response.status_code == 302 and response["Location"] == "/quotas/"
    assert not Quota.objects.exists()
    assert "Removed Acme ML&#x27;s quota for h100-80gb." in staff_client.get("/quotas/").content.decode()
    assert staff_client.post(f"/quotas/{quota.id}/remove/").status_code == 404


def test_setting_a_quota_through_the_form_creates_it(staff_client, tenant, inventory, h100_flavor):
    response = _quota_post(staff_client, guaranteed="4", max="8")
    assert response.status_code == 302 and response["Location"] == "/quotas/"
    quota = Quota.objects.get(tenant=tenant, flavor=h100_flavor)
    assert (quota.guaranteed, quota.max) == (4, 8)
    page = staff_client.get("/quotas/").content.decode()
    assert "h100-80gb is now 4 guaranteed, 8 max" in page

    _quota_post(staff_client, guaranteed="2", max="10")
    quota.refresh_from_db()
    assert (quota.guaranteed, quota.max) == (2, 10), "setting it again changes the same quota"


@pytest.mark.parametrize(
    "fields, field, message",
    [
        ({"guaranteed": "9", "max": "8"}, "guaranteed", "guaranteed (9) cannot exceed max (8)"),
        ({"guaranteed": "17", "max": "20"}, "guaranteed", "the cluster holds 16"),
        ({"guaranteed": "-1"}, "guaranteed", "greater than or equal to 0"),
        ({"max": "2.5"}, "max", "Enter a whole number"),
        ({"flavor": "no-such-flavor"}, "flavor", "Select a valid choice"),
        ({"tenant": "globexx"}, "tenant", "Select a valid choice"),
        ({"fair_share_weight": "0"}, "fair_share_weight", "greater than or equal to 0.01"),
    ],
)
def test_bad_quota_input_shows_the_error_at_the_field_and_changes_nothing(
    staff_client, tenant, inventory, h100_flavor, fields, field, message
):
    Quota.objects.create(tenant=tenant, flavor=h100_flavor, guaranteed=1, max=2)
    response = _quota_post(staff_client, **fields)
    assert response.status_code == 400
    assert message in _field_errors(response, field), response.content.decode()[:3000]
    quota = Quota.objects.get()
    assert (quota.guaranteed, quota.max) == (1, 2)


# --- Partition profiles ---------------------------------------------------------


def test_the_partition_page_draws_4g_and_3g_at_memory_slots_0_to_3_and_4_to_7(staff_client, h100_mig):
    html = staff_client.get("/partitions/").content.decode()
    profile = html[html.index('id="profile-h100-4g-3g"'):]
    assert _instances(profile)[:2] == [("4g.40gb", 0, 4), ("3g.40gb", 4, 4)]
    drawing = profile[: profile.index("</figure>")]
    owners = re.findall(r'data-compute-position="(\d)" data-owner="([^"]+)"', drawing)
    assert owners == [("0", "4g.40gb"), ("1", "4g.40gb"), ("2", "4g.40gb"), ("3", "4g.40gb"),
                      ("4", "3g.40gb"), ("5", "3g.40gb"), ("6", "3g.40gb")]
    assert "data-free-position" not in drawing
    assert "nvidia.com/mig.config=h100-4g-3g" in profile, "the GPU Operator labels it applies are shown"
    assert "4g.40gb" in profile[profile.index("mig-parted config"):]


def test_time_sliced_and_whole_profiles_are_drawn_as_replicas_and_one_block(staff_client, db):
    PartitionProfile.objects.create(name="t4-share-4", gpu_model="T4", kind="timeslice", replicas=4)
    PartitionProfile.objects.create(name="h100-whole", gpu_model="H100-80GB", kind="whole")
    html = staff_client.get("/partitions/").content.decode()
    shared = html[html.index('id="profile-t4-share-4"'):]
    assert 'data-kind="timeslice"' in shared and 'data-replicas="4"' in shared
    assert shared[: shared.index("</figure>")].count('data-testid="gpu-replica"') == 4
    assert "nvidia.com/device-plugin.config=t4-share-4" in shared
    whole = html[html.index('id="profile-h100-whole"'):]
    assert whole[: whole.index("</figure>")].count('data-testid="gpu-instance"') == 1


def test_the_preview_draws_a_layout_that_fits_with_free_slots(staff_client):
    response = staff_client.get("/partitions/preview/", {"gpu_model": "H100-80GB", "kind": "mig", "layout": "3g.40gb 2g.20gb,1g.10gb"})
    assert response.status_code == 200
    html = response.content.decode()
    assert "<html" not in html, "the preview is a fragment"
    assert _instances(html) == [("3g.40gb", 0, 4), ("2g.20gb", 4, 2), ("1g.10gb", 6, 1)]
    assert re.findall(r'data-free-position="(\d)"', html) == ["7"]
    assert not PartitionProfile.objects.exists(), "a preview saves nothing"


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"kind": "mig", "layout": "4g.40gb, 4g.40gb"}, "too many instances of 4g.40gb on H100-80GB"),
        ({"kind": "mig", "layout": "4g.40gb 2g.20gb 2g.20gb"}, "compute slices exhausted"),
        ({"kind": "mig", "layout": "5g.50gb"}, "unknown MIG profile"),
        ({"kind": "mig", "layout": ""}, "needs a layout"),
        ({"kind": "timeslice", "replicas": "1"}, "between 2 and 64 replicas"),
        ({"gpu_model": "T4", "kind": "mig", "layout": "1g.5gb"}, "T4 does not support MIG"),
        ({"gpu_model": "B300"}, "Select a valid choice"),
    ],
)
def test_the_preview_says_why_a_layout_does_not_fit(staff_client, fields, reason):
    response = staff_client.get("/partitions/preview/", {"gpu_model": "H100-80GB", **fields})
    assert response.status_code == 200
    html = response.content.decode()
    assert 'data-testid="why-not"' in html and reason in html, html
    assert 'data-testid="gpu-instance"' not in html


def test_creating_a_profile_through_the_form_saves_it(staff_client):
    response = staff_client.post(
        "/partitions/new/", {"name": "h100-7x1g", "gpu_model": "H100-80GB", "kind": "mig", "layout": "1g.10gb " * 7}
    )
    assert response.status_code == 302 and response["Location"] == "/partitions/#profile-h100-7x1g"
    profile = PartitionProfile.objects.get(name="h100-7x1g")
    assert profile.layout == ["1g.10gb"] * 7 and profile.replicas == 1
    html = staff_client.get("/partitions/").content.decode()
    assert [start for _, start, _ in _instances(html)] == [0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    "fields, field, message",
    [
        ({"layout": "4g.40gb 4g.40gb"}, "layout", "too many instances of 4g.40gb"),
        ({"name": "H100 Mixed"}, "name", "lowercase letters"),
        ({"name": "h100-4g-3g"}, "name", "already exists"),
        ({"kind": "timeslice", "layout": "", "replicas": "99"}, "replicas", "between 2 and 64"),
    ],
)
def test_a_bad_profile_shows_the_error_at_the_field_and_saves_nothing(staff_client, h100_mig, fields, field, message):
    data = {"name": "h100-new", "gpu_model": "H100-80GB", "kind": "mig", "layout": "3g.40gb", **fields}
    response = staff_client.post("/partitions/new/", data)
    assert response.status_code == 400
    assert message in _field_errors(response, field), response.content.decode()[-4000:]
    assert list(PartitionProfile.objects.values_list("name", flat=True)) == ["h100-4g-3g"]


# --- Node pools -------------------------------------------------------------------


def test_the_node_pool_list_shows_each_pool_with_model_and_profile(staff_client, inventory, h100_mig):
    NodePool.objects.filter(name="h100-pool").update(partition_profile=h100_mig)
    html = staff_client.get("/node-pools/").content.decode()
    for name in ("h100-pool", "a100-pool", "t4-pool"):
        assert f'data-pool="{name}"' in html
    row = re.search(r'data-pool="h100-pool">(.*?)</tr>', html, re.S).group(1)
    assert "H100-80GB" in row and "h100-4g-3g" in row


def test_a_node_pool_draws_its_gpus_current_layouts(staff_client, inventory):
    pool = NodePool.objects.get(name="a100-pool")
    html = staff_client.get(f"/node-pools/{pool.id}/").content.decode()
    assert html.count('data-kind="mig"') == 4
    # The demo's 3g.20gb+2g.10gb+1g.5gb+1g.5gb: a 1g may not start at slot 7, so the 3g takes 4-7.
    assert _instances(html)[:4] == [("2g.10gb", 0, 2), ("1g.5gb", 2, 1), ("1g.5gb", 3, 1), ("3g.20gb", 4, 4)]
    t4 = NodePool.objects.get(name="t4-pool")
    assert staff_client.get(f"/node-pools/{t4.id}/").content.decode().count('data-replicas="4"') == 8


def test_the_apply_form_offers_only_profiles_for_the_pools_model(staff_client, inventory, h100_mig):
    PartitionProfile.objects.create(name="t4-share-4", gpu_model="T4", kind="timeslice", replicas=4)
    pool = NodePool.objects.get(name="h100-pool")
    html = staff_client.get(f"/node-pools/{pool.id}/").content.decode()
    assert 'value="h100-4g-3g"' in html and 'value="t4-share-4"' not in html


def test_the_apply_form_starts_a_partition_change_that_the_page_follows_live(
    staff_client, inventory, h100_mig, django_capture_on_commit_callbacks
):
    pool = NodePool.objects.get(name="h100-pool")
    with django_capture_on_commit_callbacks() as callbacks:
        response = staff_client.post(f"/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g", "drain": "wait"})
    assert response.status_code == 302 and response["Location"] == f"/node-pools/{pool.id}/"
    assert len(callbacks) == 1, "the task is enqueued once, after commit"
    change = PartitionChange.objects.get()
    assert (change.pool, change.profile, change.drain, change.state) == (pool, h100_mig, "wait", "pending")

    html = staff_client.get(f"/node-pools/{pool.id}/").content.decode()
    assert f'data-poll-url="/node-pools/{pool.id}/live/"' in html
    assert 'data-testid="change-state">pending<' in html

    # Play the worker's part; the fragment then shows the steps, the new layout, and stops polling.
    from tests.support.partitions import drive_partition_change

    drive_partition_change(change.id)
    fragment = staff_client.get(f"/node-pools/{pool.id}/live/").content.decode()
    assert "<html" not in fragment
    assert 'data-testid="change-state">succeeded<' in fragment
    assert "data-poll-url" not in fragment
    assert 'data-step="cordoning"' in fragment and 'data-step="uncordoning"' in fragment
    assert "Pool h100-pool now runs h100-4g-3g." in fragment
    assert _instances(fragment)[:2] == [("4g.40gb", 0, 4), ("3g.40gb", 4, 4)]
    assert fragment.count('data-kind="mig"') == 16


def test_the_apply_form_refuses_with_the_services_message_while_work_runs(staff_client, inventory, h100_mig):
    with get_backend()._state(write=True) as state:  # what a running local job registers
        state["workloads"]["h100-node-2"] = ["acme-train/job-7"]
    pool = NodePool.objects.get(name="h100-pool")
    response = staff_client.post(f"/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g", "drain": "wait"})
    assert response.status_code == 400
    errors = _field_errors(response, "drain")
    assert "Work is running on pool h100-pool (h100-node-2: acme-train/job-7)" in errors
    assert "drain=preempt" in errors
    assert not PartitionChange.objects.exists()


def test_the_apply_form_refuses_a_second_change_while_one_is_in_flight(
    staff_client, staff, inventory, h100_mig, django_capture_on_commit_callbacks
):
    pool = NodePool.objects.get(name="h100-pool")
    PartitionChange.objects.create(pool=pool, profile=h100_mig, created_by=staff)
    response = staff_client.post(f"/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g", "drain": "preempt"})
    assert response.status_code == 400
    assert "already being re-partitioned" in _field_errors(response, "profile")
    assert PartitionChange.objects.count() == 1


def test_the_apply_form_refuses_a_profile_of_another_model(staff_client, inventory, h100_mig):
    pool = NodePool.objects.get(name="t4-pool")
    response = staff_client.post(f"/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g", "drain": "wait"})
    assert response.status_code == 400
    assert "Select a valid choice" in _field_errors(response, "profile")
    assert not PartitionChange.objects.exists()


def _preview_rows(html: str) -> dict[str, tuple[str, str, str]]:
    """flavor -> (capacity now, after, who no longer fits) from the capacity preview table."""
    def cell(body: str, name: str) -> str:
        return re.sub(r"<[^>]+>", "", re.search(rf'data-testid="{name}">(.*?)</td>', body, re.S).group(1)).strip()

    return {
        flavor: (cell(body, "capacity-before"), cell(body, "capacity-after"), cell(body, "unbacked"))
        for flavor, body in re.findall(r'<tr data-flavor="([^"]+)">(.*?)</tr>', html, re.S)
    }


def test_the_capacity_preview_lists_each_flavors_change_and_the_guarantees_that_no_longer_fit(
    staff_client, inventory, h100_mig, h100_flavor, tenant
):
    Quota.objects.create(tenant=tenant, flavor=h100_flavor, guaranteed=4, max=8)
    pool = NodePool.objects.get(name="h100-pool")
    response = staff_client.get(f"/node-pools/{pool.id}/apply/preview/", {"profile": "h100-4g-3g"})
    assert response.status_code == 200
    html = response.content.decode()
    assert "<html" not in html, "a fragment for the page to show beside the form"
    rows = _preview_rows(html)
    assert rows["h100-80gb"] == ("16", "0", "over capacity acme (4)")
    # The slices the profile makes have no flavor yet: the preview names the ones discovery will create.
    new = {flavor: row for flavor, row in rows.items() if flavor != "h100-80gb"}
    assert sorted(row[:2] for row in new.values()) == [("0", "16"), ("0", "16")]
    assert html.count("new flavor") == 2
    assert all(row[2] == "none" for row in new.values())
    assert not PartitionChange.objects.exists(), "a preview changes nothing"


def test_the_capacity_preview_asks_for_a_profile_first(staff_client, inventory):
    pool = NodePool.objects.get(name="h100-pool")
    html = staff_client.get(f"/node-pools/{pool.id}/apply/preview/").content.decode()
    assert "Choose a profile" in html and "<table" not in html


def test_a_refused_apply_shows_the_capacity_preview_beside_the_error(staff_client, inventory, h100_mig, h100_flavor, tenant):
    Quota.objects.create(tenant=tenant, flavor=h100_flavor, guaranteed=4, max=8)
    pool = NodePool.objects.get(name="h100-pool")
    response = staff_client.post(f"/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g", "drain": "wait"})
    assert response.status_code == 400
    assert "shrink_guarantees" in _field_errors(response, "profile")
    assert _preview_rows(response.content.decode())["h100-80gb"] == ("16", "0", "over capacity acme (4)")
    assert not PartitionChange.objects.exists()


def test_the_capacity_preview_is_staffs(client, owner, inventory, h100_mig):
    client.force_login(owner)
    pool = NodePool.objects.get(name="h100-pool")
    assert client.get(f"/node-pools/{pool.id}/apply/preview/", {"profile": "h100-4g-3g"}).status_code == 404


def test_an_unknown_node_pool_is_a_404(staff_client, inventory):
    assert staff_client.get("/node-pools/999999/").status_code == 404


# --- A tenant's own quota -----------------------------------------------------------


def test_my_quota_shows_the_tenants_quotas_with_prices_to_a_viewer(client, viewer, tenant, other_tenant, h100_flavor, flavor_factory):
    Quota.objects.create(tenant=tenant, flavor=h100_flavor, guaranteed=4, max=8)
    t4 = flavor_factory(name="t4-shared", kind="timeslice", gpu_model="T4")
    Quota.objects.create(tenant=other_tenant, flavor=t4, guaranteed=2, max=2)
    client.force_login(viewer)
    response = client.get("/tenants/acme/quota/")
    assert response.status_code == 200
    html = response.content.decode()
    row = re.search(r'<tr data-flavor="h100-80gb">(.*?)</tr>', html, re.S).group(1)
    assert "H100-80GB" in row and "whole" in row and "USD 4.20" in row
    assert 'data-testid="guaranteed">4<' in row and 'data-testid="max">8<' in row
    assert "t4-shared" not in html, "another tenant's quota never shows"
    assert 'href="/tenants/acme/quota/"' in client.get("/tenants/acme/").content.decode()


def test_my_quota_says_so_when_there_is_none(client, owner):
    client.force_login(owner)
    assert b"has no quota yet" in client.get("/tenants/acme/quota/").content


def test_my_quota_is_a_404_for_an_outsider(client, outsider, tenant, h100_flavor):
    Quota.objects.create(tenant=tenant, flavor=h100_flavor, guaranteed=4, max=8)
    client.force_login(outsider)
    assert client.get("/tenants/acme/quota/").status_code == 404


def test_my_quota_shows_live_capacity_and_says_when_a_guarantee_is_not_backed(
    client, viewer, tenant, other_tenant, inventory, h100_flavor
):
    from runners.clusters.registry import get_backend
    from runners.clusters.services import inventory_sync

    Quota.objects.create(tenant=tenant, flavor=h100_flavor, guaranteed=8, max=16)
    Quota.objects.create(tenant=other_tenant, flavor=h100_flavor, guaranteed=4, max=16)
    client.force_login(viewer)

    def row():
        html = client.get("/tenants/acme/quota/").content.decode()
        return re.search(r'<tr data-flavor="h100-80gb">(.*?)</tr>', html, re.S).group(1)

    assert 'data-testid="capacity">16<' in row() and 'data-testid="unbacked"' not in row()
    # Half the H100 nodes go away (cordoned): 8 left for 12 guaranteed, acme's 8 backed only 5 (8 * 8 // 12).
    get_backend().cordon("h100-node-2")
    inventory_sync()
    assert 'data-testid="capacity">8<' in row()
    assert re.search(r'data-testid="unbacked"[^>]*>3 not backed', row())
