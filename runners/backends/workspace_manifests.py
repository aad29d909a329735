"""The Kubernetes objects one workspace (a job of kind "workspace") is made of, as pure functions of its JobLaunch.

The Kubernetes backend applies them; the tests check every one with kubernetes-validate, strictly, for 1.30 and
the newest schema, and the pod against Pod Security "restricted".

- a PersistentVolumeClaim per workspace for its home folder (`home_claim_manifest`): named from the workspace's
  home (``<tenant>/<id>`` -> ``workspace-<id>-home``), created at its first start and kept across its stops and
  starts; it goes only when the workspace is deleted (`KubernetesBackend.delete_workspace_home`). ReadWriteOnce:
  one pod at a time mounts it.
- a NetworkPolicy per workspace (`workspace_network_policy_manifest`): its pods take traffic from the portal's
  namespace alone (the edge, and the reconcile's probes), on WORKSPACE_PORT alone; they may reach the
  namespace's other pods (and DNS, through the environment's own policy). The environment's same-namespace
  policy leaves workspaces' pods out (`manifests.same_namespace_policy_spec`), so nothing else reaches them.
- a Deployment per attempt, one pod (`workspace_deployment_manifest`), as an inference replica is one: the pod
  names the portal's scheduler and carries its placement (rank 0 -> node), the backend binds it where the portal
  placed it, with the flavor's resources (requests equal limits) and the portal's security context.
- a Secret per attempt holding the workspace's key (`key_secret_manifest`), new at every start: the container
  reads it as PORTAL_WORKSPACE_KEY through a secretKeyRef, so the key is never in the pod spec. Immutable;
  owned by the attempt's Deployment, so the garbage collector removes it should the Deployment go without it.

What the pod runs is the portal's choice alone: ``python -m runners.workloads.workspace`` (JupyterLab on
WORKSPACE_PORT, under the workspace's base URL, its home the claim's mount) from the environment's workspace
image, or the portal's own. Nothing of the launch's variables or command reaches the pod spec. The pod is ready
while the port takes connections (a tcpSocket probe: JupyterLab answers no HTTP request without the key).
A stop is SIGTERM: JupyterLab tells whoever is connected, serves them for the grace period
(terminationGracePeriodSeconds) and exits 0.
"""

from __future__ import annotations

import base64
import re

from runners.backends.base import JobLaunch, PermanentBackendError
from runners.backends.job_manifests import (
    CONTAINER_SECURITY_CONTEXT,
    POD_SECURITY_CONTEXT,
    SCRATCH_MOUNT,
    SCRATCH_VARIABLES,
    SCRATCH_VOLUME,
    attempt_labels,
    job_name,
    replica_resources,
)
from runners.backends.manifests import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    TENANT_LABEL,
    WORKSPACE_LABEL,
    WORKSPACE_PORT,
)
from runners.backends.serve_manifests import SERVER_CONTAINER, one_pod_deployment

WORKSPACE_COMMAND = ["python", "-m", "runners.workloads.workspace"]
# The workspace's home folder: its claim, mounted here; $HOME, JupyterLab's root and the working directory.
HOME_VOLUME = "home"
HOME_MOUNT = "/home/workspace"
# What a new home claim asks for.
HOME_SIZE = "10Gi"
# runners/workloads/workspace.py reads the key from this variable (it runs without the rest of the repository,
# so the name is spelled there too; tests/backends/test_workspace_manifests.py holds the two equal).
KEY_VARIABLE = "PORTAL_WORKSPACE_KEY"
# The Secret's one key.
KEY_FIELD = "key"
# Jupyter's runtime files (its notices, kernels' connection files): on the pod's scratch volume, not the claim.
RUNTIME_DIR = f"{SCRATCH_MOUNT}/jupyter-runtime"
PORT_NAME = "jupyter"
# The portal's namespace, as the label Kubernetes puts on every namespace names it.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"

_HOME = re.compile(r"(?P<tenant>[a-z0-9]([-a-z0-9]*[a-z0-9])?)/(?P<id>[1-9][0-9]*)")


