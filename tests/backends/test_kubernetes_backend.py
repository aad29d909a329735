"""The Kubernetes backend's API calls, against a local stand-in that answers like an API server."""

import json
import subprocess
import sys
import time

import pytest
from kubernetes import client
from kubernetes_validate.utils import latest_version

from runners.backends.base import MemberBinding, PermanentBackendError, TransientBackendError
from runners.backends.kubernetes import KubernetesBackend
from runners.backends.manifests import environment_manifests, service_account_manifest
from runners.clusters.registry import kubernetes_backend_from_settings, kubernetes_backend_options
from tests.support.k8s import client_for, make_spec
from tests.support.k8s_standin import APPLY_PATCH, KubernetesStandIn

pytestmark = pytest.mark.e2e

PLURALS = {
    "Namespace": "namespaces", "ServiceAccount": "serviceaccounts", "ResourceQuota": "resourcequotas",
    "LimitRange": "limitranges", "NetworkPolicy": "networkpolicies", "Role": "roles", "RoleBinding": "rolebindings",
}


def _keys(spec) -> set[tuple[str, str, str]]:
    """Where the stand-in stores each object the spec should produce."""
    return {
        (PLURALS[m["kind"]], m["metadata"].get("namespace", ""), m["metadata"]["name"])
        for m in environment_manifests(spec, username_template="oidc:{username}", portal_namespace="gpu-portal")
    }


def _versions(standin) -> dict:
    return {key: obj["metadata"]["resourceVersion"] for key, obj in standin.objects().items()}


# --- Provisioning ----------------------------------------------------------------


def test_it_creates_every_object_of_the_environment(backend, standin, spec):
    backend.ensure_environment(spec)
    assert set(standin.objects()) == _keys(spec)
    quota = standin.get("resourcequotas", "gpu-quota", "acme-vision")
    assert quota["spec"]["hard"]["requests.nvidia.com/gpu"] == "2"
    editors = standin.get("rolebindings", "portal-editor-members", "acme-vision")
    assert [s["name"] for s in editors["subjects"]] == ["oidc:olivia", "oidc:tom"]


def test_every_object_is_sent_by_server_side_apply_under_one_field_manager(backend, standin, spec):
    backend.ensure_environment(spec)
    patches = [r for r in standin.requests if r.method == "PATCH"]
    assert len(patches) == len(_keys(spec))
    for request in patches:
        assert request.content_type == APPLY_PATCH
        assert request.query["fieldManager"] == ["gpu-portal"]
        assert request.query["force"] == ["true"]
    namespace = standin.get("namespaces", "acme-vision")
    assert {entry["manager"] for entry in namespace["metadata"]["managedFields"]} == {"gpu-portal"}


@pytest.mark.parametrize("version", ["1.30.0", latest_version()])
def test_what_goes_over_the_wire_validates_strictly(spec, version):
    with KubernetesStandIn(validate_version=version) as strict_api:
        KubernetesBackend(client_for(strict_api.url), **kubernetes_backend_options()).ensure_environment(spec)
        assert {r.status for r in strict_api.writes()} <= {200, 201}


def test_the_strict_standin_refuses_an_invalid_object_as_permanent(spec):
    with KubernetesStandIn(validate_version="1.30.0") as strict_api:
        backend = KubernetesBackend(client_for(strict_api.url), **kubernetes_backend_options())
        backend.ensure_environment(spec)
        broken = service_account_manifest(spec) | {"automountServiceAccountToken": "nope"}
        with pytest.raises(PermanentBackendError, match="422 Invalid"):
            backend._apply(broken)


def test_provisioning_twice_changes_nothing_the_second_time(backend, standin, spec):
    backend.ensure_environment(spec)
    before = _versions(standin)
    standin.clear_log()
    backend.ensure_environment(spec)
    assert _versions(standin) == before
    assert [r for r in standin.requests if r.method in ("POST", "DELETE")] == []
    assert {r.status for r in standin.writes()} == {200}  # Applied, and found unchanged: no 201s.


def test_a_namespace_that_already_exists_answering_409_is_success(backend, standin, spec):
    # Another worker (a redelivered copy of the task) creates the namespace between this one's read and its create.
    from runners.backends.manifests import namespace_manifest

    standin.put(namespace_manifest(spec))
    standin.inject(404, method="GET", path_contains="/api/v1/namespaces/acme-vision", reason="NotFound")
    backend.ensure_environment(spec)
    assert ("POST", 409) in [(r.method, r.status) for r in standin.requests]
    assert set(standin.objects()) == _keys(spec)


