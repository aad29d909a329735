"""The Kubernetes objects one environment is made of, as pure functions of its spec.

Nothing here talks to a cluster: each function turns an EnvironmentSpec into
plain dicts the API server accepts as server-side apply bodies, so every object
can be checked with kubernetes-validate and compared in tests. The backend
applies them in the order `environment_manifests` returns (Namespace first).
"""

from __future__ import annotations

from runners.backends.base import EnvironmentSpec, MemberBinding
from runners.nvidia import mig, names

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "gpu-portal"
TENANT_LABEL = "portal.gpu/tenant"
ENVIRONMENT_LABEL = "portal.gpu/environment-id"
ENVIRONMENT_NAME_ANNOTATION = "portal.gpu/environment-name"

POD_SECURITY_LEVEL = "restricted"
# "latest" keeps the policy current as the cluster upgrades; tenants never need older, laxer rules.
POD_SECURITY_VERSION = "latest"

QUOTA_NAME = "gpu-quota"
LIMIT_RANGE_NAME = "container-defaults"
WORKLOAD_SERVICE_ACCOUNT = "workload"
DEFAULT_DENY_POLICY = "default-deny"
SAME_NAMESPACE_POLICY = "allow-same-namespace"
DNS_POLICY = "allow-dns"
ROUTER_POLICY = "allow-portal-router"
# An inference replica's pods carry the endpoint's id; its server listens on this port.
ENDPOINT_LABEL = "portal.gpu/endpoint-id"
SERVER_PORT = 8000
# A workspace's pod (and its home claim and policy) carry the workspace's id; JupyterLab listens on this port.
WORKSPACE_LABEL = "portal.gpu/workspace-id"
WORKSPACE_PORT = 8888
# The pods the namespace's own traffic policy covers: every pod but workspaces, which take traffic from the
# portal's edge alone (their own policy, runners.backends.workspace_manifests).
NOT_A_WORKSPACE = {"matchExpressions": [{"key": WORKSPACE_LABEL, "operator": "DoesNotExist"}]}
VIEWER_ROLE = "portal-viewer"
EDITOR_ROLE = "portal-editor"

# A namespace without a pods limit could be flooded with pending pods; 200 is plenty for one team.
DEFAULT_PODS_LIMIT = 200
DEFAULT_CONTAINER_REQUESTS = {"cpu": "250m", "memory": "512Mi"}
DEFAULT_CONTAINER_LIMITS = {"cpu": "2", "memory": "8Gi"}
# Nothing bigger than a whole large node; it catches typos like "memory: 80Ti".
MAX_CONTAINER = {"cpu": "128", "memory": "2Ti"}

RBAC_API_GROUP = "rbac.authorization.k8s.io"
# Portal role -> Role tier. Everyone above viewer may run work; nobody may touch RBAC or quotas.
ROLE_TIERS = {"viewer": VIEWER_ROLE, "member": EDITOR_ROLE, "admin": EDITOR_ROLE, "owner": EDITOR_ROLE}
READ_VERBS = ["get", "list", "watch"]
WRITE_VERBS = ["create", "delete", "deletecollection", "patch", "update"]


def gpu_quota_keys() -> list[str]:
    """Every ResourceQuota key for a GPU resource the portal knows, whole, shared or MIG."""
    resources = {names.GPU_RESOURCE, names.TIMESLICE_RESOURCE}
    for model in mig.GPU_MODELS.values():
        resources.update(profile.kubernetes_resource for profile in model.profiles.values())
    return sorted(f"requests.{resource}" for resource in resources)


def common_labels(spec: EnvironmentSpec) -> dict[str, str]:
    """Labels on every object of the environment; the backend finds its own objects by them."""
    return {
        MANAGED_BY_LABEL: MANAGED_BY,
        TENANT_LABEL: spec.tenant_slug,
        ENVIRONMENT_LABEL: str(spec.environment_id),
    }


def ownership_selector(spec: EnvironmentSpec) -> str:
    """The label selector that matches exactly the objects built for this environment."""
    return f"{MANAGED_BY_LABEL}={MANAGED_BY},{ENVIRONMENT_LABEL}={spec.environment_id}"


def _metadata(spec: EnvironmentSpec, name: str) -> dict:
    return {"name": name, "namespace": spec.namespace, "labels": common_labels(spec)}


