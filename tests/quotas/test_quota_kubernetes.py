"""A quota change reaches the ResourceQuota of every environment of the tenant, on Kubernetes."""

import kubernetes_validate
import pytest

from quotas import services as quota_services
from runners.environments import services as environments
from runners.environments.models import Environment
from tests.support.k8s import gpu_node

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]


def test_a_quota_change_reaches_each_environments_resource_quota(kubernetes_cluster, staff, owner, tenant, flavor_factory):
    from runners.clusters.services import inventory_sync

    kubernetes_cluster.put(gpu_node("gpu-1"))
    inventory_sync()
    flavor = flavor_factory()
    created = [
        environments.environment_request(actor=owner, tenant=tenant, name=name) for name in ("train", "serve")
    ]
    for environment in created:
        assert environments.environment_provision_run(environment_id=environment.id) == "ready"
        quota = kubernetes_cluster.get("resourcequotas", "gpu-quota", environment.namespace)
        assert quota["spec"]["hard"]["requests.nvidia.com/gpu"] == "0", "no quota yet: no GPUs"

    quota_services.quota_set(actor=staff, tenant=tenant, flavor=flavor, guaranteed=2, max=6)
    # What the workers do after commit: resync every ready environment.
    for environment_id in Environment.objects.filter(tenant=tenant, state="ready").values_list("id", flat=True):
        assert environments.environment_sync_run(environment_id=environment_id)

    for environment in created:
        quota = kubernetes_cluster.get("resourcequotas", "gpu-quota", environment.namespace)
        assert quota["spec"]["hard"]["requests.nvidia.com/gpu"] == "6"
        sent = {key: value for key, value in quota.items() if key != "status"}
        for drop in ("uid", "resourceVersion", "creationTimestamp", "managedFields"):
            sent["metadata"].pop(drop, None)
        for version in ("1.30.0", kubernetes_validate.utils.latest_version()):
            kubernetes_validate.validate(sent, version, strict=True)
