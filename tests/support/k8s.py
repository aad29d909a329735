"""Helpers for tests of the Kubernetes backend: API clients for the stand-in, specs, Node and Pod objects (training replicas too)."""

import json

from kubernetes import client

from runners.backends.base import EnvironmentSpec, MemberBinding
from runners.backends.job_manifests import ATTEMPT_LABEL, COMPLETION_INDEX_ANNOTATION, JOB_LABEL, PLACEMENT_ANNOTATION


def client_for(url: str) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = url
    return client.ApiClient(configuration)


def make_spec(**overrides) -> EnvironmentSpec:
    """An environment with an owner, a member and a viewer, and two GPUs."""
    values = dict(
        environment_id=7,
        tenant_slug="acme",
        name="Vision research",
        namespace="acme-vision",
        members=(MemberBinding("olivia", "owner"), MemberBinding("tom", "member"), MemberBinding("vera", "viewer")),
        quota_hard={"requests.nvidia.com/gpu": 2},
    )
    values.update(overrides)
    return EnvironmentSpec(**values)


def gpu_node(name, *, pool="h100-pool", rack="rack-a"):
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "nvidia.com/gpu.count": "8",
                "nvidia.com/gpu.memory": "81559",
                "portal.gpu/node-pool": pool,
                "topology.portal.gpu/rack": rack,
            },
        },
        "spec": {},
        "status": {"allocatable": {"cpu": "192", "memory": "2Ti", "nvidia.com/gpu": "8"}},
    }


def portal_pod(name, node, namespace="acme-train", phase="Running"):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "gpu-portal"}},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "trainer"}]},
        "status": {"phase": phase},
    }


def training_pod(job_id: int, attempt: int, rank: int, node: str | None, namespace="acme-train",
                 scheduler_name="gpu-portal"):
    """A replica's pod as the Job controller makes it from the portal's template; running on `node`, or Pending unbound."""
    spec = {"schedulerName": scheduler_name, "containers": [{"name": "trainer", "image": "trainer"}]}
    status = {"phase": "Pending"}
    if node:
        spec["nodeName"] = node
        status = {"phase": "Running",
                  "containerStatuses": [{"name": "trainer", "ready": True, "state": {"running": {}}}]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"job-{job_id}-{attempt}-{rank}-pod",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "gpu-portal", JOB_LABEL: str(job_id),
                       ATTEMPT_LABEL: str(attempt), COMPLETION_INDEX_ANNOTATION: str(rank)},
            "annotations": {COMPLETION_INDEX_ANNOTATION: str(rank),
                            PLACEMENT_ANNOTATION: json.dumps({str(rank): node or "gpu-a"})},
        },
        "spec": spec,
        "status": status,
    }
