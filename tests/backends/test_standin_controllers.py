"""The stand-in's controllers against how a real cluster's behave: the Job controller's deadline and TTL.

Each case is what kube-controller-manager 1.30 does, driven through the stand-in's HTTP API.
"""

import time

import pytest

from tests.support.k8s import api_call, gpu_node
from tests.support.k8s_standin import KubernetesStandIn

pytestmark = pytest.mark.e2e

NAMESPACE = "acme-train"


@pytest.fixture
def standin():
    with KubernetesStandIn(termination_delay_s=0.2, pod_stop_delay_s=0.05, gc_delay_s=0.05) as api:
        status, _ = api_call(api, "POST", "/api/v1/namespaces",
                             {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        assert status == 201
        api.put(gpu_node("gpu-a"))
        yield api


def job(name: str, **spec) -> dict:
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"completionMode": "Indexed", "completions": 1, "parallelism": 1, "backoffLimit": 0, **spec,
                 "template": {"spec": {"restartPolicy": "Never",
                                       "containers": [{"name": "trainer", "image": "trainer"}]}}},
    }


def read_job(api, name: str) -> dict:
    status, body = api_call(api, "GET", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs/{name}")
    assert status == 200, body
    return body


def wait_for(check, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def test_job_deadline_counts_from_start_and_kills_its_pods(standin):
    """activeDeadlineSeconds: the Job fails with DeadlineExceeded, its running pods are deleted."""
    status, _ = api_call(standin, "POST", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs", job("short", activeDeadlineSeconds=1))
    assert status == 201
    pod = wait_for(lambda: standin.pods(NAMESPACE))[0]
    # The pod is bound only now; the deadline still counts from the Job's start.
    status, _ = api_call(standin, "POST", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod['metadata']['name']}/binding",
                         {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod["metadata"]["name"]},
                          "target": {"kind": "Node", "name": "gpu-a"}})
    assert status == 201

    def failed():
        conditions = read_job(standin, "short")["status"].get("conditions") or []
        return next((c for c in conditions if c["type"] == "Failed"), None)

    condition = wait_for(failed, timeout_s=5)
    assert condition["reason"] == "DeadlineExceeded"
    assert read_job(standin, "short")["status"]["active"] == 0
    wait_for(lambda: not standin.pods(NAMESPACE))


def test_job_without_deadline_keeps_running(standin):
    status, _ = api_call(standin, "POST", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs", job("long"))
    assert status == 201
    time.sleep(1.2)
    assert not read_job(standin, "long")["status"].get("conditions")
    assert standin.pods(NAMESPACE)


def test_finished_job_goes_after_its_ttl(standin):
    """ttlSecondsAfterFinished: the TTL controller deletes the finished Job, and its pods follow."""
    status, _ = api_call(standin, "POST", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs", job("done", ttlSecondsAfterFinished=1))
    assert status == 201
    pod = wait_for(lambda: standin.pods(NAMESPACE))[0]
    api_call(standin, "POST", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod['metadata']['name']}/binding",
             {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod["metadata"]["name"]},
              "target": {"kind": "Node", "name": "gpu-a"}})
    standin.finish_pod(NAMESPACE, pod["metadata"]["name"], 0)
    wait_for(lambda: any(c["type"] == "Complete" for c in read_job(standin, "done")["status"].get("conditions") or []))
    assert read_job(standin, "done")["status"]["completionTime"]
    wait_for(lambda: api_call(standin, "GET", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs/done")[0] == 404, timeout_s=5)
    wait_for(lambda: not standin.pods(NAMESPACE))


def deployment(image: str, strategy: str = "RollingUpdate") -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "serve", "namespace": NAMESPACE},
            "spec": {"replicas": 1, "strategy": {"type": strategy}, "selector": {"matchLabels": {"app": "llm"}},
                     "template": {"metadata": {"labels": {"app": "llm"}},
                                  "spec": {"containers": [{"name": "server", "image": image}]}}}}


def replica_sets(api) -> dict[str, int]:
    """Image of each ReplicaSet -> its replicas."""
    return {rs["spec"]["template"]["spec"]["containers"][0]["image"]: rs["spec"]["replicas"]
            for (plural, _ns, _name), rs in api.objects().items() if plural == "replicasets"}


def apply_deployment(api, body: dict) -> int:
    return api_call(api, "PATCH", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/serve?fieldManager=portal&force=true",
                    body, content_type="application/apply-patch+yaml")[0]


def bind_all(api):
    for pod in api.pods(NAMESPACE):
        if not pod["spec"].get("nodeName"):
            name = pod["metadata"]["name"]
            api_call(api, "POST", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/binding",
                     {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                      "target": {"kind": "Node", "name": "gpu-a"}})


def test_a_changed_template_rolls_out_a_new_replica_set(standin):
    assert apply_deployment(standin, deployment("server:1")) == 201
    wait_for(lambda: standin.pods(NAMESPACE))
    bind_all(standin)
    assert apply_deployment(standin, deployment("server:2")) == 200
    # Rolling: the new ReplicaSet comes up beside the old one, which stays until the new pod is ready.
    assert wait_for(lambda: replica_sets(standin) == {"server:1": 1, "server:2": 1} and len(standin.pods(NAMESPACE)) == 2)
    bind_all(standin)
    assert wait_for(lambda: replica_sets(standin) == {"server:1": 0, "server:2": 1})
    wait_for(lambda: [p["spec"]["containers"][0]["image"] for p in standin.pods(NAMESPACE)] == ["server:2"])


def test_recreate_stops_the_old_pods_before_the_new_ones(standin):
    assert apply_deployment(standin, deployment("server:1", "Recreate")) == 201
    wait_for(lambda: standin.pods(NAMESPACE))
    bind_all(standin)
    assert apply_deployment(standin, deployment("server:2", "Recreate")) == 200
    images, deadline = [], time.monotonic() + 10
    while images != ["server:2"]:
        assert time.monotonic() < deadline, f"never rolled out: {images}"
        pods = standin.pods(NAMESPACE)
        images = sorted(p["spec"]["containers"][0]["image"] for p in pods)
        assert images in ([], ["server:1"], ["server:2"]), images  # never both at once
        time.sleep(0.01)
    assert replica_sets(standin) == {"server:1": 0, "server:2": 1}
