"""Re-partitioning a pool never strands quota: preview, refusal, proportional shrink, new flavors."""

import pytest

from quotas.models import GuaranteeReduction, Quota, ResourceFlavor
from runners.clusters.models import NodePool, PartitionChange
from tests.support.partitions import drive_partition_change

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

# One 3g.40gb and two 2g.20gb per H100: the 16 whole H100s of the demo cluster become 48 slices.
LAYOUT = ["3g.40gb", "2g.20gb", "2g.20gb"]


@pytest.fixture
def guaranteed_h100(client_for, staff, tenant, other_tenant, inventory, flavor_factory):
    flavor_factory()  # h100-80gb: 16 whole GPUs
    client = client_for(staff)
    for slug, guaranteed in (("acme", 8), ("globex", 4)):
        response = client.post("/api/v1/quotas/", {"tenant": slug, "flavor": "h100-80gb", "guaranteed": guaranteed, "max": 16})
        assert response.status_code == 201, response.content
    response = client.post(
        "/api/v1/partition-profiles/",
        {"name": "h100-3g-2x2g", "gpu_model": "H100-80GB", "kind": "mig", "layout": LAYOUT},
        format="json",
    )
    assert response.status_code == 201, response.content
    return NodePool.objects.get(name="h100-pool")


def _rows(response):
    return {row["flavor"]: row for row in response.json()["capacity"]}


def test_the_dry_run_lists_the_capacity_change_and_the_guarantees_that_no_longer_fit(client_for, staff, guaranteed_h100):
    pool = guaranteed_h100
    response = client_for(staff).post(f"/api/v1/node-pools/{pool.id}/apply/?dry_run=true", {"profile": "h100-3g-2x2g"})
    assert response.status_code == 200, response.content
    rows = _rows(response)
    whole = rows["h100-80gb"]
    assert (whole["capacity_before"], whole["capacity_after"], whole["guaranteed"]) == (16, 0, 12)
    assert sorted((item["tenant"], item["guaranteed"]) for item in whole["unbacked"]) == [("acme", 8), ("globex", 4)]
    slices = {name: row for name, row in rows.items() if row["kind"] == "mig"}
    assert sorted((row["mig_profile"], row["capacity_after"], row["new_flavor"]) for row in slices.values()) == [
        ("2g.20gb", 32, True),
        ("3g.40gb", 16, True),
    ]
    assert not PartitionChange.objects.exists()
    assert sorted(Quota.objects.values_list("guaranteed", flat=True)) == [4, 8]


def test_the_apply_is_refused_naming_profile_while_guarantees_would_not_fit(client_for, staff, guaranteed_h100):
    pool = guaranteed_h100
    response = client_for(staff).post(f"/api/v1/node-pools/{pool.id}/apply/", {"profile": "h100-3g-2x2g"})
    assert response.status_code == 400, response.content
    message = response.json()["profile"][0]
    assert "h100-80gb" in message and "shrink_guarantees" in message
    assert not PartitionChange.objects.exists()
    assert sorted(Quota.objects.values_list("guaranteed", flat=True)) == [4, 8]


def test_a_tenant_cannot_preview_or_apply(client_for, owner, guaranteed_h100):
    pool = guaranteed_h100
    response = client_for(owner).post(f"/api/v1/node-pools/{pool.id}/apply/?dry_run=true", {"profile": "h100-3g-2x2g"})
    assert response.status_code in (403, 404)


def test_shrinking_lowers_guarantees_in_proportion_records_them_and_the_new_slices_get_flavors(
    client_for, staff, owner, guaranteed_h100, django_capture_on_commit_callbacks
):
    pool = guaranteed_h100
    with django_capture_on_commit_callbacks():
        response = client_for(staff).post(
            f"/api/v1/node-pools/{pool.id}/apply/", {"profile": "h100-3g-2x2g", "shrink_guarantees": True}, format="json"
        )
    assert response.status_code == 202, response.content
    assert sorted(Quota.objects.values_list("guaranteed", flat=True)) == [0, 0]
    recorded = sorted(GuaranteeReduction.objects.values_list("tenant__slug", "guaranteed_before", "guaranteed_after"))
    assert recorded == [("acme", 8, 0), ("globex", 4, 0)]
    assert "h100-3g-2x2g" in GuaranteeReduction.objects.first().reason

    change = drive_partition_change(response.json()["id"])
    assert change == "succeeded"
    three_g = ResourceFlavor.objects.get(kind="mig", gpu_model="H100-80GB", mig_profile="3g.40gb")
    two_g = ResourceFlavor.objects.get(kind="mig", gpu_model="H100-80GB", mig_profile="2g.20gb")
    assert not three_g.prices.exists()  # discovered, no price yet
    client = client_for(staff)
    assert client.get(f"/api/v1/flavors/{three_g.name}/").json()["capacity"] == 16
    assert client.get(f"/api/v1/flavors/{two_g.name}/").json()["capacity"] == 32
    assert client.get("/api/v1/flavors/h100-80gb/").json()["capacity"] == 0
    # The new slices can be given as quota, and the tenant sees them.
    response = client.post("/api/v1/quotas/", {"tenant": "acme", "flavor": three_g.name, "guaranteed": 10, "max": 16})
    assert response.status_code == 201, response.content
    shown = client_for(owner).get("/api/v1/quotas/?tenant=acme").json()["results"]
    assert {(row["flavor"], row["guaranteed"]) for row in shown} >= {(three_g.name, 10), ("h100-80gb", 0)}


def test_the_shrink_keeps_each_tenants_floor_share(staff, tenant, other_tenant, flavor_factory):
    from quotas import services as quota_services

    flavor = flavor_factory()
    Quota.objects.create(tenant=tenant, flavor=flavor, guaranteed=8, max=16)
    Quota.objects.create(tenant=other_tenant, flavor=flavor, guaranteed=4, max=16)
    reductions = quota_services.guarantees_shrink(actor=staff, flavor=flavor, capacity=6, reason="test")
    assert sorted((r.tenant.slug, r.guaranteed_after) for r in reductions) == [("acme", 4), ("globex", 2)]
    assert sum(Quota.objects.values_list("guaranteed", flat=True)) <= 6
    assert quota_services.guarantees_shrink(actor=staff, flavor=flavor, capacity=6, reason="again") == []
