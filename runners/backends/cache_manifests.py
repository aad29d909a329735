"""The node caches on Kubernetes, as pure functions: the cache agent per node, and the volume a tenant's pod
reads its datasets from.

The cache agent is a CSI node plugin (driver ``CSI_DRIVER``), one DaemonSet per node pool
(`cache_agent_daemonset`: the pool's cache path and size are the pod template's), in a namespace of its own
(``AGENT_NAMESPACE``): it holds the node's cache on a hostPath and publishes volumes into the kubelet's pod
folders, which takes a privileged container and Bidirectional mount propagation, and Pod Security
"restricted" (which the portal's own namespace enforces) forbids both. Beside it runs the upstream
node-driver-registrar, which registers the driver with the kubelet.

A tenant's pod asks for its datasets with a CSI ephemeral volume (`dataset_volume`): read-only, driver
``CSI_DRIVER``, its attributes naming the job and the attempt. Pod Security "restricted" allows ``csi``
volumes and forbids ``hostPath``, so the tenant's namespace keeps its profile, and the pod never names a
host path. When the kubelet mounts the volume, the agent (NodePublishVolume, with the pod's namespace and
name, as ``podInfoOnMount`` hands them) fills the cache with that attempt's blobs, pins them, and
bind-mounts, read-only, a view holding only those blobs and the datasets' manifest at the target path: the
layout of `runners.storage.nodecache`, as on the local backend. What the attempt may read is what the portal
signed into the volume's attributes for the pod's namespace (`runners.storage.cache_grants`), never the
attributes alone (a tenant may write pod specs of its own).
"""

from __future__ import annotations

from runners.backends.base import JobLaunch, PermanentBackendError
from runners.backends.manifests import MANAGED_BY, MANAGED_BY_LABEL
from runners.storage import cache_grants

CSI_DRIVER = cache_grants.CSI_DRIVER
AGENT_NAMESPACE = "gpu-portal-cache"
AGENT_NAME = "portal-cache-agent"
AGENT_SERVICE_ACCOUNT = "portal-cache-agent"
AGENT_COMMAND = ["python", "-m", "runners.workloads.cache_agent"]
REGISTRAR_IMAGE = "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.13.0"
KUBELET_DIR = "/var/lib/kubelet"
PLUGIN_DIR = f"{KUBELET_DIR}/plugins/{CSI_DRIVER}"
REGISTRATION_DIR = f"{KUBELET_DIR}/plugins_registry"
CACHE_MOUNT = "/cache"
POOL_CACHE_PATH = "/var/lib/portal-cache"  # a pool's cache on its nodes when the pool sets no path
DATASETS_VOLUME = "datasets"
DATASETS_MOUNT = "/portal/datasets"
DATASETS_MANIFEST = cache_grants.DATASETS_MANIFEST
POOL_LABEL = "portal.gpu/pool"


def agent_namespace_manifest() -> dict:
    """The agent's namespace: Pod Security "privileged", the one namespace of the portal's that is."""
    labels = {MANAGED_BY_LABEL: MANAGED_BY, "app.kubernetes.io/part-of": "gpu-portal"}
    for mode in ("enforce", "audit", "warn"):
        labels[f"pod-security.kubernetes.io/{mode}"] = "privileged"
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": AGENT_NAMESPACE, "labels": labels}}


def csi_driver_manifest() -> dict:
    """The CSIDriver: ephemeral volumes only, no attach step, the pod's identity handed to the agent."""
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "CSIDriver",
        "metadata": {"name": CSI_DRIVER, "labels": {MANAGED_BY_LABEL: MANAGED_BY}},
        "spec": {
            "attachRequired": False,
            "podInfoOnMount": True,
            "volumeLifecycleModes": ["Ephemeral"],
            "fsGroupPolicy": "None",
            "requiresRepublish": False,
        },
    }


def agent_service_account_manifest() -> dict:
    return {
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": AGENT_SERVICE_ACCOUNT, "namespace": AGENT_NAMESPACE,
                     "labels": {MANAGED_BY_LABEL: MANAGED_BY}},
        "automountServiceAccountToken": False,
    }


def _daemonset_name(pool: str) -> str:
    return f"{AGENT_NAME}-{pool}"[:63].rstrip("-")


