"""Kubernetes objects for a tenant environment, built by pure functions from an EnvironmentSpec.

Nothing here talks to a cluster; `kubernetes.py` sends what these return. Every
object carries the same labels, so the backend can find (and prune) what it
owns, and nothing a tenant typed reaches a manifest except the names the portal
already validated as DNS labels.
"""

from __future__ import annotations

from runners.backends.base import EnvironmentSpec

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "gpu-portal"
TENANT_LABEL = "portal.gpu/tenant"
ENVIRONMENT_LABEL = "portal.gpu/environment-id"
WORKLOAD_SERVICE_ACCOUNT = "workload"

# Defaults for containers that do not say what they need; jobs built by the
# portal always set their own requests.
DEFAULT_CONTAINER_REQUEST = {"cpu": "250m", "memory": "512Mi"}
DEFAULT_CONTAINER_LIMIT = {"cpu": "2", "memory": "8Gi"}
MAX_CONTAINER = {"cpu": "128", "memory": "2Ti"}
MAX_PODS_PER_ENVIRONMENT = 200

# Which portal roles get which Kubernetes Role. Viewers read; everyone who can
# create environments can run and stop work in them. No role grants RBAC,
# secrets to viewers, or anything cluster-wide.
ROLE_FOR = {"viewer": "portal-viewer", "member": "portal-editor", "admin": "portal-editor", "owner": "portal-editor"}
_READ = ["get", "list", "watch"]
_WRITE = ["create", "update", "patch", "delete", "deletecollection"]
VIEWER_RULES = [
    {"apiGroups": [""], "resources": ["pods", "pods/log", "services", "events", "configmaps", "persistentvolumeclaims"], "verbs": _READ},
    {"apiGroups": ["batch"], "resources": ["jobs", "cronjobs"], "verbs": _READ},
    {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets", "replicasets"], "verbs": _READ},
]
EDITOR_RULES = [
    {"apiGroups": [""], "resources": ["pods", "services", "configmaps", "persistentvolumeclaims", "secrets"], "verbs": _READ + _WRITE},
    {"apiGroups": [""], "resources": ["pods/log", "events", "resourcequotas", "limitranges"], "verbs": _READ},
    {"apiGroups": [""], "resources": ["pods/exec", "pods/portforward"], "verbs": ["create", "get"]},
    {"apiGroups": ["batch"], "resources": ["jobs", "cronjobs"], "verbs": _READ + _WRITE},
    {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets", "replicasets"], "verbs": _READ + _WRITE},
]


def common_labels(spec: EnvironmentSpec) -> dict[str, str]:
    return {MANAGED_BY_LABEL: MANAGED_BY, TENANT_LABEL: spec.tenant_slug, ENVIRONMENT_LABEL: str(spec.environment_id)}


def _metadata(spec: EnvironmentSpec, name: str, *, namespaced: bool = True) -> dict:
    metadata = {"name": name, "labels": common_labels(spec)}
    if namespaced:
        metadata["namespace"] = spec.namespace
    return metadata


def namespace_manifest(spec: EnvironmentSpec) -> dict:
    labels = common_labels(spec)
    # Pod Security Admission: refuse privileged, hostPath, hostNetwork and root pods.
    for mode in ("enforce", "audit", "warn"):
        labels[f"pod-security.kubernetes.io/{mode}"] = "restricted"
        labels[f"pod-security.kubernetes.io/{mode}-version"] = "latest"
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": spec.namespace, "labels": labels}}


def resource_quota_manifest(spec: EnvironmentSpec) -> dict:
    """GPU limits from the tenant's quota; a GPU resource with no quota is granted zero."""
    hard = {"requests.nvidia.com/gpu": "0", "pods": str(MAX_PODS_PER_ENVIRONMENT)}
    hard.update({key: str(int(value)) for key, value in sorted(spec.quota_hard.items())})
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": _metadata(spec, "gpu-quota"), "spec": {"hard": hard}}


def limit_range_manifest(spec: EnvironmentSpec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "LimitRange",
        "metadata": _metadata(spec, "container-defaults"),
        "spec": {
            "limits": [
                {
                    "type": "Container",
                    "defaultRequest": dict(DEFAULT_CONTAINER_REQUEST),
                    "default": dict(DEFAULT_CONTAINER_LIMIT),
                    "max": dict(MAX_CONTAINER),
                }
            ]
        },
    }


def network_policy_manifests(spec: EnvironmentSpec) -> list[dict]:
    """Deny everything, then allow traffic inside the namespace and DNS lookups."""
    same_namespace = [{"podSelector": {}}]
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(spec, "default-deny"),
            "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]},
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(spec, "allow-same-namespace"),
            "spec": {
                "podSelector": {},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [{"from": same_namespace}],
                "egress": [{"to": same_namespace}],
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(spec, "allow-dns"),
            "spec": {
                "podSelector": {},
                "policyTypes": ["Egress"],
                "egress": [
                    {
                        "to": [
                            {
                                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                            }
                        ],
                        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
                    }
                ],
            },
        },
    ]


def role_manifests(spec: EnvironmentSpec) -> list[dict]:
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _metadata(spec, name), "rules": rules}
        for name, rules in (("portal-viewer", VIEWER_RULES), ("portal-editor", EDITOR_RULES))
    ]


def role_binding_manifests(spec: EnvironmentSpec, *, username_template: str) -> list[dict]:
    """One RoleBinding per role that has members; a role nobody holds gets none."""
    subjects: dict[str, list[dict]] = {}
    for member in sorted(spec.members, key=lambda member: member.username):
        subjects.setdefault(ROLE_FOR[member.role], []).append(
            {"kind": "User", "name": username_template.format(username=member.username), "apiGroup": "rbac.authorization.k8s.io"}
        )
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(spec, f"{role}-members"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": role_subjects,
        }
        for role, role_subjects in sorted(subjects.items())
    ]


def service_account_manifest(spec: EnvironmentSpec) -> dict:
    # Workloads get no API token: a training job has no business calling the API server.
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(spec, WORKLOAD_SERVICE_ACCOUNT),
        "automountServiceAccountToken": False,
    }


def environment_manifests(spec: EnvironmentSpec, *, username_template: str = "{username}") -> list[dict]:
    """Every object of the environment, Namespace first, in the order they are applied."""
    return [
        namespace_manifest(spec),
        resource_quota_manifest(spec),
        limit_range_manifest(spec),
        *network_policy_manifests(spec),
        service_account_manifest(spec),
        *role_manifests(spec),
        *role_binding_manifests(spec, username_template=username_template),
    ]
