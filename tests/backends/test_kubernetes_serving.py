"""Inference replicas on the Kubernetes backend, against the stand-in: Deployment, Service, PDB, bind, address, stop, forget.

The stand-in plays the Deployment and ReplicaSet controllers and a small kubelet (a bound pod
runs with an IP; a pod deleted with a grace period exits a moment later, 0 here: the server
drains on SIGTERM).
"""

import time

import pytest
from kubernetes_validate.utils import latest_version

from runners.backends.base import AttemptStatus, JobLaunch, ReplicaPlacement, ServingSettings
from runners.backends.job_manifests import ATTEMPT_LABEL, JOB_LABEL
from runners.backends.serve_manifests import serving_deployment_manifest
from runners.nvidia import names
from tests.support.k8s import api_call, deploy_rbac, environment_namespace, gpu_node
from tests.support.k8s_standin import KubernetesStandIn
from tests.support.races import wait_until

pytestmark = pytest.mark.e2e

NAMESPACE = "acme-serve"


def make_launch(job_id=51, attempt=1, node="gpu-b", **overrides) -> JobLaunch:
    values = dict(
        job_id=job_id, attempt=attempt, tenant_slug="acme", namespace=NAMESPACE, name="chat-g1-r0", template="serve",
        replicas=(ReplicaPlacement(0, node, (0,)),), gpu_resource=names.GPU_RESOURCE, gpus_per_replica=1,
        cpu_milli_per_replica=2000, memory_mib_per_replica=8192, steps=1, checkpoint_every_steps=0,
        max_runtime_s=86400, grace_period_s=45,
        serving=ServingSettings(endpoint_id=3, checkpoint="checkpoints/step-00000040.pt", source_job_id=12),
    )
    values.update(overrides)
    return JobLaunch(**values)


def _prepare(api):
    for node in ("gpu-a", "gpu-b"):
        api.put(gpu_node(node))
    environment_namespace(api, NAMESPACE)
    api.sigterm_exit_code = 0  # the server answers what it admitted, then exits 0
    return api


@pytest.fixture
def cluster(standin):
    return _prepare(standin)


def replica_pods(api, job_id=51, attempt=1) -> list[dict]:
    return api.pods(NAMESPACE, **{JOB_LABEL: str(job_id), ATTEMPT_LABEL: str(attempt)})


def deployment(launch: JobLaunch, *, server_image: str = "x") -> dict:
    """The replica's Deployment, as another worker (or a racing apply) would have created it."""
    return serving_deployment_manifest(launch, server_image=server_image, scheduler_name="gpu-portal")


def launched(backend, api, launch=None):
    """Launch, then let the stand-in's controllers make the pod and a sync bind it (as the reconcile's reads do)."""
    launch = launch or make_launch()
    backend.launch_job(launch)

    def bound() -> bool:
        # The ReplicaSet controller makes the pod a moment after the Deployment; a sync binds it.
        backend._sync(force=True)
        return any(pod["spec"].get("nodeName") for pod in replica_pods(api, launch.job_id, launch.attempt))

    assert wait_until(bound, timeout_s=10)
    backend._sync(force=True)  # the watch sees the binding
    return launch


def kinds(api, *plurals) -> set[tuple[str, str]]:
    return {(plural, name) for plural, namespace, name in api.objects() if plural in plurals and namespace == NAMESPACE}


@pytest.mark.parametrize("version", ["1.30.0", latest_version()])
def test_a_launch_creates_a_valid_deployment_service_and_budget_and_binds_the_pod(make_backend, version):
    with KubernetesStandIn(validate_version=version) as api:
        backend = make_backend(api.url)
        launched(backend, _prepare(api))
        assert kinds(api, "deployments", "services", "poddisruptionbudgets", "persistentvolumeclaims") == {
            ("deployments", "job-51-1"), ("services", "endpoint-3"), ("poddisruptionbudgets", "endpoint-3"),
            ("persistentvolumeclaims", "checkpoints"),
        }
        [pod] = replica_pods(api)
        # On the node the portal chose, through pods/binding, never kube-scheduler.
        assert pod["spec"]["nodeName"] == "gpu-b" and pod["spec"]["schedulerName"] == "gpu-portal"
        assert [(r.method, r.status) for r in api.requests if r.path.endswith("/binding")] == [("POST", 201)]
        assert backend.serving_address(51, 1) == f"http://{pod['status']['podIP']}:8000"
        assert backend.job_status(51, 1).phase == "running"