def cache_agent_daemonset(*, pool: str, cache_path: str, capacity_bytes: int, image: str, portal_url: str,
                          token_secret: str = "portal-cache-agent", pool_label: str = POOL_LABEL) -> dict:
    """The cache agent of one node pool: on every node labelled with the pool, the cache at `cache_path` (a
    hostPath, local NVMe in production) of at most `capacity_bytes`, and the CSI socket the kubelet calls."""
    labels = {"app.kubernetes.io/name": AGENT_NAME, "portal.gpu/pool": pool, MANAGED_BY_LABEL: MANAGED_BY}
    path = cache_path or POOL_CACHE_PATH
    agent = {
        "name": "agent",
        "image": image,
        "command": [*AGENT_COMMAND, "--csi-socket", "/csi/csi.sock", "--cache", CACHE_MOUNT,
                    "--capacity-bytes", str(int(capacity_bytes)), "--node", "$(NODE_NAME)"],
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "PORTAL_URL", "value": portal_url},
            # The agents' token: the key of the grants it checks, and what it reports its cache to the portal with.
            {"name": "PORTAL_AGENT_TOKEN", "valueFrom": {"secretKeyRef": {"name": token_secret, "key": "token"}}},
            # The blob store it fills the cache from: {"url": DATA_STORAGE_URL, "options": DATA_STORAGE_OPTIONS}.
            {"name": "PORTAL_DATA_STORAGE", "valueFrom": {"secretKeyRef": {"name": token_secret, "key": "storage"}}},
        ],
        # Publishing a volume is a mount into the kubelet's pod folder: privileged, Bidirectional propagation.
        "securityContext": {"privileged": True, "readOnlyRootFilesystem": True},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": [
            {"name": "plugin", "mountPath": "/csi"},
            {"name": "pods", "mountPath": f"{KUBELET_DIR}/pods", "mountPropagation": "Bidirectional"},
            {"name": "cache", "mountPath": CACHE_MOUNT},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    registrar = {
        "name": "node-driver-registrar",
        "image": REGISTRAR_IMAGE,
        "args": ["--csi-address=/csi/csi.sock", f"--kubelet-registration-path={PLUGIN_DIR}/csi.sock"],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
        "volumeMounts": [
            {"name": "plugin", "mountPath": "/csi"},
            {"name": "registration", "mountPath": "/registration"},
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": _daemonset_name(pool), "namespace": AGENT_NAMESPACE, "labels": labels},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": AGENT_NAME, "portal.gpu/pool": pool}},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": AGENT_SERVICE_ACCOUNT,
                    "automountServiceAccountToken": False,
                    "nodeSelector": {pool_label: pool},
                    # GPU nodes are tainted for GPU work; the agent must run on them all the same.
                    "tolerations": [{"operator": "Exists"}],
                    "priorityClassName": "system-node-critical",
                    "containers": [agent, registrar],
                    "volumes": [
                        {"name": "plugin", "hostPath": {"path": PLUGIN_DIR, "type": "DirectoryOrCreate"}},
                        {"name": "registration", "hostPath": {"path": REGISTRATION_DIR, "type": "Directory"}},
                        {"name": "pods", "hostPath": {"path": f"{KUBELET_DIR}/pods", "type": "Directory"}},
                        {"name": "cache", "hostPath": {"path": path, "type": "DirectoryOrCreate"}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                },
            },
        },
    }


def cache_agent_manifests(pools: list[tuple[str, str, int]], *, image: str, portal_url: str) -> list[dict]:
    """Everything the caches need on a cluster, in the order it is applied: the namespace, the CSIDriver, the
    agent's account, and one DaemonSet per pool ((name, cache path, capacity in bytes))."""
    return [
        agent_namespace_manifest(), csi_driver_manifest(), agent_service_account_manifest(),
        *(cache_agent_daemonset(pool=name, cache_path=path, capacity_bytes=size, image=image, portal_url=portal_url)
          for name, path, size in pools),
    ]


def dataset_volume(launch: JobLaunch, grant_key: bytes = b"") -> tuple[dict, dict, dict] | None:
    """A pod's datasets (and a serving replica's weights): the CSI ephemeral volume, its read-only mount and the
    PORTAL_DATASETS variable; None when the launch reads no blob. The volume's attributes are the attempt's
    grant, signed with `grant_key` for the launch's namespace (`runners.storage.cache_grants`)."""
    weights = launch.serving.weights if launch.serving is not None else None
    if not launch.datasets and weights is None:
        return None
    if not grant_key:
        raise PermanentBackendError(
            "The job reads datasets from the node cache, and the portal has no cache agent token (CACHE_AGENT_TOKEN) "
            "to sign what its pods may read; set it to the token of the Secret portal-cache-agent.")
    attributes = cache_grants.sign(
        grant_key, namespace=launch.namespace, job=launch.job_id, attempt=launch.attempt, mount=DATASETS_MOUNT,
        datasets=[(mount.name, mount.version, [(shard.sha256, shard.bytes) for shard in mount.shards])
                  for mount in launch.datasets],
        weights=(weights.sha256, weights.bytes) if weights is not None else None,
    )
    volume = {
        "name": DATASETS_VOLUME,
        # The agent fills and publishes only what the grant names, and only for a pod of the launch's namespace.
        "csi": {"driver": CSI_DRIVER, "readOnly": True, "volumeAttributes": attributes},
    }
    mount = {"name": DATASETS_VOLUME, "mountPath": DATASETS_MOUNT, "readOnly": True}
    variable = {"name": "PORTAL_DATASETS", "value": f"{DATASETS_MOUNT}/{DATASETS_MANIFEST}"}
    return volume, mount, variable