def parse_home(home: str) -> tuple[str, int]:
    """(tenant slug, workspace id) of a workspace's home, ``<tenant>/<id>``; anything else is refused."""
    match = _HOME.fullmatch(home or "")
    if match is None or len(match["tenant"]) > 63:
        raise PermanentBackendError(f"Not a workspace's home: {home!r}.")
    return match["tenant"], int(match["id"])


def home_claim_name(home: str) -> str:
    """The claim a workspace's home folder is: ``workspace-<id>-home`` (ids are unique across tenants)."""
    return f"workspace-{parse_home(home)[1]}-home"


def workspace_policy_name(workspace_id: int) -> str:
    return f"workspace-{workspace_id}"


def key_secret_name(job_id: int, attempt: int) -> str:
    """The Secret of an attempt's key: ``job-<id>-<attempt>-workspace-key``."""
    return f"job-{job_id}-{attempt}-workspace-key"


def workspace_labels(*, tenant_slug: str, workspace_id: int) -> dict[str, str]:
    """What the workspace's own objects (claim, policy) carry; delete_workspace_home finds them by these."""
    return {MANAGED_BY_LABEL: MANAGED_BY, TENANT_LABEL: tenant_slug, WORKSPACE_LABEL: str(workspace_id)}


def workspace_selector(home: str) -> str:
    """The label selector of a workspace's own objects, from its home."""
    tenant, workspace_id = parse_home(home)
    return ",".join(f"{key}={value}" for key, value in
                    workspace_labels(tenant_slug=tenant, workspace_id=workspace_id).items())


def _checked(launch: JobLaunch) -> None:
    """A workspace launch the manifests can be built from: one replica, its home the tenant's and the workspace's."""
    workspace = launch.workspace
    if workspace is None:
        raise PermanentBackendError(f"Job {launch.job_id} is not a workspace.")
    if len(launch.replicas) != 1 or launch.replicas[0].rank != 0:
        raise PermanentBackendError(f"A workspace is one pod; job {launch.job_id} was placed as {len(launch.replicas)}.")
    tenant, workspace_id = parse_home(workspace.home)
    if (tenant, workspace_id) != (launch.tenant_slug, workspace.workspace_id):
        raise PermanentBackendError(f"Workspace {workspace.workspace_id} of {launch.tenant_slug} names the home "
                                    f"{workspace.home!r}, which is not its own.")
    if not workspace.key:
        raise PermanentBackendError(f"Workspace {workspace.workspace_id} has no key: it never runs without one.")


def _pod_labels(launch: JobLaunch) -> dict[str, str]:
    return {**attempt_labels(launch), WORKSPACE_LABEL: str(launch.workspace.workspace_id)}


def home_claim_manifest(launch: JobLaunch, *, storage_class: str = "", size: str = HOME_SIZE) -> dict:
    """The workspace's home claim. ``storage_class`` "": the cluster's default class."""
    _checked(launch)
    workspace = launch.workspace
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": home_claim_name(workspace.home), "namespace": launch.namespace,
            "labels": workspace_labels(tenant_slug=launch.tenant_slug, workspace_id=workspace.workspace_id),
        },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": size}},
            **({"storageClassName": storage_class} if storage_class else {}),
        },
    }


def workspace_network_policy_manifest(launch: JobLaunch, *, portal_namespace: str) -> dict:
    """The workspace's NetworkPolicy: in, the portal's namespace on WORKSPACE_PORT only; out, the namespace's pods."""
    _checked(launch)
    if not portal_namespace:
        raise PermanentBackendError("A workspace is reached from the portal's namespace, and none is set "
                                    "(KUBERNETES_PORTAL_NAMESPACE).")
    workspace_id = launch.workspace.workspace_id
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": workspace_policy_name(workspace_id), "namespace": launch.namespace,
            "labels": workspace_labels(tenant_slug=launch.tenant_slug, workspace_id=workspace_id),
        },
        "spec": {
            "podSelector": {"matchLabels": {MANAGED_BY_LABEL: MANAGED_BY, WORKSPACE_LABEL: str(workspace_id)}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{
                "from": [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: portal_namespace}}}],
                "ports": [{"protocol": "TCP", "port": WORKSPACE_PORT}],
            }],
            "egress": [{"to": [{"podSelector": {}}]}],
        },
    }


