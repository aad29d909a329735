"""Server-side apply on the stand-in as a merge, as the API server's structured-merge-diff does it:
fields of several managers merge (map lists by their keys), a field another manager owns with another
value is a 409 conflict unless forced, and a field a manager dropped goes unless someone else owns it.
"""

import pytest

from tests.support.k8s import api_call
from tests.support.k8s_standin import APPLY_PATCH, KubernetesStandIn

pytestmark = pytest.mark.e2e

NS = "acme-vision"
CM = f"/api/v1/namespaces/{NS}/configmaps"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"


@pytest.fixture
def standin():
    with KubernetesStandIn() as api:
        api_call(api, "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        yield api


def apply(api, path: str, body: dict, manager: str, *, force: bool = False):
    query = f"?fieldManager={manager}" + ("&force=true" if force else "")
    return api_call(api, "PATCH", f"{path}/{body['metadata']['name']}{query}", body, content_type=APPLY_PATCH)


def config_map(data: dict, labels: dict | None = None) -> dict:
    metadata = {"name": "settings", "namespace": NS, **({"labels": labels} if labels else {})}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def deployment(container: str) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "serve", "namespace": NS},
            "spec": {"selector": {"matchLabels": {"app": "llm"}},
                     "template": {"metadata": {"labels": {"app": "llm"}},
                                  "spec": {"containers": [{"name": container, "image": container}]}}}}


def test_two_managers_keys_in_one_map_merge(standin):
    assert apply(standin, CM, config_map({"a": "1"}, {"team": "vision"}), "portal")[0] == 201
    status, merged = apply(standin, CM, config_map({"b": "2"}, {"owner": "ops"}), "ops")
    assert status == 200, merged
    assert merged["data"] == {"a": "1", "b": "2"}
    assert merged["metadata"]["labels"] == {"team": "vision", "owner": "ops"}
    assert {entry["manager"]: entry["operation"] for entry in merged["metadata"]["managedFields"]} == \
        {"portal": "Apply", "ops": "Apply"}
    portal = next(e for e in merged["metadata"]["managedFields"] if e["manager"] == "portal")
    assert portal["fieldsType"] == "FieldsV1" and portal["fieldsV1"]["f:data"] == {"f:a": {}}


def test_a_field_its_only_manager_drops_is_removed(standin):
    apply(standin, CM, config_map({"a": "1", "b": "2"}), "portal")
    status, pruned = apply(standin, CM, config_map({"a": "1"}), "portal")
    assert status == 200 and pruned["data"] == {"a": "1"}, pruned


def test_a_dropped_field_another_manager_also_owns_stays(standin):
    apply(standin, CM, config_map({"a": "1", "b": "2"}), "portal")
    apply(standin, CM, config_map({"b": "2"}), "ops")  # the same value: both own it
    _status, kept = apply(standin, CM, config_map({"a": "1"}), "portal")
    assert kept["data"] == {"a": "1", "b": "2"}


def test_another_managers_value_is_a_conflict_unless_forced(standin):
    apply(standin, CM, config_map({"a": "1"}), "portal")
    status, answer = apply(standin, CM, config_map({"a": "2"}), "ops")
    assert status == 409 and answer["reason"] == "Conflict", answer
    assert answer["message"] == 'Apply failed with 1 conflict: conflict with "portal" using v1: .data.a'
    assert answer["details"]["causes"] == [
        {"reason": "FieldManagerConflict", "field": ".data.a", "message": 'conflict with "portal" using v1'}]
    status, forced = apply(standin, CM, config_map({"a": "2"}), "ops", force=True)
    assert status == 200 and forced["data"] == {"a": "2"}
    # The field is ops' now: the portal dropping it removes nothing.
    _status, after = apply(standin, CM, config_map({"c": "3"}), "portal")
    assert after["data"] == {"a": "2", "c": "3"}


def test_map_lists_merge_by_their_keys(standin):
    """containers is a map list keyed by name: two managers' containers are both kept."""
    assert apply(standin, DEPLOYMENTS, deployment("server"), "portal")[0] == 201
    status, merged = apply(standin, DEPLOYMENTS, deployment("sidecar"), "mesh")
    assert status == 200, merged
    names = [c["name"] for c in merged["spec"]["template"]["spec"]["containers"]]
    assert names == ["server", "sidecar"]
    # The portal dropping its container removes that one only.
    _status, after = apply(standin, DEPLOYMENTS, {**deployment("server"), "spec": {
        **deployment("server")["spec"], "template": {"metadata": {"labels": {"app": "llm"}},
                                                     "spec": {"containers": [{"name": "proxy", "image": "proxy"}]}}}},
        "portal")
    assert [c["name"] for c in after["spec"]["template"]["spec"]["containers"]] == ["sidecar", "proxy"]
