"""The Kubernetes objects of an environment: valid for the API server, and no more power than intended."""

import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from runners.backends.base import MemberBinding
from runners.backends.manifests import (
    MANAGED_BY_LABEL,
    environment_manifests,
    gpu_quota_keys,
    namespace_manifest,
    resource_quota_manifest,
    role_binding_manifests,
    role_manifests,
)
from tests.support.k8s import make_spec

pytestmark = pytest.mark.unit

# The oldest Kubernetes the portal supports, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.30.0", latest_version())

SPECS = {
    "members of every role": make_spec(
        members=tuple(MemberBinding(name, role) for name, role in
                      (("olivia", "owner"), ("ada", "admin"), ("tom", "member"), ("vera", "viewer"), ("vic", "viewer")))
    ),
    "quota with MIG slices": make_spec(
        quota_hard={"requests.nvidia.com/gpu": 4, "requests.nvidia.com/mig-1g.10gb": 14,
                    "requests.nvidia.com/mig-3g.40gb": 2, "requests.nvidia.com/gpu.shared": 8}
    ),
    "no members and no quota": make_spec(members=(), quota_hard={}),
}


def _all_manifests():
    for label, spec in SPECS.items():
        for manifest in environment_manifests(spec, username_template="oidc:{username}", portal_namespace="gpu-portal"):
            yield pytest.param(manifest, id=f"{label}-{manifest['kind']}-{manifest['metadata']['name']}")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("manifest", list(_all_manifests()))
def test_every_manifest_validates_strictly(manifest, version):
    kubernetes_validate.validate(manifest, version, strict=True)


def _by_kind_and_name(spec, **kwargs):
    return {(m["kind"], m["metadata"]["name"]): m for m in environment_manifests(spec, **kwargs)}


def test_the_namespace_comes_first_and_the_order_never_changes():
    spec = SPECS["members of every role"]
    manifests = environment_manifests(spec)
    assert manifests[0]["kind"] == "Namespace"
    assert manifests == environment_manifests(spec)
    assert [m["kind"] for m in manifests] == [
        "Namespace", "ServiceAccount", "ResourceQuota", "LimitRange",
        "NetworkPolicy", "NetworkPolicy", "NetworkPolicy", "Role", "Role", "RoleBinding", "RoleBinding",
    ]


def test_every_object_carries_the_tenant_and_environment_labels():
    for manifest in environment_manifests(make_spec()):
        labels = manifest["metadata"]["labels"]
        assert labels[MANAGED_BY_LABEL] == "gpu-portal"
        assert labels["portal.gpu/tenant"] == "acme"
        assert labels["portal.gpu/environment-id"] == "7"
        if manifest["kind"] != "Namespace":
            assert manifest["metadata"]["namespace"] == "acme-vision"


