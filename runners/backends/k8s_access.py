"""A member's own access to one environment's namespace, as pure functions (no cluster, no Django).

Each member who asks for a kubeconfig gets a ServiceAccount of their own per
environment, bound by a RoleBinding in the environment's namespace to the
namespaced Role of their tier (`manifests.ROLE_TIERS`: viewers read, everyone
else runs work), and a short-lived token from the TokenRequest API. Nothing here
is cluster-wide: no ClusterRole, no ClusterRoleBinding, so the token opens that
namespace only.

The ServiceAccount lives in the portal's own members namespace
(KUBERNETES_MEMBER_ACCOUNTS_NAMESPACE), where tenants have no rights, never in
the environment's: there an editor could run a pod as a colleague's
ServiceAccount and keep their identity. The RoleBinding names it with that
namespace (a subject may be a ServiceAccount of another namespace). Its name is
a hash of the username and the environment's namespace, so one token opens one
environment.

The objects carry the environment's labels (so deleting the environment finds
the ServiceAccounts in the members namespace too) and `MEMBER_ACCESS_LABEL`,
with the portal username in an annotation: a re-sync keeps the access of
members and re-binds them to their current tier, and deletes that of anyone
who left (the generic prune leaves these objects alone, see
`KubernetesBackend._converge_member_access`).
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from datetime import datetime

import yaml

from runners.backends.base import EnvironmentSpec, MemberBinding, PermanentBackendError
from runners.backends.manifests import MANAGED_BY, MANAGED_BY_LABEL, RBAC_API_GROUP, ROLE_TIERS, common_labels

MEMBER_ACCESS_LABEL = "portal.gpu/member-access"
USERNAME_ANNOTATION = "portal.gpu/username"
# On a member's ServiceAccount: the environment namespace it opens.
ENVIRONMENT_NAMESPACE_ANNOTATION = "portal.gpu/environment-namespace"
SERVICE_ACCOUNT_PREFIX = "member-"
# The hash that makes the name an identity: 64 bits of SHA-256 of the username and the namespace.
_DIGEST_HEX = 16
# Room for the prefix, a readable part of the username and the hash, and for "-portal-editor"
# after it in the RoleBinding's name, all within a 63-character DNS label (7 + 24 + 1 + 16 + 14 = 62).
_READABLE_MAX = 24
# The TokenRequest API refuses anything shorter than ten minutes.
MIN_TOKEN_TTL_S = 600


class AccessRefused(PermanentBackendError):
    """The portal will not hand out this kubeconfig as things stand (a 409 naming what to fix)."""


def service_account_name(username: str, namespace: str) -> str:
    """A DNS-1123 label for the member's access to one environment namespace: readable, and unique
    because it ends in a hash of the exact username and the namespace.

    Two usernames that read alike once lowercased and cleaned (`Ann.Lee`, `ann-lee`) still get
    different names, since the hash is of the username as the portal spells it; the same member
    gets another ServiceAccount (so another token) for each environment.
    """
    readable = re.sub(r"[^a-z0-9]+", "-", username.lower()).strip("-")[:_READABLE_MAX].strip("-") or "user"
    digest = hashlib.sha256(f"{username}\0{namespace}".encode()).hexdigest()[:_DIGEST_HEX]
    return f"{SERVICE_ACCOUNT_PREFIX}{readable}-{digest}"


def role_binding_name(username: str, namespace: str, role: str) -> str:
    """The member's RoleBinding for their tier; a tier change is a new binding (roleRef cannot change)."""
    return f"{service_account_name(username, namespace)}-{_tier(role)}"


def _tier(role: str) -> str:
    if role not in ROLE_TIERS:
        raise ValueError(f"Unknown role {role!r}; expected one of {sorted(ROLE_TIERS)}.")
    return ROLE_TIERS[role]


def _metadata(spec: EnvironmentSpec, name: str, username: str, *, namespace: str) -> dict:
    return {
        "name": name,
        "namespace": namespace,
        "labels": {**common_labels(spec), MEMBER_ACCESS_LABEL: "true"},
        "annotations": {USERNAME_ANNOTATION: username},
    }


def accounts_namespace_manifest(name: str) -> dict:
    """The portal's members namespace: only the portal works in it (no tenant is granted anything there)."""
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": {MANAGED_BY_LABEL: MANAGED_BY, MEMBER_ACCESS_LABEL: "true"}}}


