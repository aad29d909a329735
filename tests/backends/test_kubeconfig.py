"""A member's own kubeconfig on the Kubernetes backend: the objects it is made of, and the real kubectl using it.

The stand-in serves HTTPS here (kubectl sends a bearer token only over TLS) and checks
every body it is sent with kubernetes-validate in strict mode, as a server with
fieldValidation=Strict would.
"""

import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from runners.backends import k8s_access
from runners.backends.base import MemberBinding, TransientBackendError
from runners.backends.kubernetes import KubernetesBackend
from runners.backends.manifests import EDITOR_ROLE, VIEWER_ROLE
from runners.clusters.registry import kubernetes_backend_options
from tests.support.k8s import kubectl, make_spec, portal_kubeconfig, portal_pod
from tests.support.k8s_standin import KubernetesStandIn

KUBERNETES_VERSIONS = ("1.30.0", latest_version())
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
TOM = MemberBinding("tom", "member")
VERA = MemberBinding("vera", "viewer")
# What kubectl says on a 401, whether it fails at discovery or, with discovery cached, at the request.
UNAUTHORIZED = "You must be logged in to the server"


@pytest.fixture
def api():
    with KubernetesStandIn(tls=True, validate_version="1.30.0", admin_tokens={"standin-token"}) as standin:
        yield standin


@pytest.fixture
def backend(api, tmp_path) -> KubernetesBackend:
    """The backend as the portal builds it: from a kubeconfig file holding the server's CA."""
    kubeconfig = tmp_path / "portal-kubeconfig"
    kubeconfig.write_text(portal_kubeconfig(api))
    options = kubernetes_backend_options() | dict(request_timeout_s=5)
    return KubernetesBackend.from_kubeconfig(in_cluster=False, kubeconfig=str(kubeconfig), **options)


@pytest.fixture
def spec():
    return make_spec()


@pytest.fixture
def environments(backend, api, spec):
    """Two environments, each with a pod in it."""
    other = make_spec(environment_id=8, name="other", namespace="acme-other")
    for each in (spec, other):
        backend.ensure_environment(each)
        api.put(portal_pod(f"pod-in-{each.namespace}", "gpu-1", namespace=each.namespace))
    return spec, other


def download(backend, spec, member, tmp_path: Path) -> Path:
    config = backend.member_kubeconfig(spec, member, expiration_s=3600, timeout_s=5)
    path = tmp_path / f"kubeconfig-{member.username}.yaml"
    path.write_text(config.text)
    return path


# --- The objects, pure ------------------------------------------------------------


def _access_manifests():
    spec = make_spec()
    for member in (MemberBinding("olivia", "owner"), TOM, VERA, MemberBinding("Ann.Lee@Example.com", "admin")):
        for manifest in k8s_access.member_access_manifests(spec, member):
            yield pytest.param(manifest, id=f"{member.role}-{manifest['kind']}")
    yield pytest.param(k8s_access.token_request_manifest(expiration_s=3600), id="TokenRequest")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("manifest", list(_access_manifests()))
def test_every_access_manifest_validates_strictly(manifest, version):
    kubernetes_validate.validate(manifest, version, strict=True)


def test_access_is_namespaced_and_bound_to_the_tier_role_only():
    spec = make_spec()
    for member, role in ((MemberBinding("olivia", "owner"), EDITOR_ROLE), (TOM, EDITOR_ROLE), (VERA, VIEWER_ROLE)):
        account, binding = k8s_access.member_access_manifests(spec, member)
        assert {account["kind"], binding["kind"]} == {"ServiceAccount", "RoleBinding"}  # never a ClusterRoleBinding
        assert account["metadata"]["namespace"] == binding["metadata"]["namespace"] == spec.namespace
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                        "namespace": spec.namespace}]
        assert account["automountServiceAccountToken"] is False


@pytest.mark.parametrize("username", ["tom", "Ann.Lee@example.com", "ann-lee", "___", "x" * 150, "ÉLODIE"])
def test_service_account_names_are_dns_labels(username):
    for name in [k8s_access.service_account_name(username), *k8s_access.all_role_binding_names(username)]:
        assert len(name) <= 63 and DNS_LABEL.match(name), name


def test_usernames_that_read_alike_get_different_service_accounts():
    names = {k8s_access.service_account_name(u) for u in ("ann.lee", "ann-lee", "Ann.Lee", "ann_lee", "x" * 40 + "a",
                                                          "x" * 40 + "b")}
    assert len(names) == 6
    assert k8s_access.service_account_name("tom") == k8s_access.service_account_name("tom")  # stable


def test_a_token_shorter_than_the_api_allows_is_refused_before_asking():
    with pytest.raises(ValueError, match="at least 600"):
        k8s_access.token_request_manifest(expiration_s=60)


# --- The backend against the stand-in --------------------------------------------------


def test_the_kubeconfig_names_the_cluster_its_ca_the_namespace_and_a_fresh_token(backend, api, environments, spec):
    before = datetime.now(UTC)
    config = backend.member_kubeconfig(spec, TOM, expiration_s=3600, timeout_s=5)
    parsed = yaml.safe_load(config.text)
    cluster = parsed["clusters"][0]["cluster"]
    assert cluster["server"] == api.url and api.url.startswith("https://")
    assert cluster["certificate-authority-data"]  # the CA the portal's own kubeconfig trusts
    context = next(c for c in parsed["contexts"] if c["name"] == parsed["current-context"])["context"]
    assert context["namespace"] == spec.namespace
    token = parsed["users"][0]["user"]["token"]
    minted = api.tokens[token]
    assert (minted.namespace, minted.service_account) == (spec.namespace, k8s_access.service_account_name("tom"))
    assert before + timedelta(seconds=3590) <= config.expires_at <= datetime.now(UTC) + timedelta(seconds=3601)
    binding = api.get("rolebindings", k8s_access.role_binding_name("tom", "member"), spec.namespace)
    assert binding["roleRef"]["name"] == EDITOR_ROLE
    assert not any(plural.startswith("cluster") for plural, _ns, _name in api.objects())