def namespace_manifest(spec: EnvironmentSpec) -> dict:
    """The Namespace, with tenant labels and Pod Security `restricted` enforced, audited and warned."""
    labels = common_labels(spec)
    for mode in ("enforce", "audit", "warn"):
        labels[f"pod-security.kubernetes.io/{mode}"] = POD_SECURITY_LEVEL
        labels[f"pod-security.kubernetes.io/{mode}-version"] = POD_SECURITY_VERSION
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": spec.namespace,
            "labels": labels,
            # The display name is free text, so it goes in an annotation, not a label.
            "annotations": {ENVIRONMENT_NAME_ANNOTATION: spec.name},
        },
    }


def resource_quota_manifest(spec: EnvironmentSpec) -> dict:
    """The ResourceQuota: the tenant's limits, zero for every GPU resource it was not granted."""
    # Kubernetes quota leaves an unlisted extended resource unlimited, so absence must be spelled "0".
    hard = {key: "0" for key in gpu_quota_keys()}
    hard["pods"] = str(DEFAULT_PODS_LIMIT)
    hard.update({key: str(int(value)) for key, value in spec.quota_hard.items()})
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": _metadata(spec, QUOTA_NAME),
        "spec": {"hard": dict(sorted(hard.items()))},
    }


def limit_range_manifest(spec: EnvironmentSpec) -> dict:
    """The LimitRange: default requests and limits for containers that set none."""
    return {
        "apiVersion": "v1",
        "kind": "LimitRange",
        "metadata": _metadata(spec, LIMIT_RANGE_NAME),
        "spec": {
            "limits": [
                {
                    "type": "Container",
                    "defaultRequest": dict(DEFAULT_CONTAINER_REQUESTS),
                    "default": dict(DEFAULT_CONTAINER_LIMITS),
                    "max": dict(MAX_CONTAINER),
                }
            ]
        },
    }


def same_namespace_policy_spec() -> dict:
    """The spec of SAME_NAMESPACE_POLICY: the namespace's pods may talk to each other, workspaces' pods left out
    (nothing in the namespace reaches a workspace; what a workspace may reach is its own policy's)."""
    same_namespace_peer = [{"podSelector": {}}]  # A bare podSelector means "pods in this namespace".
    return {
        "podSelector": {"matchExpressions": [dict(expression) for expression in NOT_A_WORKSPACE["matchExpressions"]]},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [{"from": same_namespace_peer}],
        "egress": [{"to": same_namespace_peer}],
    }


def network_policy_manifests(spec: EnvironmentSpec, *, portal_namespace: str = "") -> list[dict]:
    """NetworkPolicies: deny all traffic, then allow the namespace to itself (workspaces' pods aside) and DNS
    lookups; and, with ``portal_namespace``, the portal's router to reach inference replicas' servers (that port,
    those pods only)."""
    dns_peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
    }

    def policy(name: str, policy_spec: dict) -> dict:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(spec, name),
            "spec": {"podSelector": {}, **policy_spec},
        }

    router = []
    if portal_namespace:
        router = [{
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(spec, ROUTER_POLICY),
            "spec": {
                "podSelector": {"matchExpressions": [{"key": ENDPOINT_LABEL, "operator": "Exists"}]},
                "policyTypes": ["Ingress"],
                "ingress": [{
                    "from": [{"namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": portal_namespace}}}],
                    "ports": [{"protocol": "TCP", "port": SERVER_PORT}],
                }],
            },
        }]
    return [
        policy(DEFAULT_DENY_POLICY, {"policyTypes": ["Ingress", "Egress"]}),
        policy(SAME_NAMESPACE_POLICY, same_namespace_policy_spec()),
        policy(
            DNS_POLICY,
            {
                "policyTypes": ["Egress"],
                "egress": [
                    {
                        "to": [dns_peer],
                        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
                    }
                ],
            },
        ),
        *router,
    ]


