"""A member's own access to one environment's namespace, as pure functions (no cluster, no Django).

Each member who asks for a kubeconfig gets a ServiceAccount of their own in the
environment's namespace, bound by a RoleBinding to the namespaced Role of their
tier (`manifests.ROLE_TIERS`: viewers read, everyone else runs work), and a
short-lived token from the TokenRequest API. Nothing here is cluster-wide: no
ClusterRole, no ClusterRoleBinding, so the token opens that namespace only.

The objects carry the environment's labels (so a namespace delete and the
environment's prune find them) and `MEMBER_ACCESS_LABEL`, with the portal
username in an annotation: a re-sync keeps the ServiceAccounts of members and
re-binds them to their current tier, and deletes those of anyone who left.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from datetime import datetime

import yaml

from runners.backends.base import EnvironmentSpec, MemberBinding
from runners.backends.manifests import RBAC_API_GROUP, ROLE_TIERS, common_labels

MEMBER_ACCESS_LABEL = "portal.gpu/member-access"
USERNAME_ANNOTATION = "portal.gpu/username"
SERVICE_ACCOUNT_PREFIX = "member-"
# Room for the prefix, a readable part of the username and an 8-hex hash, and for "-portal-editor"
# after it in the RoleBinding's name, all within a 63-character DNS label.
_READABLE_MAX = 32
# The TokenRequest API refuses anything shorter than ten minutes.
MIN_TOKEN_TTL_S = 600


def service_account_name(username: str) -> str:
    """A DNS-1123 label for the member: readable, and unique because it ends in a hash of the exact username.

    Two usernames that read alike once lowercased and cleaned (`Ann.Lee`, `ann-lee`) still get
    different names, since the hash is of the username as the portal spells it.
    """
    readable = re.sub(r"[^a-z0-9]+", "-", username.lower()).strip("-")[:_READABLE_MAX].strip("-") or "user"
    digest = hashlib.sha256(username.encode()).hexdigest()[:8]
    return f"{SERVICE_ACCOUNT_PREFIX}{readable}-{digest}"


def role_binding_name(username: str, role: str) -> str:
    """The member's RoleBinding for their tier; a tier change is a new binding (roleRef cannot change)."""
    return f"{service_account_name(username)}-{_tier(role)}"


def _tier(role: str) -> str:
    if role not in ROLE_TIERS:
        raise ValueError(f"Unknown role {role!r}; expected one of {sorted(ROLE_TIERS)}.")
    return ROLE_TIERS[role]


def _metadata(spec: EnvironmentSpec, name: str, username: str) -> dict:
    return {
        "name": name,
        "namespace": spec.namespace,
        "labels": {**common_labels(spec), MEMBER_ACCESS_LABEL: "true"},
        "annotations": {USERNAME_ANNOTATION: username},
    }


def service_account_manifest(spec: EnvironmentSpec, username: str) -> dict:
    """The member's ServiceAccount; only TokenRequest mints its tokens, and pods never mount one."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(spec, service_account_name(username), username),
        "automountServiceAccountToken": False,
    }


def role_binding_manifest(spec: EnvironmentSpec, member: MemberBinding) -> dict:
    """Binds the member's ServiceAccount to their tier's Role, in this namespace only."""
    return {
        "apiVersion": f"{RBAC_API_GROUP}/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(spec, role_binding_name(member.username, member.role), member.username),
        "roleRef": {"apiGroup": RBAC_API_GROUP, "kind": "Role", "name": _tier(member.role)},
        "subjects": [
            {"kind": "ServiceAccount", "name": service_account_name(member.username), "namespace": spec.namespace}
        ],
    }


def member_access_manifests(spec: EnvironmentSpec, member: MemberBinding) -> list[dict]:
    """What a member's access is made of, in the order it is applied."""
    return [service_account_manifest(spec, member.username), role_binding_manifest(spec, member)]


def all_role_binding_names(username: str) -> list[str]:
    """Every binding the member could have here, one per tier."""
    return sorted({f"{service_account_name(username)}-{tier}" for tier in ROLE_TIERS.values()})


def stale_role_binding_names(member: MemberBinding) -> list[str]:
    """The member's bindings to tiers they no longer hold (deleted when they are re-bound)."""
    return [name for name in all_role_binding_names(member.username)
            if name != role_binding_name(member.username, member.role)]


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