def test_a_namespace_another_environment_created_in_between_is_not_taken_over(backend, standin, spec):
    backend.ensure_environment(make_spec(environment_id=99))
    standin.inject(404, method="GET", path_contains="/api/v1/namespaces/acme-vision", reason="NotFound")
    with pytest.raises(PermanentBackendError, match="already belongs to portal environment 99"):
        backend.ensure_environment(spec)
    assert standin.get("namespaces", "acme-vision")["metadata"]["labels"]["portal.gpu/environment-id"] == "99"


def test_it_refuses_a_namespace_someone_else_created(backend, standin, spec):
    standin.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "acme-vision", "labels": {"team": "cv"}}})
    with pytest.raises(PermanentBackendError, match="was not made by the portal"):
        backend.ensure_environment(spec)
    labels = standin.get("namespaces", "acme-vision")["metadata"]["labels"]
    assert "pod-security.kubernetes.io/enforce" not in labels, "nothing of ours was put on it"
    assert [key for key in standin.objects() if key[1] == "acme-vision"] == [], "no object was put in it"


def test_it_refuses_a_namespace_that_belongs_to_another_environment(backend, spec):
    backend.ensure_environment(make_spec(environment_id=99))
    with pytest.raises(PermanentBackendError, match="already belongs to portal environment 99"):
        backend.ensure_environment(spec)


def test_a_member_who_left_loses_their_rolebinding(backend, standin, spec):
    backend.ensure_environment(spec)
    assert standin.get("rolebindings", "portal-viewer-members", "acme-vision")
    backend.ensure_environment(make_spec(members=(MemberBinding("olivia", "owner"),)))
    assert standin.get("rolebindings", "portal-viewer-members", "acme-vision") is None
    editors = standin.get("rolebindings", "portal-editor-members", "acme-vision")
    assert [s["name"] for s in editors["subjects"]] == ["oidc:olivia"]
    # Converged: a third call deletes and changes nothing more.
    before = _versions(standin)
    standin.clear_log()
    backend.ensure_environment(make_spec(members=(MemberBinding("olivia", "owner"),)))
    assert _versions(standin) == before and [r for r in standin.requests if r.method == "DELETE"] == []


def test_objects_the_portal_did_not_make_are_left_alone(backend, standin, spec):
    backend.ensure_environment(spec)
    standin.put({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "platform-oncall", "namespace": "acme-vision"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "oncall"}],
    })
    backend.ensure_environment(make_spec(members=()))
    assert standin.get("rolebindings", "platform-oncall", "acme-vision")


def test_ensuring_while_the_namespace_is_terminating_is_transient(standin, make_backend, spec):
    backend = make_backend()
    backend.ensure_environment(spec)
    standin.termination_delay_s = 60  # Terminating for the whole test, however slow the machine.
    client.CoreV1Api(client_for(standin.url)).delete_namespace("acme-vision")
    with pytest.raises(TransientBackendError, match="still being deleted"):
        backend.ensure_environment(spec)


def test_a_create_refused_because_the_namespace_is_terminating_is_transient(backend, standin, spec):
    # The namespace read said Active, then it went Terminating before the objects were applied.
    backend.ensure_environment(spec)
    standin.termination_delay_s = 60  # Terminating for the whole test, however slow the machine.
    client.CoreV1Api(client_for(standin.url)).delete_namespace("acme-vision")
    late_object = service_account_manifest(spec) | {"metadata": {"name": "another", "namespace": "acme-vision"}}
    with pytest.raises(TransientBackendError, match="being terminated"):
        backend._apply(late_object)


def test_a_namespace_deleted_while_applying_is_transient(backend, standin, spec):
    standin.inject(404, method="PATCH", path_contains="/serviceaccounts/", reason="NotFound",
                   message='namespaces "acme-vision" not found', details={"name": "acme-vision", "kind": "namespaces"})
    with pytest.raises(TransientBackendError, match="deleted meanwhile"):
        backend.ensure_environment(spec)


def test_an_unknown_member_role_is_permanent(backend, spec):
    with pytest.raises(PermanentBackendError, match="superuser"):
        backend.ensure_environment(make_spec(members=(MemberBinding("mallory", "superuser"),)))


