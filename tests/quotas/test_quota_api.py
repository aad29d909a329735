"""Quotas, flavors and partition profiles through the REST API."""

import json

import pytest

from quotas.models import Quota, ResourceFlavor
from runners.clusters.models import PartitionProfile
from runners.environments.models import Environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def h100(inventory, flavor_factory):
    return flavor_factory()  # the demo cluster has 16 whole H100s


def _quota(client, **fields):
    payload = {"tenant": "acme", "flavor": "h100-80gb", "guaranteed": 4, "max": 8, **fields}
    return client.post("/api/v1/quotas/", payload)


def test_staff_set_a_quota_and_the_tenant_reads_it(client_for, staff, owner, outsider, h100):
    response = _quota(client_for(staff))
    assert response.status_code == 201, response.content
    assert response.json()["kubernetes_resource"] == "nvidia.com/gpu"
    mine = client_for(owner).get("/api/v1/quotas/").json()["results"]
    assert [(q["tenant"], q["flavor"], q["guaranteed"], q["max"]) for q in mine] == [("acme", "h100-80gb", 4, 8)]
    assert client_for(outsider).get("/api/v1/quotas/").json()["results"] == []
    assert client_for(outsider).get(f"/api/v1/quotas/{mine[0]['id']}/").status_code == 404
    assert client_for(staff).get("/api/v1/quotas/?tenant=globex").json()["results"] == []


def test_a_tenant_owner_cannot_set_quotas(client_for, owner, h100):
    assert _quota(client_for(owner)).status_code == 403
    assert not Quota.objects.exists()


def test_a_quota_change_is_patched_and_propagated(client_for, staff, tenant, h100, django_capture_on_commit_callbacks):
    Environment.objects.create(tenant=tenant, name="train", namespace="acme-train", backend="local", state="ready")
    quota_id = _quota(client_for(staff)).json()["id"]
    with django_capture_on_commit_callbacks() as callbacks:
        response = client_for(staff).patch(f"/api/v1/quotas/{quota_id}/", {"max": 12})
    assert response.status_code == 200
    assert (response.json()["guaranteed"], response.json()["max"]) == (4, 12)
    sent = [getattr(callback, "task_name", None) for callback in callbacks]
    assert sent.count("runners.tasks.environment_sync") == 1, f"the ready environment is resynced after commit: {sent}"


def test_a_quota_change_reaches_the_local_workspace_record(client_for, staff, owner, tenant, h100, settings):
    from runners.environments import services as environments

    environment = Environment.objects.create(tenant=tenant, name="train", namespace="acme-train", backend="local")
    environments.environment_provision_run(environment_id=environment.id)
    _quota(client_for(staff), guaranteed=2, max=6)
    environments.environment_sync_run(environment_id=environment.id)
    record = json.loads((settings.LOCAL_WORKSPACE_DIR / "acme-train" / "environment.json").read_text())
    assert record["quota_hard"] == {"requests.nvidia.com/gpu": 6}


@pytest.mark.parametrize(
    ("fields", "field", "phrase"),
    [
        ({"guaranteed": 9, "max": 8}, "guaranteed", "cannot exceed max"),
        ({"guaranteed": -1}, "guaranteed", "greater than or equal to 0"),
        ({"max": 2.5}, "max", "valid integer"),
        ({"guaranteed": "four"}, "guaranteed", "valid integer"),
        ({"flavor": "h200-quantum"}, "flavor", "does not exist"),
        ({"tenant": "nobody"}, "tenant", "does not exist"),
        ({"guaranteed": 17, "max": 20}, "guaranteed", "cluster holds 16"),
        ({"fair_share_weight": 0}, "fair_share_weight", "greater than or equal to 0.01"),
    ],
)
def test_bad_quota_input_gets_400_naming_the_field(client_for, staff, tenant, h100, fields, field, phrase):
    response = _quota(client_for(staff), **fields)
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert phrase in " ".join(response.json()[field])
    assert not Quota.objects.exists()


def test_guarantees_over_capacity_are_refused_across_tenants(client_for, staff, tenant, other_tenant, h100):
    assert _quota(client_for(staff), guaranteed=12, max=16).status_code == 201
    response = _quota(client_for(staff), tenant="globex", guaranteed=5, max=5)
    assert response.status_code == 400
    assert "at most 4 can be guaranteed to globex" in response.json()["guaranteed"][0]
    assert Quota.objects.count() == 1


def test_flavors_show_resource_labels_capacity_and_price(client_for, staff, owner, inventory):
    client = client_for(staff)
    response = client.post(
        "/api/v1/flavors/", {"name": "a100-1g", "kind": "mig", "gpu_model": "A100-40GB", "mig_profile": "1g.5gb"}
    )
    assert response.status_code == 201, response.content
    assert client.post("/api/v1/flavors/a100-1g/prices/", {"price_per_hour": "0.4", "currency": "eur"}).status_code == 201
    flavor = client_for(owner).get("/api/v1/flavors/a100-1g/").json()
    assert flavor["kubernetes_resource"] == "nvidia.com/mig-1g.5gb"
    assert flavor["node_labels"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB"
    assert flavor["capacity"] == 8  # 4 GPUs, each cut 3g + 2g + 1g + 1g in the demo file
    assert flavor["price"]["currency"] == "EUR" and flavor["price"]["price_per_hour"] == "0.4000"


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"name": "x", "kind": "whole", "gpu_model": "Z80"}, "gpu_model"),
        ({"name": "x", "kind": "mig", "gpu_model": "A100-40GB", "mig_profile": "9g.99gb"}, "mig_profile"),
        ({"name": "x", "kind": "mig", "gpu_model": "T4", "mig_profile": "1g.5gb"}, "gpu_model"),
        ({"name": "x", "kind": "cloud", "gpu_model": "T4"}, "kind"),
        ({"name": "X Y", "kind": "whole", "gpu_model": "T4"}, "name"),
    ],
)
def test_bad_flavor_input_gets_400_naming_the_field(client_for, staff, payload, field):
    response = client_for(staff).post("/api/v1/flavors/", payload)
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert not ResourceFlavor.objects.exists()


