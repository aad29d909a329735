"""Helpers for tests of the Kubernetes backend: API clients for the stand-in, specs, Node and Pod objects."""

from kubernetes import client

from runners.backends.base import EnvironmentSpec, MemberBinding


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
