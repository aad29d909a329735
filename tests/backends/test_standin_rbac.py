"""The portal's own token on the stand-in may do what deploy/'s RBAC grants its ServiceAccount and no
more, as on a real cluster: a verb missing from the ClusterRole is a 403 with the API server's wording,
and writing a Role or RoleBinding that grants more than the portal holds needs escalate or bind.
"""

import dataclasses

import pytest

from runners.backends.base import PermanentBackendError
from tests.support.k8s import api_call, deploy_rbac
from tests.support.k8s_standin import APPLY_PATCH, KubernetesStandIn

pytestmark = pytest.mark.e2e

PORTAL = "system:serviceaccount:gpu-portal:gpu-portal"
NS = "acme-rbac"


def without(rbac: list[dict], resource: str, verb: str) -> list[dict]:
    """deploy/'s RBAC with one verb taken from the ClusterRole's rule for a resource."""
    for obj in rbac:
        if obj["kind"] == "ClusterRole":
            for rule in obj["rules"]:
                if resource in rule["resources"] and verb in rule["verbs"]:
                    rule["verbs"].remove(verb)
    return rbac


@pytest.fixture
def standin():
    with KubernetesStandIn(admin_tokens={"portal"}, portal_rbac=deploy_rbac()) as api:
        api_call(api, "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        yield api


def apply(api, path: str, body: dict):
    return api_call(api, "PATCH", f"{path}/{body['metadata']['name']}?fieldManager=gpu-portal&force=true", body,
                    content_type=APPLY_PATCH, token="portal")


def role(name: str) -> dict:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": name, "namespace": NS},
            "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]}


def test_what_the_cluster_role_grants_is_allowed_and_nothing_else(standin):
    assert api_call(standin, "GET", "/api/v1/nodes", token="portal")[0] == 200
    status, answer = api_call(standin, "GET", f"/api/v1/namespaces/{NS}/pods/some-pod", token="portal")
    assert status == 403 and answer["reason"] == "Forbidden", answer
    assert answer["message"] == (f'pods "some-pod" is forbidden: User "{PORTAL}" cannot get resource "pods" in API '
                                 f'group "" in the namespace "{NS}"')
    assert answer["details"] == {"name": "some-pod", "kind": "pods"}
    # The GPU Operator's ConfigMaps are the portal's only in the operator's namespace.
    status, _ = api_call(standin, "GET", f"/api/v1/namespaces/{NS}/configmaps/portal-mig-parted-config", token="portal")
    assert status == 403
    # Without a token (the stand-in's other tests), everything is allowed as before.
    assert api_call(standin, "GET", f"/api/v1/namespaces/{NS}/pods/some-pod")[0] == 404


def test_an_apply_that_creates_needs_create(standin):
    standin.portal_rbac = without(standin.portal_rbac, "jobs", "create")
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "namespace": NS},
           "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "i"}]}}}}
    status, answer = apply(standin, f"/apis/batch/v1/namespaces/{NS}/jobs", job)
    assert status == 403 and "cannot create resource \"jobs\"" in answer["message"], answer


def binding(role_name: str) -> dict:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": f"olivia-{role_name}", "namespace": NS},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role_name},
            "subjects": [{"kind": "User", "name": "oidc:olivia"}]}


def test_roles_beyond_the_portal_need_escalate_or_bind_on_their_name(standin):
    path = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}"
    # portal-viewer grants reading Secrets, which the portal itself may not: escalate on that name allows it.
    assert apply(standin, f"{path}/roles", role("portal-viewer"))[0] == 201
    assert apply(standin, f"{path}/rolebindings", binding("portal-viewer"))[0] == 201
    # Someone else's Role with the same rights: the portal may not bind it (no bind on that name).
    standin.put(role("other"))
    status, answer = apply(standin, f"{path}/rolebindings", binding("other"))
    assert status == 403 and "attempting to grant RBAC permissions not currently held" in answer["message"], answer


def test_a_missing_verb_fails_the_backend(make_backend, standin, spec):
    """The backend's own calls through the portal's token: a ClusterRole without create on namespaces breaks
    ensure_environment with the API server's 403, as it would in production."""
    standin.admin_tokens = {"standin-token"}
    backend = make_backend()
    backend.ensure_environment(spec)
    standin.portal_rbac = without(standin.portal_rbac, "namespaces", "create")
    with pytest.raises(PermanentBackendError, match="cannot create resource \"namespaces\""):
        backend.ensure_environment(dataclasses.replace(spec, namespace="acme-other", environment_id=8))
