"""Updates the real API server refuses, answered by the stand-in with the real status bodies.

Immutable fields (a Job's template and selector, a Deployment's selector, a RoleBinding's roleRef)
are 422 FieldValueInvalid; a PersistentVolumeClaim may only grow, and only when its StorageClass
allows expansion (422 FieldValueForbidden for a shrink or another change, 403 from admission for
a class that cannot expand). The same holds for apply, merge patches and PUT.
"""

import copy

import pytest

from tests.support.k8s import api_call
from tests.support.k8s_standin import APPLY_PATCH, MERGE_PATCH, KubernetesStandIn

pytestmark = pytest.mark.e2e

NAMESPACE = "acme-train"
JOBS = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"
CLAIMS = f"/api/v1/namespaces/{NAMESPACE}/persistentvolumeclaims"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"


@pytest.fixture
def standin():
    with KubernetesStandIn(expandable_storage_classes={"expandable"}) as api:
        api_call(api, "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        yield api


def apply(api, path: str, body: dict):
    return api_call(api, "PATCH", f"{path}/{body['metadata']['name']}?fieldManager=gpu-portal&force=true", body,
                    content_type=APPLY_PATCH)


def job(image="trainer") -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train", "namespace": NAMESPACE},
            "spec": {"completions": 1, "backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never", "containers": [{"name": "trainer", "image": image}]}}}}


def claim(size="10Gi", storage_class="expandable") -> dict:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "checkpoints", "namespace": NAMESPACE},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": size}},
                     "storageClassName": storage_class}}


def deployment(app="server") -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "serve", "namespace": NAMESPACE},
            "spec": {"replicas": 0, "selector": {"matchLabels": {"app": app}},
                     "template": {"metadata": {"labels": {"app": app}},
                                  "spec": {"containers": [{"name": "server", "image": "server"}]}}}}


def assert_invalid(answer, field: str, cause: str = "FieldValueInvalid"):
    status, body = answer
    assert status == 422, body
    assert body["reason"] == "Invalid" and body["kind"] == "Status"
    assert {"reason": cause, "field": field} == {k: body["details"]["causes"][0][k] for k in ("reason", "field")}


def test_job_template_is_immutable(standin):
    assert apply(standin, JOBS, job())[0] == 201
    assert_invalid(apply(standin, JOBS, job("trainer:2")), "spec.template")
    status, stored = api_call(standin, "GET", f"{JOBS}/train")
    assert stored["spec"]["template"]["spec"]["containers"][0]["image"] == "trainer"
    patch = {"spec": {"template": {"spec": {"containers": [{"name": "trainer", "image": "other"}]}}}}
    assert_invalid(api_call(standin, "PATCH", f"{JOBS}/train", patch, content_type=MERGE_PATCH), "spec.template")
    # What may change does: the same template again is accepted.
    assert apply(standin, JOBS, job())[0] == 200


def test_deployment_selector_is_immutable(standin):
    assert apply(standin, DEPLOYMENTS, deployment())[0] == 201
    assert_invalid(apply(standin, DEPLOYMENTS, deployment("other")), "spec.selector")


def test_claim_may_grow_but_not_shrink_or_change_class(standin):
    assert apply(standin, CLAIMS, claim("10Gi"))[0] == 201
    assert_invalid(apply(standin, CLAIMS, claim("5Gi")), "spec.resources.requests.storage", "FieldValueForbidden")
    assert_invalid(apply(standin, CLAIMS, claim("10Gi", "other")), "spec", "FieldValueForbidden")
    status, grown = apply(standin, CLAIMS, claim("20Gi"))
    assert status == 200 and grown["spec"]["resources"]["requests"]["storage"] == "20Gi"


def test_claim_of_a_class_without_expansion_cannot_grow(standin):
    assert apply(standin, CLAIMS, claim("10Gi", "fixed"))[0] == 201
    status, body = apply(standin, CLAIMS, claim("20Gi", "fixed"))
    assert status == 403 and body["reason"] == "Forbidden", body
    assert "storageclass that provisions the pvc must support resize" in body["message"]


def test_put_is_checked_as_well(standin):
    assert apply(standin, JOBS, job())[0] == 201
    _status, stored = api_call(standin, "GET", f"{JOBS}/train")
    changed = copy.deepcopy(stored)
    changed["spec"]["template"]["spec"]["containers"][0]["image"] = "other"
    assert_invalid(api_call(standin, "PUT", f"{JOBS}/train", changed), "spec.template")