def test_launching_again_changes_nothing_and_an_object_already_there_is_fine(backend, cluster):
    launch = launched(backend, cluster)
    before = {key: obj["metadata"]["resourceVersion"] for key, obj in cluster.objects().items()}
    backend.launch_job(launch)
    backend._sync(force=True)
    assert {key: obj["metadata"]["resourceVersion"] for key, obj in cluster.objects().items()} == before
    assert len(replica_pods(cluster)) == 1
    # Another worker's launch got there first (or an apply raced this one's create): still one replica, no error.
    other = make_launch(job_id=52, node="gpu-a")
    # The same template the backend applies (another image would be a new template: a real rollout).
    cluster.put(deployment(other, server_image=backend.trainer_image))
    launched(backend, cluster, other)
    assert [pod["spec"]["nodeName"] for pod in replica_pods(cluster, job_id=52)] == ["gpu-a"]


def test_the_address_is_unknown_until_the_pod_has_an_ip(backend, cluster):
    assert backend.serving_address(51, 1) is None
    cluster.put(deployment(make_launch()))
    cluster.objects()
    backend._sync(force=True)
    # A pod of an attempt that is not open is never bound, so it never gets an IP.
    assert len(replica_pods(cluster)) == 1 and backend.serving_address(51, 1) is None


def test_stop_drains_the_pod_with_the_grace_period_and_nothing_replaces_it(backend, cluster):
    launched(backend, cluster)
    cluster.clear_log()
    backend.stop_job(51, 1, grace_period_s=45)
    deletes = [r for r in cluster.requests if r.method == "DELETE"]
    # The Deployment, then its ReplicaSet, each orphaning what it made: nothing makes a new pod.
    assert [r.query.get("propagationPolicy") for r in deletes if "/deployments/" in r.path] == [["Orphan"]]
    assert [r.query.get("propagationPolicy") for r in deletes if "/replicasets/" in r.path] == [["Orphan"]]
    assert [r.query["gracePeriodSeconds"] for r in deletes if "/pods/" in r.path] == [["45"]]
    # It was the endpoint's last replica: its Service and budget go too.
    assert kinds(cluster, "deployments", "replicasets", "services", "poddisruptionbudgets") == set()
    time.sleep(0.1)  # the stand-in's kubelet: SIGTERM, drain, exit 0
    backend._sync(force=True)
    status = backend.job_status(51, 1)
    assert (status.phase, status.exit_codes) == ("exited", {0: 0})
    cluster.objects()
    assert replica_pods(cluster) == []


def test_kill_deletes_with_one_second(backend, cluster):
    launched(backend, cluster)
    cluster.clear_log()
    backend.kill_job(51, 1)
    assert {r.query["gracePeriodSeconds"][0] for r in cluster.requests if r.method == "DELETE" and "/pods/" in r.path} == {"1"}
    time.sleep(0.1)
    backend._sync(force=True)
    assert backend.job_status(51, 1).phase == "exited"


def test_forget_removes_the_replica_and_the_endpoints_objects_with_its_last_replica(backend, cluster):
    launched(backend, cluster)
    launched(backend, cluster, make_launch(job_id=52, node="gpu-a"))
    backend.forget_job(51, 1)
    time.sleep(0.1)  # the garbage collector
    assert replica_pods(cluster) == []
    # Another replica of the endpoint still serves: its Service and budget stay.
    assert kinds(cluster, "deployments", "services", "poddisruptionbudgets") == {
        ("deployments", "job-52-1"), ("services", "endpoint-3"), ("poddisruptionbudgets", "endpoint-3"),
    }
    assert {name.rsplit("-", 1)[0] for _plural, name in kinds(cluster, "replicasets")} == {"job-52-1"}
    assert (51, 1) not in backend.tracker.attempts()
    backend.forget_job(52, 1)
    backend.forget_job(52, 1)  # again: what is gone counts as deleted
    time.sleep(0.1)
    assert kinds(cluster, "deployments", "replicasets", "pods", "services", "poddisruptionbudgets") == set()


def test_a_replica_launched_while_the_last_one_is_forgotten_keeps_its_service(backend, cluster, monkeypatch):
    launched(backend, cluster)
    # Between the two looks of the release, another worker applies the next replica's Deployment.
    original = backend._delete

    def racing_delete(kind, name, namespace, **options):
        original(kind, name, namespace, **options)
        if kind == "PodDisruptionBudget":
            cluster.put(deployment(make_launch(job_id=53, node="gpu-a")))

    monkeypatch.setattr(backend, "_delete", racing_delete)
    backend.forget_job(51, 1)
    assert {("services", "endpoint-3"), ("poddisruptionbudgets", "endpoint-3")} <= kinds(cluster, "services",
                                                                                         "poddisruptionbudgets")


