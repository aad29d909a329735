"""The stand-in's controllers make pods on their own, a moment after their Job or ReplicaSet, and record
a pod create the API server refuses as the real ones do: a Warning Event FailedCreate on the owner (core
v1, what client-go's EventRecorder writes), bumped on each retry, the pod made once the refusal is gone;
Events are listed with the field selectors the API server supports (400 for another).
"""

import pytest

from tests.support.k8s import api_call
from tests.support.k8s_standin import KubernetesStandIn
from tests.support.races import wait_until

pytestmark = pytest.mark.e2e

NS = "acme-train"
EVENTS = f"/api/v1/namespaces/{NS}/events"
QUOTAS = f"/api/v1/namespaces/{NS}/resourcequotas"


@pytest.fixture
def standin():
    with KubernetesStandIn(termination_delay_s=0.2, check_answers=True, failed_create_backoff_s=0.05) as api:
        status, _ = api_call(api, "POST", "/api/v1/namespaces",
                             {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        assert status == 201
        yield api
        assert api.invalid_answers == [] and api.controller_errors == []


def job(name: str = "job-7-1", completions: int = 2) -> dict:
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": NS},
        "spec": {"completionMode": "Indexed", "completions": completions, "parallelism": completions,
                 "backoffLimit": 0,
                 "template": {"spec": {"restartPolicy": "Never", "containers": [
                     {"name": "trainer", "image": "trainer", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}},
    }


def replica_set(name: str = "llm-5d8f", replicas: int = 1) -> dict:
    labels = {"app": "llm"}
    return {
        "apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": name, "namespace": NS},
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {"containers": [
                     {"name": "server", "image": "server", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}},
    }


def quota(gpus: str) -> dict:
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpus", "namespace": NS},
            "spec": {"hard": {"requests.nvidia.com/gpu": gpus}}}


def create(api, path: str, body: dict) -> dict:
    status, answer = api_call(api, "POST", path, body)
    assert status == 201, answer
    return answer


def set_quota(api, gpus: str) -> None:
    status, answer = api_call(api, "PATCH", f"{QUOTAS}/gpus", {"spec": {"hard": {"requests.nvidia.com/gpu": gpus}}},
                              content_type="application/merge-patch+json")
    assert status == 200, answer


def failed_creates(api, kind: str, name: str) -> list[dict]:
    status, listing = api_call(api, "GET", f"{EVENTS}?fieldSelector=involvedObject.kind%3D{kind},"
                                           f"involvedObject.name%3D{name},reason%3DFailedCreate")
    assert status == 200, listing
    return listing["items"]


def test_a_job_s_pods_come_a_moment_later_from_the_controllers_own_pass():
    with KubernetesStandIn(controller_delay_s=0.3) as api:
        create(api, "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        created = create(api, f"/apis/batch/v1/namespaces/{NS}/jobs", job())
        # The create has returned; the Job controller has not made its pods yet.
        assert api.pods(NS, as_is=True) == []
        requests = len(api.requests)
        # No request is needed for them to appear: the controllers' own thread makes them.
        assert wait_until(lambda: len(api.pods(NS, as_is=True)) == 2, timeout_s=10)
        assert len(api.requests) == requests
        owners = {pod["metadata"]["ownerReferences"][0]["uid"] for pod in api.pods(NS, as_is=True)}
        assert owners == {created["metadata"]["uid"]}


def test_a_job_over_quota_records_failed_create_and_gets_its_pods_once_the_quota_grows(standin):
    create(standin, QUOTAS, quota("1"))
    created = create(standin, f"/apis/batch/v1/namespaces/{NS}/jobs", job())
    # Index 0 fits; index 1 is refused by the quota, and again on each retry.
    assert wait_until(lambda: (failed_creates(standin, "Job", "job-7-1") or [{}])[0].get("count", 0) >= 2, timeout_s=10)
    (event,) = failed_creates(standin, "Job", "job-7-1")
    assert len(standin.pods(NS)) == 1
    assert event["type"] == "Warning" and event["reason"] == "FailedCreate"
    assert event["message"].startswith("Error creating: pods \"job-7-1-1-")
    assert "is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=1, used: " \
           "requests.nvidia.com/gpu=1, limited: requests.nvidia.com/gpu=1" in event["message"]
    assert event["involvedObject"] | {"resourceVersion": None} == {
        "kind": "Job", "apiVersion": "batch/v1", "name": "job-7-1", "namespace": NS,
        "uid": created["metadata"]["uid"], "resourceVersion": None}
    assert event["source"] == {"component": "job-controller"}
    assert event["firstTimestamp"] <= event["lastTimestamp"]
    assert event["metadata"]["name"].startswith("job-7-1.")
    set_quota(standin, "2")
    assert wait_until(lambda: len(standin.pods(NS)) == 2, timeout_s=10)
    indexes = sorted(pod["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] for pod in standin.pods(NS))
    assert indexes == ["0", "1"]
    count = failed_creates(standin, "Job", "job-7-1")[0]["count"]
    assert wait_until(lambda: standin.get("jobs", "job-7-1", NS)["status"].get("active") == 2, timeout_s=10)
    assert failed_creates(standin, "Job", "job-7-1")[0]["count"] == count  # no refusal since


def test_a_replica_set_over_quota_records_failed_create_too(standin):
    create(standin, QUOTAS, quota("0"))
    created = create(standin, f"/apis/apps/v1/namespaces/{NS}/replicasets", replica_set())
    assert wait_until(lambda: failed_creates(standin, "ReplicaSet", "llm-5d8f"), timeout_s=10)
    (event,) = failed_creates(standin, "ReplicaSet", "llm-5d8f")
    assert event["source"] == {"component": "replicaset-controller"}
    assert event["involvedObject"]["uid"] == created["metadata"]["uid"]
    assert event["involvedObject"]["apiVersion"] == "apps/v1"
    assert "exceeded quota: gpus" in event["message"]
    assert standin.pods(NS) == []
    set_quota(standin, "1")
    assert wait_until(lambda: len(standin.pods(NS)) == 1, timeout_s=10)


def test_pod_security_refusals_are_recorded_the_same_way(standin):
    status, answer = api_call(standin, "PATCH", f"/api/v1/namespaces/{NS}",
                              {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}},
                              content_type="application/merge-patch+json")
    assert status == 200, answer
    create(standin, f"/apis/batch/v1/namespaces/{NS}/jobs", job(completions=1))
    assert wait_until(lambda: failed_creates(standin, "Job", "job-7-1"), timeout_s=10)
    assert 'violates PodSecurity "restricted:latest"' in failed_creates(standin, "Job", "job-7-1")[0]["message"]


@pytest.mark.parametrize("selector", ["spec.nodeName%3Dgpu-a", "involvedObject.kind%3DJob,message%3Dx", "count%3D1"])
def test_an_unsupported_event_field_selector_is_400(standin, selector):
    status, answer = api_call(standin, "GET", f"{EVENTS}?fieldSelector={selector}")
    assert status == 400, answer
    assert answer["reason"] == "BadRequest"
    label = selector.split(",")[-1].split("%3D")[0]
    assert answer["message"] == f"field label not supported: {label}"


def test_event_field_selectors_select(standin):
    create(standin, QUOTAS, quota("0"))
    create(standin, f"/apis/batch/v1/namespaces/{NS}/jobs", job("job-1-1", completions=1))
    create(standin, f"/apis/apps/v1/namespaces/{NS}/replicasets", replica_set())
    assert wait_until(lambda: failed_creates(standin, "Job", "job-1-1") and failed_creates(standin, "ReplicaSet", "llm-5d8f"),
                      timeout_s=10)

    def names(selector: str, path: str = EVENTS) -> list[str]:
        status, listing = api_call(standin, "GET", f"{path}?fieldSelector={selector}")
        assert status == 200, listing
        return [item["involvedObject"]["name"] for item in listing["items"]]

    assert names("involvedObject.kind%3DJob") == ["job-1-1"]
    assert names("involvedObject.kind%21%3DJob") == ["llm-5d8f"]
    assert names("involvedObject.kind%3D%3DReplicaSet,type%3DWarning") == ["llm-5d8f"]
    assert names("type%3DNormal") == []
    assert names("source%3Djob-controller", "/api/v1/events") == ["job-1-1"]
    assert names(f"involvedObject.namespace%3D{NS},reason%3DFailedCreate", "/api/v1/events") == ["job-1-1", "llm-5d8f"]