def key_secret_manifest(launch: JobLaunch, *, owner: dict | None = None) -> dict:
    """The attempt's key, as an immutable Opaque Secret; ``owner``: the attempt's Deployment as the API server
    answered it (its name and uid), which the Secret is then a dependent of."""
    _checked(launch)
    metadata: dict = {"name": key_secret_name(launch.job_id, launch.attempt), "namespace": launch.namespace,
                      "labels": _pod_labels(launch)}
    if owner is not None:
        metadata["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"]}]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "Opaque",
        "immutable": True,
        "data": {KEY_FIELD: base64.b64encode(launch.workspace.key.encode()).decode()},
    }


def workspace_container(launch: JobLaunch, *, image: str) -> dict:
    """JupyterLab: its flags from the launch, its key from the attempt's Secret, its home the claim."""
    workspace = launch.workspace
    variables = {**SCRATCH_VARIABLES, "HOME": HOME_MOUNT, "JUPYTER_RUNTIME_DIR": RUNTIME_DIR}
    resources = replica_resources(launch)
    return {
        "name": SERVER_CONTAINER,
        "image": image,
        "command": list(WORKSPACE_COMMAND),
        "args": ["--port", str(WORKSPACE_PORT), "--base-url", workspace.base_url, "--home", HOME_MOUNT,
                 "--grace-s", str(launch.grace_period_s)],
        "workingDir": HOME_MOUNT,
        "env": [
            {"name": "PORTAL_ATTEMPT", "value": str(launch.attempt)},
            {"name": "PORTAL_JOB", "value": str(launch.job_id)},
            *({"name": key, "value": value} for key, value in variables.items()),
            {"name": KEY_VARIABLE, "valueFrom": {"secretKeyRef": {
                "name": key_secret_name(launch.job_id, launch.attempt), "key": KEY_FIELD}}},
        ],
        "ports": [{"name": PORT_NAME, "containerPort": WORKSPACE_PORT, "protocol": "TCP"}],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": [
            {"name": HOME_VOLUME, "mountPath": HOME_MOUNT},
            {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_MOUNT},
        ],
        # A connection, not a request: JupyterLab refuses every request that lacks the key.
        "readinessProbe": {"tcpSocket": {"port": PORT_NAME}, "periodSeconds": 2, "failureThreshold": 1,
                           "timeoutSeconds": 2},
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
    }


def workspace_deployment_manifest(launch: JobLaunch, *, image: str, scheduler_name: str) -> dict:
    """The Deployment of one workspace attempt: one pod, bound where the portal placed it (as a replica's).

    ``image``: the environment's workspace image where the launch names one, else the portal's own.
    """
    _checked(launch)
    workspace = launch.workspace
    return one_pod_deployment(
        launch, name=job_name(launch), selector=attempt_labels(launch), pod_labels=_pod_labels(launch),
        scheduler_name=scheduler_name, containers=[workspace_container(launch, image=workspace.image or image)],
        volumes=[{"name": HOME_VOLUME, "persistentVolumeClaim": {"claimName": home_claim_name(workspace.home)}},
                 {"name": SCRATCH_VOLUME, "emptyDir": {}}],
        # fsGroup makes the claim writable by the workspace's user; only a volume whose root is not already the
        # group's is walked (a big home is not re-owned at every start).
        pod_security={**POD_SECURITY_CONTEXT, "fsGroupChangePolicy": "OnRootMismatch"},
    )


def workspace_manifests(launch: JobLaunch, *, image: str, scheduler_name: str, portal_namespace: str,
                        storage_class: str = "") -> list[dict]:
    """Every object of a workspace attempt: the home claim, the policy, the Deployment and its key's Secret. The
    backend makes the policy first (before any pod exists), then the claim, the Deployment, and the Secret (owned
    by the Deployment once that has a uid); the process that launches binds the pod only after the Secret exists
    (one bound sooner by another process waits in the kubelet, which holds a container back until its
    secretKeyRef resolves)."""
    return [
        home_claim_manifest(launch, storage_class=storage_class),
        workspace_network_policy_manifest(launch, portal_namespace=portal_namespace),
        workspace_deployment_manifest(launch, image=image, scheduler_name=scheduler_name),
        key_secret_manifest(launch),
    ]
