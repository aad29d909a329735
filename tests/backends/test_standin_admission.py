"""Admission in the stand-in, as a real cluster admits pods: LimitRange defaults, ResourceQuota (403
exceeded quota), Pod Security "restricted" where the namespace enforces it, and the kubelet's own
admission of a bound pod (Failed OutOf<resource>, no container) or its absence (a pod bound to a
node that does not exist is garbage-collected).
"""

import time

import pytest

from tests.support.k8s import api_call, gpu_node
from tests.support.k8s_standin import KubernetesStandIn

pytestmark = pytest.mark.e2e

NAMESPACE = "acme-train"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
SAFE_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
                  "seccompProfile": {"type": "RuntimeDefault"}}


@pytest.fixture
def standin():
    with KubernetesStandIn(gc_delay_s=0.05) as api:
        api.put(gpu_node("gpu-a"))
        yield api


def namespace(api, **labels):
    status, answer = api_call(api, "POST", "/api/v1/namespaces", {
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE, "labels": labels}})
    assert status == 201, answer


def pod(name: str, gpus: int = 1, *, security: dict | None = None) -> dict:
    container = {"name": "trainer", "image": "trainer",
                 "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}
    if security is not None:
        container["securityContext"] = security
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"containers": [container]}}


def bind(api, name: str, node: str = "gpu-a") -> int:
    return api_call(api, "POST", f"{PODS}/{name}/binding", {
        "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name}, "target": {"kind": "Node", "name": node}})[0]


def test_quota_refuses_a_pod_past_it(standin):
    namespace(standin)
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpus"},
             "spec": {"hard": {"requests.nvidia.com/gpu": "2"}}}
    assert api_call(standin, "POST", f"/api/v1/namespaces/{NAMESPACE}/resourcequotas", quota)[0] == 201
    assert api_call(standin, "POST", PODS, pod("one", 2))[0] == 201
    status, answer = api_call(standin, "POST", PODS, pod("two", 1))
    assert status == 403 and answer["reason"] == "Forbidden", answer
    assert answer["message"] == ('pods "two" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=1, '
                                 "used: requests.nvidia.com/gpu=2, limited: requests.nvidia.com/gpu=2")
    assert standin.get("pods", "two", NAMESPACE) is None
    # Once the first finishes, its GPUs no longer count.
    assert bind(standin, "one") == 201
    standin.finish_pod(NAMESPACE, "one", 0)
    assert api_call(standin, "POST", PODS, pod("two", 1))[0] == 201


def test_limit_range_defaults_count_against_the_quota(standin):
    namespace(standin)
    limits = {"apiVersion": "v1", "kind": "LimitRange", "metadata": {"name": "defaults"},
              "spec": {"limits": [{"type": "Container", "default": {"cpu": "2"}, "defaultRequest": {"cpu": "1"}}]}}
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "cpu"}, "spec": {"hard": {"requests.cpu": "1"}}}
    assert api_call(standin, "POST", f"/api/v1/namespaces/{NAMESPACE}/limitranges", limits)[0] == 201
    assert api_call(standin, "POST", f"/api/v1/namespaces/{NAMESPACE}/resourcequotas", quota)[0] == 201
    status, created = api_call(standin, "POST", PODS, pod("one", 0))
    assert status == 201, created
    assert created["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "1"
    assert api_call(standin, "POST", PODS, pod("two", 0))[0] == 403


def test_restricted_namespace_refuses_an_unsafe_pod(standin):
    namespace(standin, **{"pod-security.kubernetes.io/enforce": "restricted"})
    status, answer = api_call(standin, "POST", PODS, pod("unsafe"))
    assert status == 403 and answer["reason"] == "Forbidden", answer
    assert 'violates PodSecurity "restricted:latest"' in answer["message"]
    assert "allowPrivilegeEscalation != false" in answer["message"]
    safe = pod("safe", security=SAFE_CONTAINER)
    assert api_call(standin, "POST", PODS, safe)[0] == 201


def test_kubelet_refuses_a_pod_its_node_cannot_fit(standin):
    namespace(standin)
    assert api_call(standin, "POST", PODS, pod("big", 6))[0] == 201
    assert api_call(standin, "POST", PODS, pod("more", 4))[0] == 201
    assert bind(standin, "big") == 201
    assert bind(standin, "more") == 201
    refused = standin.get("pods", "more", NAMESPACE)["status"]
    assert refused["phase"] == "Failed" and refused["reason"] == "OutOfnvidia.com/gpu", refused
    assert "containerStatuses" not in refused
    assert standin.get("pods", "big", NAMESPACE)["status"]["phase"] == "Running"


def test_pod_bound_to_a_missing_node_is_collected(standin):
    namespace(standin)
    assert api_call(standin, "POST", PODS, pod("lost"))[0] == 201
    assert bind(standin, "lost", node="gpu-gone") == 201
    assert standin.get("pods", "lost", NAMESPACE)["status"]["phase"] == "Pending"
    deadline = time.monotonic() + 5
    while standin.get("pods", "lost", NAMESPACE) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert standin.get("pods", "lost", NAMESPACE) is None


def test_a_pod_whose_service_account_does_not_exist_is_refused(standin):
    namespace(standin)
    workload = pod("worker", 0)
    workload["spec"]["serviceAccountName"] = "workload"
    status, answer = api_call(standin, "POST", PODS, workload)
    assert status == 403 and answer["reason"] == "Forbidden", answer
    assert answer["message"] == (f'pods "worker" is forbidden: error looking up service account {NAMESPACE}/workload: '
                                 'serviceaccount "workload" not found')
    api_call(standin, "POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts",
             {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "workload"}})
    assert api_call(standin, "POST", PODS, workload)[0] == 201
