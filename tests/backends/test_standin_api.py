"""The stand-in's answers where a real API server (1.30) has rules of its own: eviction and disruption
budgets, a namespace deleted twice, TokenRequest bounds, pod logs by container and previous instance,
and the reason of an injected 409.
"""

import json
import time

import pytest

from tests.support.k8s import api_call, gpu_node
from tests.support.k8s_standin import APPLY_PATCH, KubernetesStandIn
from tests.support.races import wait_until

pytestmark = pytest.mark.e2e

NAMESPACE = "acme-serve"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"


@pytest.fixture
def standin():
    with KubernetesStandIn(termination_delay_s=60, pod_stop_delay_s=0.05, max_token_expiration_s=7200) as api:
        api_call(api, "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        api.put(gpu_node("gpu-a"))
        yield api


def serve(api, replicas: int, *, max_unavailable=1) -> list[str]:
    """A Deployment's running pods (bound to gpu-a) under a PodDisruptionBudget; their names."""
    labels = {"app": "llm"}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "llm", "namespace": NAMESPACE},
                  "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                           "template": {"metadata": {"labels": labels},
                                        "spec": {"containers": [{"name": "server", "image": "server"}]}}}}
    budget = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "llm", "namespace": NAMESPACE},
              "spec": {"maxUnavailable": max_unavailable, "selector": {"matchLabels": labels}}}
    for path, body in ((f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments", deployment),
                       (f"/apis/policy/v1/namespaces/{NAMESPACE}/poddisruptionbudgets", budget)):
        status, answer = api_call(api, "POST", path, body)
        assert status == 201, answer
    # The ReplicaSet controller makes the pods a moment after the Deployment, in its own pass.
    assert wait_until(lambda: len(api.pods(NAMESPACE)) == replicas, timeout_s=10)
    names = [pod["metadata"]["name"] for pod in api.pods(NAMESPACE)]
    for name in names:
        assert bind(api, name) == 201
    return names


def bind(api, name: str, node: str = "gpu-a") -> int:
    return api_call(api, "POST", f"{PODS}/{name}/binding", {
        "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name}, "target": {"kind": "Node", "name": node}})[0]


def evict(api, name: str, grace: int | None = 30):
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": NAMESPACE}}
    if grace is not None:
        body["deleteOptions"] = {"gracePeriodSeconds": grace}
    return api_call(api, "POST", f"{PODS}/{name}/eviction", body)


def test_eviction_honours_the_disruption_budget(standin):
    first, second = serve(standin, 2)
    status, answer = evict(standin, first)
    assert status == 201, answer
    # The first is terminating (graceful, with the DisruptionTarget condition), so the budget allows no more.
    pod = standin.get("pods", first, NAMESPACE)
    assert pod["metadata"]["deletionTimestamp"] and pod["metadata"]["deletionGracePeriodSeconds"] == 30
    assert {"type": "DisruptionTarget", "reason": "EvictionByEvictionAPI"}.items() <= next(
        c for c in pod["status"]["conditions"] if c["type"] == "DisruptionTarget").items()
    status, answer = evict(standin, second)
    assert status == 429, answer
    assert answer["reason"] == "TooManyRequests"
    assert answer["details"]["causes"][0]["reason"] == "DisruptionBudget"
    assert "needs 1 healthy pods and has 1 currently" in answer["details"]["causes"][0]["message"]
    assert not standin.get("pods", second, NAMESPACE)["metadata"].get("deletionTimestamp")


def test_evicted_pod_exits_on_sigterm_then_goes(standin):
    """Graceful, as the kubelet stops it: DisruptionTarget, then the container's exit code, then the pod goes."""
    (only,) = serve(standin, 1)
    _status, listing = api_call(standin, "GET", PODS)
    since = listing["metadata"]["resourceVersion"]
    status, answer = evict(standin, only)
    assert status == 201, answer
    deadline = time.monotonic() + 10
    while standin.get("pods", only, NAMESPACE) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    status, stream = api_call(standin, "GET", f"{PODS}?watch=true&resourceVersion={since}&timeoutSeconds=1")
    events = [json.loads(line) for line in stream.splitlines()]
    mine = [(e["type"], e["object"]) for e in events if e["object"]["metadata"]["name"] == only]
    assert [kind for kind, _obj in mine] == ["MODIFIED", "MODIFIED", "MODIFIED", "DELETED"]
    assert any(c["type"] == "DisruptionTarget" for c in mine[0][1]["status"]["conditions"])
    assert mine[1][1]["metadata"]["deletionTimestamp"]
    stopped = mine[2][1]["status"]
    assert stopped["phase"] == "Failed"
    assert stopped["containerStatuses"][0]["state"]["terminated"]["exitCode"] == standin.sigterm_exit_code


def test_budget_status_is_kept(standin):
    serve(standin, 3)
    status, budget = api_call(standin, "GET", f"/apis/policy/v1/namespaces/{NAMESPACE}/poddisruptionbudgets/llm")
    assert status == 200
    assert {k: budget["status"][k] for k in ("currentHealthy", "desiredHealthy", "expectedPods", "disruptionsAllowed")} \
        == {"currentHealthy": 3, "desiredHealthy": 2, "expectedPods": 3, "disruptionsAllowed": 1}


def test_second_delete_of_a_terminating_namespace_is_a_conflict(standin):
    assert api_call(standin, "DELETE", f"/api/v1/namespaces/{NAMESPACE}")[0] == 200
    status, answer = api_call(standin, "DELETE", f"/api/v1/namespaces/{NAMESPACE}")
    assert status == 409 and answer["reason"] == "Conflict", answer
    assert "ensuring all content is removed" in answer["message"]


def token_request(api, seconds: int):
    return api_call(api, "POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/olivia/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": seconds}})


def test_token_request_bounds(standin):
    api_call(standin, "POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts",
             {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "olivia"}})
    status, answer = token_request(standin, 2**32 + 1)
    assert status == 422 and "larger than 2^32 seconds" in answer["message"], answer
    status, answer = token_request(standin, 86400)
    # The server's maximum shortens the token; the answer says by how much.
    assert status == 201 and answer["spec"]["expirationSeconds"] == 7200, answer


