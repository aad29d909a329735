"""A replica serving a model version on Kubernetes: its weights from the node cache's CSI volume where the cluster
runs the cache agents, else fetched by an init container through the portal's signed URL into an emptyDir; both
validated strictly for 1.30 and the newest schema, within Pod Security "restricted"."""

import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from runners.backends.base import JobLaunch, PermanentBackendError, ReplicaPlacement, ServingSettings, ShardRef
from runners.backends.cache_manifests import CSI_DRIVER
from runners.backends.serve_manifests import serve_manifests, serving_deployment_manifest
from runners.nvidia import names
from runners.storage import cache_grants

pytestmark = pytest.mark.unit

SHA = "ab" * 32
URL = "https://portal.example.com/models/fetch/token/"
KEY = cache_grants.grant_key("agents-token")
OPTIONS = dict(server_image="registry.example/portal/portal:1", scheduler_name="gpu-portal")


def make_launch(fetch_url=URL) -> JobLaunch:
    return JobLaunch(
        job_id=21, attempt=2, tenant_slug="acme", namespace="acme--serve", name="chat-g1-r0", template="serve",
        replicas=(ReplicaPlacement(0, "gpu-2", (5,)),), gpu_resource=names.GPU_RESOURCE, gpus_per_replica=1,
        cpu_milli_per_replica=2000, memory_mib_per_replica=8192, steps=1, checkpoint_every_steps=0,
        max_runtime_s=86400, grace_period_s=60,
        serving=ServingSettings(endpoint_id=3, checkpoint="", weights=ShardRef(SHA, 300 << 20, fetch_url)),
    )


@pytest.mark.parametrize("version", ["1.30.0", latest_version()])
@pytest.mark.parametrize("key", [b"", KEY], ids=["fetched", "node-cache"])
def test_both_ways_validate_strictly(version, key):
    for manifest in serve_manifests(make_launch(), cache_grant_key=key, **OPTIONS):
        kubernetes_validate.validate(manifest, version, strict=True)


def _restricted(pod: dict) -> None:
    """What Pod Security "restricted" asks of every container, and no volume it forbids."""
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod.get("initContainers", []) + pod["containers"]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
    for volume in pod["volumes"]:
        assert set(volume) - {"name"} <= {"emptyDir", "csi", "persistentVolumeClaim"}, volume


def test_without_the_cache_agents_an_init_container_fetches_the_checked_weights_into_an_emptydir():
    pod = serving_deployment_manifest(make_launch(), **OPTIONS)["spec"]["template"]["spec"]
    _restricted(pod)
    [fetch] = pod["initContainers"]
    assert fetch["command"] == ["python", "-m", "runners.workloads.fetch_weights", URL, f"/weights/{SHA}",
                                "--sha256", SHA, "--bytes", str(300 << 20)]
    assert fetch["image"] == OPTIONS["server_image"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["weights"] == {"name": "weights", "emptyDir": {"sizeLimit": "364Mi"}}
    [server] = pod["containers"]
    assert server["args"][:2] == ["--checkpoint", f"/weights/{SHA}"]
    assert {"name": "weights", "mountPath": "/weights", "readOnly": True} in server["volumeMounts"]
    assert "checkpoints" not in volumes  # no job's claim: the version's own weights only


def test_with_the_cache_agents_the_server_reads_the_node_caches_read_only_volume_granted_for_the_weights():
    pod = serving_deployment_manifest(make_launch(), cache_grant_key=KEY, **OPTIONS)["spec"]["template"]["spec"]
    _restricted(pod)
    assert "initContainers" not in pod
    volume = next(volume for volume in pod["volumes"] if "csi" in volume)
    assert volume["csi"]["driver"] == CSI_DRIVER and volume["csi"]["readOnly"] is True
    # What the agent checks: the portal's grant for this namespace, naming the weights and no dataset.
    grant = cache_grants.verify(KEY, {**volume["csi"]["volumeAttributes"], cache_grants.POD_NAMESPACE: "acme--serve"})
    assert grant.weights == cache_grants.Shard(SHA, 300 << 20) and grant.datasets == ()
    [server] = pod["containers"]
    assert server["args"][:2] == ["--checkpoint", f"/portal/datasets/{SHA}"]


def test_a_launch_without_a_signed_url_and_without_the_cache_agents_is_refused_saying_what_to_set():
    with pytest.raises(PermanentBackendError, match="PORTAL_PUBLIC_URL"):
        serving_deployment_manifest(make_launch(fetch_url=""), **OPTIONS)