def test_asking_again_converges_and_mints_another_token(backend, api, environments, spec):
    first = backend.member_kubeconfig(spec, TOM, expiration_s=3600, timeout_s=5)
    second = backend.member_kubeconfig(spec, TOM, expiration_s=3600, timeout_s=5)
    assert first.text != second.text and len(api.tokens) == 2
    accounts = [name for plural, ns, name in api.objects() if plural == "serviceaccounts" and name.startswith("member-")]
    assert accounts == [k8s_access.service_account_name("tom")]


def test_a_cluster_that_cannot_be_reached_is_transient_and_named(make_unreachable_backend, spec):
    backend, url = make_unreachable_backend
    started = time.monotonic()
    with pytest.raises(TransientBackendError, match=re.escape(f"The Kubernetes cluster at {url} cannot be reached")):
        backend.member_kubeconfig(spec, TOM, expiration_s=3600, timeout_s=2)
    assert time.monotonic() - started < 10


@pytest.fixture
def make_unreachable_backend(tmp_path):
    with KubernetesStandIn() as gone:
        url = gone.url
    options = kubernetes_backend_options() | dict(request_timeout_s=2)
    from tests.support.k8s import client_for

    return KubernetesBackend(client_for(url), **options), url


def test_a_resync_rebinds_a_member_whose_role_changed_and_drops_one_who_left(backend, api, environments, spec):
    backend.member_kubeconfig(spec, TOM, expiration_s=3600, timeout_s=5)
    backend.member_kubeconfig(spec, VERA, expiration_s=3600, timeout_s=5)
    demoted = make_spec(members=(MemberBinding("olivia", "owner"), MemberBinding("tom", "viewer")))
    backend.ensure_environment(demoted)
    names = {(plural, name) for plural, ns, name in api.objects() if ns == spec.namespace}
    assert ("rolebindings", k8s_access.role_binding_name("tom", "viewer")) in names
    assert ("rolebindings", k8s_access.role_binding_name("tom", "member")) not in names  # roleRef cannot change
    assert ("serviceaccounts", k8s_access.service_account_name("vera")) not in names  # vera left
    assert not any(name.startswith(k8s_access.service_account_name("vera")) for _plural, name in names)


# --- The real kubectl ---------------------------------------------------------------------


def test_kubectl_lists_the_pods_of_its_namespace_and_is_refused_elsewhere(backend, api, environments, spec, tmp_path):
    kubeconfig = download(backend, spec, TOM, tmp_path)
    listed = kubectl(kubeconfig, "get", "pods", home=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "pod-in-acme-vision" in listed.stdout and "pod-in-acme-other" not in listed.stdout

    elsewhere = kubectl(kubeconfig, "get", "pods", "-n", "acme-other", home=tmp_path)
    assert elsewhere.returncode != 0
    assert "Forbidden" in elsewhere.stderr and 'in the namespace "acme-other"' in elsewhere.stderr
    for cluster_wide in (["get", "nodes"], ["get", "pods", "--all-namespaces"], ["get", "namespaces"]):
        refused = kubectl(kubeconfig, *cluster_wide, home=tmp_path)
        assert refused.returncode != 0 and "Forbidden" in refused.stderr, cluster_wide


def test_a_viewer_reads_but_cannot_delete(backend, api, environments, spec, tmp_path):
    kubeconfig = download(backend, spec, VERA, tmp_path)
    assert kubectl(kubeconfig, "get", "pods", home=tmp_path).returncode == 0
    deleted = kubectl(kubeconfig, "delete", "pod", "pod-in-acme-vision", "--wait=false", home=tmp_path)
    assert deleted.returncode != 0 and "Forbidden" in deleted.stderr
    assert api.get("pods", "pod-in-acme-vision", spec.namespace) is not None
    member = download(backend, spec, TOM, tmp_path)
    assert kubectl(member, "delete", "pod", "pod-in-acme-vision", "--wait=false", home=tmp_path).returncode == 0


def test_revoked_and_expired_tokens_are_unauthorized(backend, api, environments, spec, tmp_path):
    tom = download(backend, spec, TOM, tmp_path)
    vera = download(backend, spec, VERA, tmp_path)
    backend.revoke_member_access(spec, "tom")
    backend.revoke_member_access(spec, "tom")  # idempotent
    refused = kubectl(tom, "get", "pods", home=tmp_path)
    assert refused.returncode != 0 and UNAUTHORIZED in refused.stderr
    assert kubectl(vera, "get", "pods", home=tmp_path).returncode == 0  # only tom's went

    api.expire_token(yaml.safe_load(vera.read_text())["users"][0]["user"]["token"])
    expired = kubectl(vera, "get", "pods", home=tmp_path)
    assert expired.returncode != 0 and UNAUTHORIZED in expired.stderr


def test_the_portals_own_credentials_keep_full_access(backend, api, environments, spec):
    backend.member_kubeconfig(spec, TOM, expiration_s=3600, timeout_s=5)
    assert backend.environment_exists(spec)  # a cluster-scoped read with the portal's token
    code, answer = api.handle("GET", "/api/v1/nodes", "", b"", authorization="Bearer not-a-token")
    assert code == 401 and answer["reason"] == "Unauthorized"
    code, _ = api.handle("GET", "/api/v1/nodes", "", b"")  # no token: the stand-in's other users
    assert code == 200
