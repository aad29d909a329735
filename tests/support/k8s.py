"""Helpers for tests of the Kubernetes backend: API clients for the stand-in, specs, Node and Pod objects (training replicas too)."""

import base64
import functools
import json
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import yaml
from kubernetes import client

from runners.backends.base import EnvironmentSpec, MemberBinding
from runners.backends.job_manifests import ATTEMPT_LABEL, COMPLETION_INDEX_ANNOTATION, JOB_LABEL, PLACEMENT_ANNOTATION


def client_for(url: str, *, token: str = "") -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = url
    if token:
        configuration.api_key = {"authorization": token}
        configuration.api_key_prefix = {"authorization": "Bearer"}
    return client.ApiClient(configuration)


def portal_kubeconfig(api, *, token: str = "standin-token") -> str:
    """The portal's own kubeconfig for the stand-in: its URL, its CA when it serves TLS, an admin token."""
    cluster = {"server": api.url}
    if api.ca_pem:
        cluster["certificate-authority-data"] = base64.b64encode(api.ca_pem).decode()
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "standin",
        "clusters": [{"name": "standin", "cluster": cluster}],
        "users": [{"name": "portal", "user": {"token": token}}],
        "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "portal"}}],
    })


RBAC_KINDS = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


@functools.cache
def _rendered_rbac(overlay: str) -> tuple[str, ...]:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(["kubectl", "kustomize", str(root / "deploy" / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=120, check=True)
    return tuple(json.dumps(obj) for obj in yaml.safe_load_all(out.stdout) if obj and obj.get("kind") in RBAC_KINDS)


def deploy_rbac(overlay: str = "default") -> list[dict]:
    """The RBAC objects of deploy/ as an operator renders them (kubectl's built-in kustomize, as
    `make deploy-render` and tests/deploy/ do): what the portal's own ServiceAccount may do."""
    return [json.loads(text) for text in _rendered_rbac(overlay)]


@contextmanager
def portal_on_standin(settings, folder: Path, **standin_options):
    """CLUSTER_BACKEND=kubernetes against a stand-in (HTTPS unless told otherwise, since kubectl sends a
    token only over TLS), through a kubeconfig holding its CA, as an operator would configure the portal."""
    from runners.clusters.registry import get_backend
    from tests.support.k8s_standin import KubernetesStandIn

    defaults = {"tls": True, "termination_delay_s": 0.1, "admin_tokens": {"standin-token"}, "portal_rbac": deploy_rbac(),
                "watch_hold_s": 0.1}
    with KubernetesStandIn(**(defaults | standin_options)) as api:
        kubeconfig = folder / "portal-kubeconfig"
        kubeconfig.write_text(portal_kubeconfig(api))
        settings.CLUSTER_BACKEND = "kubernetes"
        settings.KUBECONFIG = str(kubeconfig)
        get_backend.cache_clear()
        yield api
        get_backend.cache_clear()


def kubectl(kubeconfig: Path, *args: str, home: Path) -> subprocess.CompletedProcess:
    """Run Debian's real kubectl with only this kubeconfig (its discovery cache under `home`)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
    return subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig), "--request-timeout=20s", *args],
                          capture_output=True, text=True, timeout=60, env=env)


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
                  "containerStatuses": [{"name": "trainer", "ready": True, "restartCount": 0, "image": "trainer",
                                         "imageID": "", "state": {"running": {}}}]}
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


def pods_by_rank(api, job_id: int = 41, attempt: int = 1, *, namespace: str = "acme-train") -> dict[int, dict]:
    """An attempt's pods on the stand-in, by rank (their completion index); job 41's first attempt in
    acme-train unless told, as the backend tests launch it."""
    pods = api.pods(namespace, **{JOB_LABEL: str(job_id), ATTEMPT_LABEL: str(attempt)})
    return {int(pod["metadata"]["annotations"][COMPLETION_INDEX_ANNOTATION]): pod for pod in pods}


def job_pods(api, job, attempt: int = 1) -> dict[int, dict]:
    """A portal job's attempt's pods on the stand-in, by rank, in its environment's namespace."""
    return pods_by_rank(api, job.id, attempt, namespace=job.environment.namespace)


def api_call(api, method: str, path: str, body: dict | None = None, *, content_type: str = "application/json",
             token: str = "") -> tuple[int, dict | str]:
    """One raw HTTP request to the stand-in: (status, the JSON body, or the text where it is not JSON)."""
    import ssl
    import urllib.error
    import urllib.request

    request = urllib.request.Request(api.url + path, method=method,
                                     data=None if body is None else json.dumps(body).encode())
    if body is not None:
        request.add_header("Content-Type", content_type)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    context = ssl.create_default_context(cadata=api.ca_pem.decode()) if api.ca_pem else None
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, payload = error.code, error.read()
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode()


def environment_namespace(api, namespace: str) -> None:
    """An environment's namespace as the portal leaves it for workloads: the namespace and the ServiceAccount
    its pods run as (the ServiceAccount admission plugin refuses pods whose account does not exist)."""
    from runners.backends.manifests import WORKLOAD_SERVICE_ACCOUNT

    api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    api.put({"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": WORKLOAD_SERVICE_ACCOUNT, "namespace": namespace}})