def service_account_manifest(spec: EnvironmentSpec, username: str, *, accounts_namespace: str) -> dict:
    """The member's ServiceAccount for this environment, in the members namespace; only TokenRequest mints
    its tokens, and pods never mount one (nobody but the portal may make pods there anyway)."""
    metadata = _metadata(spec, service_account_name(username, spec.namespace), username, namespace=accounts_namespace)
    metadata["annotations"][ENVIRONMENT_NAMESPACE_ANNOTATION] = spec.namespace
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata, "automountServiceAccountToken": False}


def role_binding_manifest(spec: EnvironmentSpec, member: MemberBinding, *, accounts_namespace: str) -> dict:
    """Binds the member's ServiceAccount (in the members namespace) to their tier's Role, in this namespace only."""
    return {
        "apiVersion": f"{RBAC_API_GROUP}/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(spec, role_binding_name(member.username, spec.namespace, member.role), member.username,
                              namespace=spec.namespace),
        "roleRef": {"apiGroup": RBAC_API_GROUP, "kind": "Role", "name": _tier(member.role)},
        "subjects": [{"kind": "ServiceAccount", "name": service_account_name(member.username, spec.namespace),
                      "namespace": accounts_namespace}],
    }


def member_access_manifests(spec: EnvironmentSpec, member: MemberBinding, *, accounts_namespace: str) -> list[dict]:
    """What a member's access is made of, in the order it is applied."""
    return [service_account_manifest(spec, member.username, accounts_namespace=accounts_namespace),
            role_binding_manifest(spec, member, accounts_namespace=accounts_namespace)]


def all_role_binding_names(username: str, namespace: str) -> list[str]:
    """Every binding the member could have in this namespace, one per tier."""
    return sorted({f"{service_account_name(username, namespace)}-{tier}" for tier in ROLE_TIERS.values()})


def stale_role_binding_names(member: MemberBinding, namespace: str) -> list[str]:
    """The member's bindings to tiers they no longer hold (deleted when they are re-bound)."""
    return [name for name in all_role_binding_names(member.username, namespace)
            if name != role_binding_name(member.username, namespace, member.role)]


def token_request_manifest(*, expiration_s: int) -> dict:
    """An authentication.k8s.io/v1 TokenRequest for a token that lives `expiration_s` seconds."""
    if expiration_s < MIN_TOKEN_TTL_S:
        raise ValueError(f"A token must live at least {MIN_TOKEN_TTL_S} s; asked for {expiration_s} s.")
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        # No audiences of our own: an empty list asks for the API server's, the one kubectl's token is for.
        "spec": {"audiences": [], "expirationSeconds": int(expiration_s)},
    }


@dataclass(frozen=True)
class ClusterEndpoint:
    """How the portal itself reaches the API server: its URL and the CA it trusts (PEM), or no TLS check."""

    server: str
    ca_pem: bytes | None = None
    insecure_skip_tls_verify: bool = False


@dataclass(frozen=True)
class MemberKubeconfig:
    """A downloaded kubeconfig: its YAML and when its token stops working."""

    text: str
    expires_at: datetime
    service_account: str


def kubeconfig_text(*, cluster: ClusterEndpoint, spec: EnvironmentSpec, username: str, token: str) -> str:
    """A kubeconfig with one cluster, one user (the token) and one context whose default namespace is the environment's."""
    cluster_name = f"gpu-portal-{spec.tenant_slug}"
    context_name = spec.namespace
    cluster_entry: dict = {"server": cluster.server}
    if cluster.ca_pem:
        cluster_entry["certificate-authority-data"] = base64.b64encode(cluster.ca_pem).decode()
    elif cluster.insecure_skip_tls_verify:
        cluster_entry["insecure-skip-tls-verify"] = True
    user_name = f"{username}@{spec.namespace}"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "preferences": {},
        "clusters": [{"name": cluster_name, "cluster": cluster_entry}],
        "users": [{"name": user_name, "user": {"token": token}}],
        "contexts": [
            {"name": context_name, "context": {"cluster": cluster_name, "user": user_name, "namespace": spec.namespace}}
        ],
        "current-context": context_name,
    }
    return yaml.safe_dump(config, sort_keys=False)