def test_a_crash_the_kubelet_restarted_from_ends_the_attempt_with_its_code(backend, cluster):
    launched(backend, cluster)
    [pod] = replica_pods(cluster)
    cluster.crash_container(NAMESPACE, pod["metadata"]["name"], 1)
    backend._sync(force=True)
    status = backend.job_status(51, 1)
    assert (status.phase, status.exit_codes) == ("exited", {0: 1})
    # A stop still stops the restarted container (it runs again).
    cluster.clear_log()
    backend.stop_job(51, 1, grace_period_s=45)
    assert [r.method for r in cluster.requests if "/pods/" in r.path and r.method == "DELETE"] == ["DELETE"]


def test_a_vanished_pod_ends_the_attempt_and_its_replacement_is_never_bound(backend, cluster):
    launched(backend, cluster)
    [pod] = replica_pods(cluster)
    cluster.delete("pods", pod["metadata"]["name"], NAMESPACE)
    cluster.objects()  # the ReplicaSet makes a replacement
    backend._sync(force=True)
    status = backend.job_status(51, 1)
    assert status.phase == "lost" and "deleted before it finished" in status.reason
    [replacement] = replica_pods(cluster)
    assert replacement["metadata"]["name"] != pod["metadata"]["name"] and not replacement["spec"].get("nodeName")


def test_logs_come_from_the_server_container(backend, cluster):
    launched(backend, cluster)
    [pod] = replica_pods(cluster)
    cluster.write_log(NAMESPACE, pod["metadata"]["name"], "PORTAL_SERVE_LISTENING {}\nready")
    assert backend.job_logs(51, 1, 0, tail=1) == "ready\n"
    [read] = [r for r in cluster.requests if r.path.endswith("/log")]
    assert read.query["container"] == ["server"]


def test_another_process_reads_the_attempt_from_its_pod_and_deployment(make_backend, backend, cluster):
    launched(backend, cluster)
    assert make_backend().job_status(51, 1).phase == "running"
    backend.forget_job(51, 1)
    time.sleep(0.1)  # the pod stops; the garbage collector is done
    status = make_backend().job_status(51, 1)
    assert status.phase == "lost" and "gone" in status.reason


def test_a_replica_over_quota_says_why_it_waits_and_runs_once_the_quota_grows(backend, cluster):
    cluster.put({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "operator-gpus", "namespace": NAMESPACE},
                 "spec": {"hard": {"requests.nvidia.com/gpu": "0"}}})
    backend.launch_job(make_launch())
    # The ReplicaSet controller records FailedCreate on the Deployment's ReplicaSet.
    assert wait_until(lambda: cluster.events(NAMESPACE, reason="FailedCreate"), timeout_s=10)
    cluster.clear_log()
    status = backend.job_status(51, 1)
    assert status.phase == "running" and "exceeded quota: operator-gpus" in status.waiting
    reads = [r for r in cluster.requests if r.path.endswith("/events")]
    assert [(r.status, r.query["fieldSelector"]) for r in reads] == [
        (200, ["involvedObject.kind=ReplicaSet,reason=FailedCreate"])]
    status, answer = api_call(cluster, "PATCH", f"/api/v1/namespaces/{NAMESPACE}/resourcequotas/operator-gpus",
                              {"spec": {"hard": {"requests.nvidia.com/gpu": "1"}}},
                              content_type="application/merge-patch+json")
    assert status == 200, answer

    def bound() -> bool:
        backend._sync(force=True)
        return any(pod["spec"].get("nodeName") == "gpu-b" for pod in replica_pods(cluster))

    assert wait_until(bound, timeout_s=10)
    backend._sync(force=True)
    status = backend.job_status(51, 1)
    assert (status.phase, status.waiting) == ("running", "")


def test_a_slow_replica_set_controller_still_launches_binds_and_drains(make_backend):
    """The start-up delay case: the replica's pod comes 1.5 s after its ReplicaSet."""
    with KubernetesStandIn(admin_tokens={"standin-token"}, portal_rbac=deploy_rbac(), watch_hold_s=0.1,
                           check_answers=True, controller_delay_s=1.5, pod_stop_delay_s=0.05) as slow:
        backend = make_backend(slow.url)
        _prepare(slow)
        backend.launch_job(make_launch())
        assert slow.pods(NAMESPACE, as_is=True) == []
        assert backend.job_status(51, 1) == AttemptStatus("running")  # nothing refuses it: it just comes later

        def bound() -> bool:
            backend._sync(force=True)
            return any(pod["spec"].get("nodeName") == "gpu-b" for pod in replica_pods(slow))

        assert wait_until(bound, timeout_s=15)
        backend._sync(force=True)  # the watch sees the binding
        assert backend.serving_address(51, 1)
        backend.stop_job(51, 1, grace_period_s=45)
        assert wait_until(lambda: backend.job_status(51, 1).phase == "exited", timeout_s=10)
        assert backend.job_status(51, 1).exit_codes == {0: 0}
        assert slow.invalid_answers == [] and slow.controller_errors == []
