"""A member's own kubeconfig on the Kubernetes backend: the objects it is made of, and the real kubectl using it.

The stand-in serves HTTPS here (kubectl sends a bearer token only over TLS) and checks
every body it is sent with kubernetes-validate in strict mode, as a server with
fieldValidation=Strict would.
"""

import base64
import json
import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from runners.backends import k8s_access
from runners.backends.base import MemberBinding, PermanentBackendError, TransientBackendError
from runners.backends.kubernetes import KubernetesBackend
from runners.backends.manifests import EDITOR_ROLE, VIEWER_ROLE, environment_manifests
from runners.clusters.registry import kubernetes_backend_options
from tests.support.k8s import kubectl, make_spec, portal_kubeconfig, portal_pod
from tests.support.k8s_standin import KubernetesStandIn

pytestmark = pytest.mark.e2e

KUBERNETES_VERSIONS = ("1.30.0", latest_version())
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
ACCOUNTS = "gpu-portal-members"  # KUBERNETES_MEMBER_ACCOUNTS_NAMESPACE's default
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
        for manifest in k8s_access.member_access_manifests(spec, member, accounts_namespace=ACCOUNTS):
            yield pytest.param(manifest, id=f"{member.role}-{manifest['kind']}")
    yield pytest.param(k8s_access.token_request_manifest(expiration_s=3600), id="TokenRequest")
    yield pytest.param(k8s_access.accounts_namespace_manifest(ACCOUNTS), id="members-Namespace")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("manifest", list(_access_manifests()))
def test_every_access_manifest_validates_strictly(manifest, version):
    kubernetes_validate.validate(manifest, version, strict=True)


def test_access_is_namespaced_and_bound_to_the_tier_role_only():
    spec = make_spec()
    for member, role in ((MemberBinding("olivia", "owner"), EDITOR_ROLE), (TOM, EDITOR_ROLE), (VERA, VIEWER_ROLE)):
        account, binding = k8s_access.member_access_manifests(spec, member, accounts_namespace=ACCOUNTS)
        assert {account["kind"], binding["kind"]} == {"ServiceAccount", "RoleBinding"}  # never a ClusterRoleBinding
        # The ServiceAccount is out of the tenant's reach; the binding is in the environment's namespace only.
        assert account["metadata"]["namespace"] == ACCOUNTS and binding["metadata"]["namespace"] == spec.namespace
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                        "namespace": ACCOUNTS}]
        assert account["automountServiceAccountToken"] is False


@pytest.mark.parametrize("username", ["tom", "Ann.Lee@example.com", "ann-lee", "___", "x" * 150, "ÉLODIE"])
def test_service_account_names_are_dns_labels(username):
    namespace = "a" * 30 + "--" + "b" * 31
    for name in [k8s_access.service_account_name(username, namespace),
                 *k8s_access.all_role_binding_names(username, namespace)]:
        assert len(name) <= 63 and DNS_LABEL.match(name), name


def test_usernames_that_read_alike_get_different_service_accounts():
    names = {k8s_access.service_account_name(u, "acme-vision")
             for u in ("ann.lee", "ann-lee", "Ann.Lee", "ann_lee", "x" * 40 + "a", "x" * 40 + "b")}
    assert len(names) == 6
    assert k8s_access.service_account_name("tom", "acme-vision") == k8s_access.service_account_name("tom", "acme-vision")


def test_each_environment_gets_its_own_service_account_named_by_a_long_hash():
    vision, other = (k8s_access.service_account_name("tom", ns) for ns in ("acme-vision", "acme-other"))
    assert vision != other
    assert re.fullmatch(r"member-tom-[0-9a-f]{16}", vision)  # 64 bits: not an 8-hex hash anyone can collide


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
    assert (minted.namespace, minted.service_account) == (ACCOUNTS, k8s_access.service_account_name("tom", spec.namespace))
    assert before + timedelta(seconds=3590) <= config.expires_at <= datetime.now(UTC) + timedelta(seconds=3601)
    binding = api.get("rolebindings", k8s_access.role_binding_name("tom", spec.namespace, "member"), spec.namespace)
    assert binding["roleRef"]["name"] == EDITOR_ROLE
    assert not any(plural.startswith("cluster") for plural, _ns, _name in api.objects())


