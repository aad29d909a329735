"""A replica serving a model version, launched through the Kubernetes backend against the stand-in (which checks
every body strictly and enforces Pod Security "restricted" in the tenant's namespace): its Deployment's pod
fetches the weights through the signed URL, or reads the node cache's volume where the portal holds the cache
agents' token, and is bound where the portal placed it."""

import pytest

from runners.backends.base import ServingSettings, ShardRef
from runners.backends.manifests import WORKLOAD_SERVICE_ACCOUNT
from tests.backends.test_kubernetes_serving import NAMESPACE, launched, make_launch, replica_pods
from tests.support.k8s import gpu_node

pytestmark = pytest.mark.e2e

SHA = "ef" * 32
URL = "https://portal.example.com/models/fetch/token/"


def restricted(api):
    """The tenant's namespace enforcing Pod Security "restricted", as the portal provisions it."""
    for node in ("gpu-a", "gpu-b"):
        api.put(gpu_node(node))
    api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": NAMESPACE, "labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
    api.put({"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": WORKLOAD_SERVICE_ACCOUNT, "namespace": NAMESPACE}})
    api.sigterm_exit_code = 0
    return api


def version_launch():
    return make_launch(serving=ServingSettings(endpoint_id=3, checkpoint="", weights=ShardRef(SHA, 4096, URL)))


def test_a_replica_fetches_its_versions_weights_in_an_init_container_and_is_bound(make_backend, standin):
    api = restricted(standin)
    backend = make_backend()
    launched(backend, api, version_launch())
    [pod] = replica_pods(api)
    assert pod["spec"]["nodeName"] == "gpu-b"
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["fetch-weights"]
    assert pod["spec"]["containers"][0]["args"][:2] == ["--checkpoint", f"/weights/{SHA}"]
    # No job's claim is made or mounted: the replica reads the version's own weights.
    assert not [name for plural, namespace, name in api.objects()
                if plural == "persistentvolumeclaims" and namespace == NAMESPACE]


def test_where_the_cache_agents_run_the_replica_reads_the_node_caches_volume(make_backend, standin):
    api = restricted(standin)
    backend = make_backend(cache_agent_token="agents-token")
    launched(backend, api, version_launch())
    [pod] = replica_pods(api)
    assert "initContainers" not in pod["spec"]
    assert any("csi" in volume for volume in pod["spec"]["volumes"])
    assert pod["spec"]["containers"][0]["args"][:2] == ["--checkpoint", f"/portal/datasets/{SHA}"]
