"""The node caches on Kubernetes: the cache agent's objects and a tenant pod's dataset volume, validated strictly
for 1.30 and the newest schema; the tenant's pod stays within Pod Security "restricted" and names no host path."""

import dataclasses
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from runners.backends import cache_manifests
from runners.backends.base import BundleRef, DatasetMount, PermanentBackendError, ShardRef
from runners.backends.job_manifests import training_job_manifest
from runners.storage import cache_grants
from tests.backends.test_job_manifests import OPTIONS, make_launch
from tests.deploy.test_deploy import pss_violations

pytestmark = pytest.mark.unit

KUBERNETES_VERSIONS = ("1.30.0", latest_version())
ROOT = Path(__file__).resolve().parents[2]
IMAGE = "ghcr.io/example/gpu-portal:latest"
PORTAL_URL = "http://gpu-portal-web.gpu-portal.svc:8000"
SHARD = ShardRef("ab" * 32, 4096)
GRANT_KEY = cache_grants.grant_key("agent-token")
GRANTED = {**OPTIONS, "cache_grant_key": GRANT_KEY}


def _with_datasets(**overrides):
    bundle = BundleRef("cd" * 32, "s3://bundles/cd", fetch_url="https://portal.example/api/v1/bundle-fetch/x")
    return dataclasses.replace(make_launch(template="script", image="python:3.11", command=("python", "t.py"),
                                           bundle=bundle, **overrides),
                               datasets=(DatasetMount("corpus", 2, (SHARD,)),))


def _agent_objects():
    return cache_manifests.cache_agent_manifests([("a100", "/mnt/nvme/cache", 500 * 1024**3), ("t4", "", 10**11)],
                                                 image=IMAGE, portal_url=PORTAL_URL)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_cache_object_validates_strictly(version):
    for manifest in [*_agent_objects(), training_job_manifest(_with_datasets(), **GRANTED)]:
        kubernetes_validate.validate(manifest, version, strict=True)


def test_a_tenants_pod_reads_its_datasets_from_a_read_only_csi_volume_within_restricted():
    pod = training_job_manifest(_with_datasets(), **GRANTED)["spec"]["template"]["spec"]
    assert pss_violations(pod) == []
    assert not any("hostPath" in volume for volume in pod["volumes"])
    (volume,) = [volume for volume in pod["volumes"] if volume["name"] == cache_manifests.DATASETS_VOLUME]
    assert volume["csi"]["driver"] == cache_manifests.CSI_DRIVER and volume["csi"]["readOnly"] is True
    # The attributes are the attempt's grant, signed for its namespace: what the agent checks before it publishes.
    grant = cache_grants.verify(GRANT_KEY, {**volume["csi"]["volumeAttributes"], cache_grants.POD_NAMESPACE: "acme--train"})
    assert (grant.job, grant.attempt, grant.mount) == (7, 2, cache_manifests.DATASETS_MOUNT)
    assert grant.datasets == (cache_grants.DatasetGrant("corpus", 2, (cache_grants.Shard(SHARD.sha256, SHARD.bytes),)),)
    with pytest.raises(cache_grants.GrantRefused):
        cache_grants.verify(GRANT_KEY, {**volume["csi"]["volumeAttributes"], cache_grants.POD_NAMESPACE: "other--ns"})
    container = pod["containers"][0]
    assert {"name": cache_manifests.DATASETS_VOLUME, "mountPath": cache_manifests.DATASETS_MOUNT,
            "readOnly": True} in container["volumeMounts"]
    assert {"name": "PORTAL_DATASETS", "value": "/portal/datasets/datasets.json"} in container["env"]


def test_a_job_reading_datasets_is_refused_at_launch_when_the_portal_has_no_agent_token_to_sign_with():
    with pytest.raises(PermanentBackendError, match="CACHE_AGENT_TOKEN"):
        training_job_manifest(_with_datasets(), **OPTIONS)


def test_a_pod_that_reads_no_dataset_has_no_cache_volume():
    pod = training_job_manifest(make_launch(), **OPTIONS)["spec"]["template"]["spec"]
    assert all(volume["name"] != cache_manifests.DATASETS_VOLUME for volume in pod["volumes"])


def test_each_pool_gets_an_agent_on_its_own_nodes_with_its_cache_path_and_size():
    daemonsets = [item for item in _agent_objects() if item["kind"] == "DaemonSet"]
    found = {}
    for daemonset in daemonsets:
        spec = daemonset["spec"]["template"]["spec"]
        cache = next(volume for volume in spec["volumes"] if volume["name"] == "cache")
        command = spec["containers"][0]["command"]
        found[spec["nodeSelector"][cache_manifests.POOL_LABEL]] = (
            cache["hostPath"]["path"], command[command.index("--capacity-bytes") + 1])
        assert daemonset["metadata"]["namespace"] == cache_manifests.AGENT_NAMESPACE
    assert found == {"a100": ("/mnt/nvme/cache", str(500 * 1024**3)), "t4": (cache_manifests.POOL_CACHE_PATH, str(10**11))}
    namespace = _agent_objects()[0]
    # The agent's namespace is privileged (it mounts into the kubelet's pod folders); no tenant's is.
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    csi_driver = _agent_objects()[1]
    assert csi_driver["spec"]["volumeLifecycleModes"] == ["Ephemeral"] and csi_driver["spec"]["podInfoOnMount"]


def test_the_deploy_folder_is_what_the_builder_renders():
    shipped = [item for item in yaml.safe_load_all((ROOT / "deploy" / "cache-agent" / "cache-agent.yaml").read_text())]
    assert shipped == cache_manifests.cache_agent_manifests(
        [("default", "", 200 * 1024**3)], image=IMAGE, portal_url=PORTAL_URL)