def test_a_partition_profile_with_a_valid_layout_is_stored(client_for, staff):
    response = client_for(staff).post(
        "/api/v1/partition-profiles/",
        {"name": "h100-4g-3g", "gpu_model": "H100-80GB", "kind": "mig", "layout": ["4g.40gb", "3g.40gb"]},
        format="json",
    )
    assert response.status_code == 201, response.content
    assert response.json()["layout"] == ["4g.40gb", "3g.40gb"]


@pytest.mark.parametrize(
    ("payload", "field", "phrase"),
    [
        ({"gpu_model": "H100-80GB", "kind": "mig", "layout": ["4g.40gb", "4g.40gb"]}, "layout", ""),
        ({"gpu_model": "H100-80GB", "kind": "mig", "layout": ["3g.40gb"] * 3}, "layout", ""),
        ({"gpu_model": "H100-80GB", "kind": "mig", "layout": ["5g.50gb"]}, "layout", "5g.50gb"),
        ({"gpu_model": "B300", "kind": "mig", "layout": ["1g.10gb"]}, "gpu_model", "B300"),
        ({"gpu_model": "T4", "kind": "mig", "layout": ["1g.5gb"]}, "gpu_model", "does not support MIG"),
        ({"gpu_model": "T4", "kind": "timeslice", "replicas": 1}, "replicas", "between 2 and"),
        ({"gpu_model": "T4", "kind": "timeslice", "replicas": 2.5}, "replicas", "valid integer"),
        ({"gpu_model": "H100-80GB", "kind": "whole", "layout": ["1g.10gb"]}, "layout", "Only mig"),
        ({"gpu_model": "H100-80GB", "kind": "mig", "layout": []}, "layout", "needs a layout"),
    ],
)
def test_bad_partition_profiles_get_400_naming_the_field(client_for, staff, payload, field, phrase):
    response = client_for(staff).post("/api/v1/partition-profiles/", {"name": "p", **payload}, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert phrase in " ".join(response.json()[field])
    assert not PartitionProfile.objects.exists()


def test_tenants_cannot_create_profiles(client_for, owner):
    response = client_for(owner).post(
        "/api/v1/partition-profiles/", {"name": "p", "gpu_model": "T4", "kind": "timeslice", "replicas": 4}
    )
    assert response.status_code == 403


def test_a_profile_shows_the_gpu_operator_config_it_applies(client_for, staff):
    import yaml

    client = client_for(staff)
    mig_profile = client.post(
        "/api/v1/partition-profiles/",
        {"name": "h100-4g-3g", "gpu_model": "H100-80GB", "kind": "mig", "layout": ["4g.40gb", "3g.40gb"]},
        format="json",
    ).json()["gpu_operator"]
    # The preview is the rendering the apply writes: the time-slicing key and MIG Manager's last answer go.
    assert mig_profile["node_labels"] == {
        "nvidia.com/mig.config": "h100-4g-3g",
        "nvidia.com/device-plugin.config": None,
        "nvidia.com/mig.config.state": None,
    }
    parsed = yaml.safe_load(mig_profile["mig_parted_config"])
    assert parsed["mig-configs"]["h100-4g-3g"] == [
        {"devices": "all", "mig-enabled": True, "mig-devices": {"4g.40gb": 1, "3g.40gb": 1}}
    ]
    shared = client.post(
        "/api/v1/partition-profiles/", {"name": "t4-share-4", "gpu_model": "T4", "kind": "timeslice", "replicas": 4}
    ).json()["gpu_operator"]
    assert shared["node_labels"]["nvidia.com/device-plugin.config"] == "t4-share-4"
    assert yaml.safe_load(shared["device_plugin_config"])["sharing"]["timeSlicing"] == {
        "renameByDefault": True,
        "resources": [{"name": "nvidia.com/gpu", "replicas": 4}],
    }


def test_a_guarantee_can_be_lowered_after_capacity_shrank(client_for, staff, tenant, h100):
    from runners.clusters.registry import get_backend
    from runners.clusters.services import inventory_sync

    quota_id = _quota(client_for(staff), guaranteed=16, max=16).json()["id"]
    for node in ("h100-node-1", "h100-node-2"):  # every H100 node cordoned: capacity 0
        get_backend().cordon(node)
    inventory_sync()
    client = client_for(staff)
    assert client.patch(f"/api/v1/quotas/{quota_id}/", {"guaranteed": 8}).status_code == 200
    assert client.patch(f"/api/v1/quotas/{quota_id}/", {"max_priority": 50}).status_code == 200
    response = client.patch(f"/api/v1/quotas/{quota_id}/", {"guaranteed": 9})
    assert response.status_code == 400 and "cluster holds 0" in response.json()["guaranteed"][0]


def test_a_second_create_for_the_same_tenant_and_flavor_is_refused(client_for, staff, tenant, h100):
    assert _quota(client_for(staff)).status_code == 201
    response = _quota(client_for(staff), guaranteed=1, max=2)
    assert response.status_code == 400 and "PATCH it instead" in response.json()["flavor"][0]
    assert Quota.objects.get().guaranteed == 4