def _viewer_rules() -> list[dict]:
    # Secrets are left out on purpose: reading them would hand viewers every credential in the namespace.
    return [
        {
            "apiGroups": [""],
            "resources": [
                "configmaps",
                "events",
                "limitranges",
                "persistentvolumeclaims",
                "pods",
                "pods/log",
                "resourcequotas",
                "serviceaccounts",
                "services",
            ],
            "verbs": list(READ_VERBS),
        },
        {"apiGroups": ["batch"], "resources": ["cronjobs", "jobs"], "verbs": list(READ_VERBS)},
        {"apiGroups": ["apps"], "resources": ["deployments", "replicasets", "statefulsets"], "verbs": list(READ_VERBS)},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": list(READ_VERBS)},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": list(READ_VERBS)},
    ]


def _editor_rules() -> list[dict]:
    # Editors run work, but quotas, network policies, service accounts and RBAC stay the portal's:
    # any write there would let a member lift the limits or escalate beyond their tier.
    return _viewer_rules() + [
        {
            "apiGroups": [""],
            "resources": ["configmaps", "persistentvolumeclaims", "pods", "secrets", "services"],
            "verbs": list(WRITE_VERBS),
        },
        # Anyone who may create pods can mount a secret anyway, so reading them adds no power.
        {"apiGroups": [""], "resources": ["secrets"], "verbs": list(READ_VERBS)},
        {"apiGroups": [""], "resources": ["pods/attach", "pods/exec", "pods/portforward"], "verbs": ["create", "get"]},
        {"apiGroups": ["batch"], "resources": ["cronjobs", "jobs"], "verbs": list(WRITE_VERBS)},
        {"apiGroups": ["apps"], "resources": ["deployments", "replicasets", "statefulsets"], "verbs": list(WRITE_VERBS)},
    ]


def role_manifests(spec: EnvironmentSpec) -> list[dict]:
    """The two Roles members are bound to: read-only for viewers, run-work for everyone else."""
    return [
        {"apiVersion": f"{RBAC_API_GROUP}/v1", "kind": "Role", "metadata": _metadata(spec, VIEWER_ROLE), "rules": _viewer_rules()},
        {"apiVersion": f"{RBAC_API_GROUP}/v1", "kind": "Role", "metadata": _metadata(spec, EDITOR_ROLE), "rules": _editor_rules()},
    ]


def subject_name(member: MemberBinding, *, username_template: str) -> str:
    """The Kubernetes user a portal member authenticates as (an OIDC-prefixed name, say)."""
    return username_template.format(username=member.username)


def role_binding_manifests(spec: EnvironmentSpec, *, username_template: str) -> list[dict]:
    """One RoleBinding per Role tier that has members; a tier without members gets none."""
    subjects_by_role: dict[str, set[str]] = {}
    for member in spec.members:
        if member.role not in ROLE_TIERS:
            raise ValueError(f"Unknown role {member.role!r} for {member.username!r}; expected one of {sorted(ROLE_TIERS)}.")
        subjects_by_role.setdefault(ROLE_TIERS[member.role], set()).add(
            subject_name(member, username_template=username_template)
        )
    bindings = []
    for role_name in (VIEWER_ROLE, EDITOR_ROLE):
        if role_name not in subjects_by_role:
            continue
        bindings.append(
            {
                "apiVersion": f"{RBAC_API_GROUP}/v1",
                "kind": "RoleBinding",
                "metadata": _metadata(spec, f"{role_name}-members"),
                "roleRef": {"apiGroup": RBAC_API_GROUP, "kind": "Role", "name": role_name},
                "subjects": [
                    {"apiGroup": RBAC_API_GROUP, "kind": "User", "name": name}
                    for name in sorted(subjects_by_role[role_name])
                ],
            }
        )
    return bindings


def service_account_manifest(spec: EnvironmentSpec) -> dict:
    """The ServiceAccount workloads run as; no token is mounted, since jobs never call the API."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(spec, WORKLOAD_SERVICE_ACCOUNT),
        "automountServiceAccountToken": False,
    }


def environment_manifests(spec: EnvironmentSpec, *, username_template: str = "{username}",
                          portal_namespace: str = "") -> list[dict]:
    """Every object of the environment, Namespace first, in the order they are applied."""
    return [
        namespace_manifest(spec),
        service_account_manifest(spec),
        resource_quota_manifest(spec),
        limit_range_manifest(spec),
        *network_policy_manifests(spec, portal_namespace=portal_namespace),
        *role_manifests(spec),
        *role_binding_manifests(spec, username_template=username_template),
    ]