def test_asking_again_converges_and_mints_another_token(backend, api, environments, spec):
    first = backend.member_kubeconfig(spec, TOM, expiration_s=3600, timeout_s=5)
    second = backend.member_kubeconfig(spec, TOM, expiration_s=3600, timeout_s=5)
    assert first.text != second.text and len(api.tokens) == 2
    accounts = [name for plural, ns, name in api.objects() if plural == "serviceaccounts" and name.startswith("member-")]
    assert accounts == [k8s_access.service_account_name("tom", spec.namespace)]


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
    names = {(plural, name) for plural, ns, name in api.objects() if ns in (spec.namespace, ACCOUNTS)}
    assert ("rolebindings", k8s_access.role_binding_name("tom", spec.namespace, "viewer")) in names
    assert ("rolebindings", k8s_access.role_binding_name("tom", spec.namespace, "member")) not in names
    assert ("serviceaccounts", k8s_access.service_account_name("tom", spec.namespace)) in names
    vera = k8s_access.service_account_name("vera", spec.namespace)
    assert not any(name.startswith(vera) for _plural, name in names)  # vera left


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


# --- Where members' ServiceAccounts live, and who may touch them ------------------------------


def test_member_service_accounts_live_out_of_the_tenants_reach(backend, api, environments, spec, tmp_path):
    """An editor can make pods in their namespace; none may run as a colleague's ServiceAccount there."""
    download(backend, spec, VERA, tmp_path)
    tom = download(backend, spec, TOM, tmp_path)
    in_tenant_namespace = [name for plural, ns, name in api.objects() if plural == "serviceaccounts"
                           and ns == spec.namespace and name.startswith("member-")]
    assert in_tenant_namespace == []
    vera = k8s_access.service_account_name("vera", spec.namespace)
    assert api.get("serviceaccounts", vera, ACCOUNTS)["metadata"]["labels"][k8s_access.MEMBER_ACCESS_LABEL] == "true"
    for where in (["get", "serviceaccounts", "-n", ACCOUNTS], ["get", "pods", "-n", ACCOUNTS]):
        refused = kubectl(tom, *where, home=tmp_path)
        assert refused.returncode != 0 and "Forbidden" in refused.stderr, where


def test_a_token_opens_one_environment_even_of_the_same_tenant(backend, api, environments, spec, tmp_path):
    _spec, other = environments
    here = download(backend, spec, TOM, tmp_path)
    there = tmp_path / "there.yaml"
    there.write_text(backend.member_kubeconfig(other, TOM, expiration_s=3600, timeout_s=5).text)
    assert kubectl(there, "get", "pods", home=tmp_path).returncode == 0
    refused = kubectl(here, "get", "pods", "-n", other.namespace, home=tmp_path)
    assert refused.returncode != 0 and f'in the namespace "{other.namespace}"' in refused.stderr


def test_the_generic_prune_leaves_a_download_made_meanwhile_alone(backend, api, environments, spec, tmp_path):
    """A re-sync's prune lists after its converge did; a ServiceAccount and binding made in between stay."""
    kubeconfig = download(backend, spec, TOM, tmp_path)
    manifests = environment_manifests(spec, username_template=backend.username_template,
                                      portal_namespace=backend.portal_namespace)
    backend._prune(spec, wanted={(m["kind"], m["metadata"]["name"]) for m in manifests})
    assert api.get("rolebindings", k8s_access.role_binding_name("tom", spec.namespace, "member"), spec.namespace)
    assert kubectl(kubeconfig, "get", "pods", home=tmp_path).returncode == 0