# --- Teardown --------------------------------------------------------------------


def _namespace_deletes(standin):
    return [r for r in standin.requests if r.method == "DELETE" and r.path == "/api/v1/namespaces/acme-vision"]


def test_teardown_asks_once_never_waits_and_reports_gone_only_once_the_namespace_is(standin, make_backend, spec):
    standin.termination_delay_s = 30
    backend = make_backend()
    backend.ensure_environment(spec)
    started = time.monotonic()
    assert backend.delete_environment(spec) is False, "Terminating: not gone yet"
    assert time.monotonic() - started < 2, "it returns at once rather than waiting for the namespace"
    assert backend.delete_environment(spec) is False
    assert len(_namespace_deletes(standin)) == 1, "a Terminating namespace is not deleted a second time"
    standin.finish_termination("acme-vision")
    assert backend.delete_environment(spec) is True
    assert standin.objects() == {}
    assert not backend.environment_exists(spec)
    assert len(_namespace_deletes(standin)) == 1


def test_deleting_an_environment_that_is_already_gone_is_a_no_op(backend, standin, spec):
    assert backend.delete_environment(spec) is True
    # Its members' ServiceAccounts (in the members namespace) are looked for, then the namespace: nothing deleted.
    assert [(r.method, r.status) for r in standin.requests] == [("GET", 200), ("GET", 404)]
    assert "/namespaces/gpu-portal-members/serviceaccounts" in standin.requests[0].path


def test_it_never_deletes_a_namespace_of_another_environment(backend, standin, spec):
    backend.ensure_environment(make_spec(environment_id=99))
    with pytest.raises(PermanentBackendError, match="refusing to delete"):
        backend.delete_environment(spec)
    assert standin.get("namespaces", "acme-vision")["status"]["phase"] == "Active"


def test_it_leaves_a_namespace_the_portal_did_not_make(backend, standin, spec):
    standin.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "acme-vision"}})
    assert backend.delete_environment(spec) is True, "nothing of this environment is there"
    assert standin.get("namespaces", "acme-vision")["status"]["phase"] == "Active"
    assert not backend.environment_exists(spec)


def test_a_namespace_someone_else_already_deleted_is_waited_on_not_deleted_again(backend, standin, spec):
    standin.termination_delay_s = 30
    backend.ensure_environment(spec)
    client.CoreV1Api(client_for(standin.url)).delete_namespace("acme-vision")
    assert backend.delete_environment(spec) is False
    assert len(_namespace_deletes(standin)) == 1, "only the first delete was sent"
    standin.finish_termination("acme-vision")
    assert backend.delete_environment(spec) is True
    assert standin.objects() == {}


def test_environment_exists_follows_the_namespace(backend, spec):
    assert not backend.environment_exists(spec)
    backend.ensure_environment(spec)
    assert backend.environment_exists(spec)


# --- Errors ------------------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 503, 429, 504])
def test_server_trouble_and_throttling_are_transient(backend, standin, spec, status):
    standin.inject(status, method="PATCH", message="etcdserver: request timed out")
    with pytest.raises(TransientBackendError, match="etcdserver"):
        backend.ensure_environment(spec)
    backend.ensure_environment(spec)  # The retry succeeds.
    assert set(standin.objects()) == _keys(spec)


def test_forbidden_is_permanent_and_says_what_the_api_said(backend, standin, spec):
    message = 'namespaces is forbidden: User "system:serviceaccount:portal:portal" cannot create resource "namespaces"'
    standin.inject(403, method="POST", reason="Forbidden", message=message)
    with pytest.raises(PermanentBackendError) as raised:
        backend.ensure_environment(spec)
    assert message in str(raised.value) and "credentials" in str(raised.value)


@pytest.mark.parametrize("status", [400, 401, 422])
def test_bad_requests_and_bad_credentials_are_permanent(backend, standin, spec, status):
    standin.inject(status, method="PATCH", message="spec.hard: Invalid value")
    with pytest.raises(PermanentBackendError, match="Invalid value"):
        backend.ensure_environment(spec)


def test_a_conflict_other_than_already_exists_is_transient(backend, standin, spec):
    standin.inject(409, method="PATCH", reason="Conflict", message="the object has been modified")
    with pytest.raises(TransientBackendError, match="has been modified"):
        backend.ensure_environment(spec)