def test_the_namespace_enforces_the_restricted_pod_security_standard():
    labels = namespace_manifest(make_spec())["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"
        assert labels[f"pod-security.kubernetes.io/{mode}-version"] == "latest"


def test_the_quota_grants_what_the_tenant_has_as_strings():
    hard = resource_quota_manifest(SPECS["quota with MIG slices"])["spec"]["hard"]
    assert hard["requests.nvidia.com/gpu"] == "4"
    assert hard["requests.nvidia.com/mig-1g.10gb"] == "14"
    assert hard["requests.nvidia.com/gpu.shared"] == "8"
    assert all(isinstance(value, str) for value in hard.values())
    assert int(hard["pods"]) > 0


def test_the_quota_denies_every_gpu_resource_the_tenant_was_not_granted():
    hard = resource_quota_manifest(make_spec(quota_hard={}))["spec"]["hard"]
    assert hard["requests.nvidia.com/gpu"] == "0"
    # Kubernetes leaves an unlisted extended resource unlimited, so every MIG slice must be listed.
    assert "requests.nvidia.com/mig-1g.10gb" in gpu_quota_keys()
    assert all(hard[key] == "0" for key in gpu_quota_keys())


def test_the_network_policies_deny_by_default_and_allow_the_namespace_and_dns():
    objects = _by_kind_and_name(make_spec())
    deny = objects[("NetworkPolicy", "default-deny")]["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    same = objects[("NetworkPolicy", "allow-same-namespace")]["spec"]
    assert same["ingress"] == [{"from": [{"podSelector": {}}]}]
    assert same["egress"] == [{"to": [{"podSelector": {}}]}]
    dns = objects[("NetworkPolicy", "allow-dns")]["spec"]
    assert dns["policyTypes"] == ["Egress"]
    (rule,) = dns["egress"]
    assert rule["to"] == [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
    }]
    assert sorted((port["protocol"], port["port"]) for port in rule["ports"]) == [("TCP", 53), ("UDP", 53)]
    assert ("NetworkPolicy", "allow-portal-router") not in objects  # no portal namespace named: nothing opened


def test_the_portals_router_may_reach_inference_servers_and_nothing_else():
    """Ingress from the portal's namespace to the server port of pods that belong to an endpoint; egress unchanged."""
    objects = _by_kind_and_name(make_spec(), portal_namespace="gpu-portal")
    router = objects[("NetworkPolicy", "allow-portal-router")]["spec"]
    assert router == {
        "podSelector": {"matchExpressions": [{"key": "portal.gpu/endpoint-id", "operator": "Exists"}]},
        "policyTypes": ["Ingress"],
        "ingress": [{
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gpu-portal"}}}],
            "ports": [{"protocol": "TCP", "port": 8000}],
        }],
    }


def _grants(role: dict) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_viewers_can_read_work_but_not_secrets_or_change_anything():
    viewer = _grants(role_manifests(make_spec())[0])
    assert ("", "pods/log", "get") in viewer and ("batch", "jobs", "watch") in viewer
    assert not any(resource == "secrets" for _, resource, _ in viewer)
    assert {verb for _, _, verb in viewer} == {"get", "list", "watch"}


def test_no_role_can_escalate_or_lift_its_own_limits():
    for role in role_manifests(make_spec()):
        grants = _grants(role)
        assert not any(group == "rbac.authorization.k8s.io" for group, _, _ in grants), role["metadata"]["name"]
        assert not any(verb in ("escalate", "bind", "impersonate", "*") for _, _, verb in grants)
        assert not any("*" in (group, resource) for group, resource, _ in grants)
        for resource in ("resourcequotas", "limitranges", "networkpolicies", "serviceaccounts", "namespaces"):
            assert not any(r == resource and v not in ("get", "list", "watch") for _, r, v in grants), resource


def test_editors_can_run_and_stop_jobs():
    editor = _grants(role_manifests(make_spec())[1])
    assert {("batch", "jobs", "create"), ("batch", "jobs", "delete"), ("", "pods", "delete")} <= editor


def test_members_are_bound_by_tier_through_the_username_template():
    bindings = {b["metadata"]["name"]: b for b in role_binding_manifests(SPECS["members of every role"],
                                                                         username_template="oidc:{username}")}
    assert bindings["portal-viewer-members"]["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "portal-viewer"}
    assert [s["name"] for s in bindings["portal-viewer-members"]["subjects"]] == ["oidc:vera", "oidc:vic"]
    assert [s["name"] for s in bindings["portal-editor-members"]["subjects"]] == ["oidc:ada", "oidc:olivia", "oidc:tom"]
    for binding in bindings.values():
        assert all(s["kind"] == "User" and s["apiGroup"] == "rbac.authorization.k8s.io" for s in binding["subjects"])


def test_an_environment_without_members_gets_no_rolebindings():
    assert role_binding_manifests(make_spec(members=()), username_template="{username}") == []


def test_it_refuses_a_role_it_does_not_know():
    with pytest.raises(ValueError, match="superuser"):
        role_binding_manifests(make_spec(members=(MemberBinding("mallory", "superuser"),)), username_template="{username}")


def test_the_workload_service_account_mounts_no_token():
    account = _by_kind_and_name(make_spec())[("ServiceAccount", "workload")]
    assert account["automountServiceAccountToken"] is False