def test_logs_by_container_and_previous(standin):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "two", "namespace": NAMESPACE},
           "spec": {"containers": [{"name": "server", "image": "server"}, {"name": "proxy", "image": "proxy"}]}}
    assert api_call(standin, "POST", PODS, pod)[0] == 201
    assert bind(standin, "two") == 201
    standin.write_log(NAMESPACE, "two", "server says")
    standin.write_log(NAMESPACE, "two", "proxy says", container="proxy")
    status, answer = api_call(standin, "GET", f"{PODS}/two/log")
    assert status == 400 and "a container name must be specified" in answer["message"]
    assert api_call(standin, "GET", f"{PODS}/two/log?container=proxy") == (200, "proxy says\n")
    assert api_call(standin, "GET", f"{PODS}/two/log?container=nope")[0] == 400
    status, answer = api_call(standin, "GET", f"{PODS}/two/log?container=server&previous=true")
    assert status == 400 and "previous terminated container" in answer["message"]
    standin.crash_container(NAMESPACE, "two", 1)
    standin.write_log(NAMESPACE, "two", "server again")
    assert api_call(standin, "GET", f"{PODS}/two/log?container=server&previous=true") == (200, "server says\n")
    assert api_call(standin, "GET", f"{PODS}/two/log?container=server") == (200, "server again\n")


def test_injected_conflict_defaults_to_conflict(standin):
    standin.inject(409, method="PATCH")
    status, answer = api_call(standin, "PATCH", f"/api/v1/namespaces/{NAMESPACE}/configmaps/x?fieldManager=me",
                              {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}},
                              content_type=APPLY_PATCH)
    assert status == 409 and answer["reason"] == "Conflict"