def test_a_request_that_times_out_is_transient(standin, make_backend, spec):
    backend = make_backend(request_timeout_s=0.2)
    standin.inject(200, method="GET", delay_s=1.0, count=10)
    with pytest.raises(TransientBackendError, match="could not be reached"):
        backend.environment_exists(spec)


def test_an_api_server_that_is_down_is_transient(spec):
    with KubernetesStandIn() as gone:
        url = gone.url
    backend = KubernetesBackend(client_for(url), **kubernetes_backend_options() | {"request_timeout_s": 1})
    with pytest.raises(TransientBackendError, match="could not be reached"):
        backend.environment_exists(spec)


# --- Settings and the stand-in itself --------------------------------------------------


def test_from_settings_reads_the_kubeconfig(settings, standin, tmp_path, spec):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: standin\n"
        f"clusters: [{{name: standin, cluster: {{server: '{standin.url}'}}}}]\n"
        "users: [{name: portal, user: {token: not-a-secret}}]\n"
        "contexts: [{name: standin, context: {cluster: standin, user: portal}}]\n"
    )
    settings.KUBECONFIG = str(kubeconfig)
    settings.KUBERNETES_IN_CLUSTER = False
    settings.KUBERNETES_USERNAME_TEMPLATE = "sso:{username}"
    backend = kubernetes_backend_from_settings()
    assert backend.name == "kubernetes" and backend.username_template == "sso:{username}"
    backend.ensure_environment(spec)
    assert standin.get("rolebindings", "portal-viewer-members", "acme-vision")["subjects"][0]["name"] == "sso:vera"


def test_from_settings_without_a_kubeconfig_is_permanent(settings, tmp_path):
    settings.KUBECONFIG = str(tmp_path / "missing")
    settings.KUBERNETES_IN_CLUSTER = False
    with pytest.raises(PermanentBackendError, match="KUBECONFIG"):
        kubernetes_backend_from_settings()


def test_the_standin_answers_not_found_and_already_exists_like_an_api_server(standin):
    core = client.CoreV1Api(client_for(standin.url))
    with pytest.raises(client.ApiException) as missing:
        core.read_namespace("nowhere")
    assert missing.value.status == 404 and '"reason": "NotFound"' in missing.value.body
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "here"}}
    assert core.create_namespace(body).metadata.name == "here"
    with pytest.raises(client.ApiException) as exists:
        core.create_namespace(body)
    assert exists.value.status == 409 and '"reason": "AlreadyExists"' in exists.value.body


def test_the_standin_answers_410_gone_to_a_watch_from_a_compacted_version(standin):
    core = client.CoreV1Api(client_for(standin.url))
    old_version = core.list_namespace().metadata.resource_version
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "later"}})
    events = core.list_namespace(watch=True, resource_version=old_version, _preload_content=False).data
    assert b'"ADDED"' in events and b'"later"' in events
    standin.compact()
    # As a real API server does: 200, and an ERROR event holding the 410 Status.
    event = json.loads(core.list_namespace(watch=True, resource_version=old_version, _preload_content=False).data)
    assert event["type"] == "ERROR" and (event["object"]["code"], event["object"]["reason"]) == (410, "Expired")
    # Or, as some proxies answer, HTTP 410 itself.
    standin.gone_as = "status"
    with pytest.raises(client.ApiException) as gone:
        core.list_namespace(watch=True, resource_version=old_version, _preload_content=False)
    assert gone.value.status == 410 and '"reason": "Expired"' in gone.value.body


def test_a_process_using_the_backend_imports_the_client_without_its_validator():
    """The client's optional validator (and jsonschema's grammars with it) cost 1.5 s of CPU a worker: it stays out,
    and a process that wants it still imports it whole (runners/backends/k8s_client.py)."""
    code = (
        "import sys, django\n"
        "django.setup()\n"
        "import runners.backends.kubernetes, kubernetes.dynamic.client as dynamic_client\n"
        "print(sorted(name for name in ('kubernetes_validate', 'jsonschema') if name in sys.modules),"
        " dynamic_client.HAS_KUBERNETES_VALIDATE)\n"
        "import kubernetes_validate\n"
        "print(callable(kubernetes_validate.validate))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[] False", "True"]