def test_deleting_the_environment_deletes_its_members_service_accounts(backend, api, environments, spec, tmp_path):
    _spec, other = environments
    download(backend, spec, TOM, tmp_path)
    backend.member_kubeconfig(other, TOM, expiration_s=3600, timeout_s=5)
    backend.delete_environment(spec)
    accounts = {name for plural, ns, name in api.objects() if plural == "serviceaccounts" and ns == ACCOUNTS}
    assert accounts == {k8s_access.service_account_name("tom", other.namespace)}  # the other environment's stays


def test_a_service_account_name_held_by_another_user_is_refused(backend, api, environments, spec):
    name = k8s_access.service_account_name("tom", spec.namespace)
    api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ACCOUNTS}})
    api.put({"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": name, "namespace": ACCOUNTS, "annotations": {k8s_access.USERNAME_ANNOTATION: "eve"}}})
    with pytest.raises(k8s_access.AccessRefused, match="already exists for eve, not tom"):
        backend.member_kubeconfig(spec, TOM, expiration_s=3600, timeout_s=5)
    assert api.tokens == {}


def test_a_refused_token_request_is_permanent_and_names_the_cluster(backend, api, environments, spec):
    api.inject(403, method="POST", path_contains="/token")
    with pytest.raises(PermanentBackendError, match=re.escape(f"The Kubernetes cluster at {api.url} refused")):
        backend.member_kubeconfig(spec, TOM, expiration_s=3600, timeout_s=5)


def test_the_kubeconfig_names_the_configured_server_and_ca(api, environments, spec, tmp_path):
    ca = tmp_path / "public-ca.pem"
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    kubeconfig = tmp_path / "portal-kubeconfig"
    kubeconfig.write_text(portal_kubeconfig(api))
    options = kubernetes_backend_options() | dict(
        request_timeout_s=5, kubeconfig_server_url="https://k8s.example.com:6443", kubeconfig_ca_file=str(ca))
    backend = KubernetesBackend.from_kubeconfig(in_cluster=False, kubeconfig=str(kubeconfig), **options)
    cluster = yaml.safe_load(backend.member_kubeconfig(spec, TOM, expiration_s=3600, timeout_s=5).text)
    entry = cluster["clusters"][0]["cluster"]
    assert entry["server"] == "https://k8s.example.com:6443"
    assert base64.b64decode(entry["certificate-authority-data"]) == ca.read_bytes()


def test_no_kubeconfig_without_tls_verification(api, environments, spec, tmp_path):
    kubeconfig = tmp_path / "portal-kubeconfig"
    insecure = yaml.safe_load(portal_kubeconfig(api))
    insecure["clusters"][0]["cluster"] = {"server": api.url, "insecure-skip-tls-verify": True}
    kubeconfig.write_text(yaml.safe_dump(insecure))
    options = kubernetes_backend_options() | dict(request_timeout_s=5)
    backend = KubernetesBackend.from_kubeconfig(in_cluster=False, kubeconfig=str(kubeconfig), **options)
    with pytest.raises(k8s_access.AccessRefused, match="KUBECONFIG_CA_FILE"):
        backend.member_kubeconfig(spec, TOM, expiration_s=3600, timeout_s=5)
    assert api.tokens == {}


def test_the_standin_binds_a_service_account_of_another_namespace_by_its_namespace(api, backend, environments, spec):
    """A subject naming members/x grants members/x, and not a ServiceAccount x of the binding's own namespace."""
    api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ACCOUNTS}})
    for namespace in (ACCOUNTS, spec.namespace):
        api.put({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "x", "namespace": namespace}})
    api.put({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "x", "namespace": spec.namespace},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": VIEWER_ROLE},
             "subjects": [{"kind": "ServiceAccount", "name": "x", "namespace": ACCOUNTS}]})
    request = json.dumps(k8s_access.token_request_manifest(expiration_s=3600)).encode()
    pods = f"/api/v1/namespaces/{spec.namespace}/pods"
    for namespace, allowed in ((ACCOUNTS, 200), (spec.namespace, 403)):
        code, minted = api.handle("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/x/token",
                                  "application/json", request)
        assert code == 201, minted
        code, _ = api.handle("GET", pods, "", b"", authorization=f"Bearer {minted['status']['token']}")
        assert code == allowed, namespace
