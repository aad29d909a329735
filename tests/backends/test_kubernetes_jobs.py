"""Training attempts on the Kubernetes backend, against the stand-in: apply, bind, watch, stop, logs.

The stand-in plays the Job controller (one pod per completion index) and a small kubelet
(a bound pod runs; a pod deleted with a grace period exits 75 a moment later, as the
trainer does after checkpointing on SIGTERM); tests finish pods and write their logs.
"""

import json
import time

import pytest
from kubernetes_validate.utils import latest_version

from runners.backends.base import JobLaunch, ReplicaPlacement, TransientBackendError
from runners.backends.job_manifests import ATTEMPT_LABEL, JOB_LABEL
from runners.nvidia import names
from runners.workloads.progress import CHECKPOINT_TAG, METRIC_TAG, tagged_line
from tests.support.k8s import gpu_node
from tests.support.k8s_standin import KubernetesStandIn

NAMESPACE = "acme-train"
PLACEMENT = {0: "gpu-b", 1: "gpu-a", 2: "gpu-b"}


def make_launch(**overrides) -> JobLaunch:
    values = dict(
        job_id=41, attempt=1, tenant_slug="acme", namespace=NAMESPACE, name="llm", template="pytorch-ddp",
        replicas=tuple(ReplicaPlacement(rank, node, (rank,)) for rank, node in PLACEMENT.items()),
        gpu_resource=names.GPU_RESOURCE, gpus_per_replica=1, cpu_milli_per_replica=4000,
        memory_mib_per_replica=16384, steps=100, checkpoint_every_steps=10, max_runtime_s=3600,
        env=(("LR", "0.001"),), grace_period_s=120, resume_from_step=None,
    )
    values.update(overrides)
    return JobLaunch(**values)


@pytest.fixture
def cluster(standin):
    """Two GPU nodes and the environment's namespace."""
    for node in ("gpu-a", "gpu-b"):
        standin.put(gpu_node(node))
    standin.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    return standin


def pods_by_rank(standin, job_id=41, attempt=1) -> dict[int, dict]:
    pods = standin.pods(NAMESPACE, **{JOB_LABEL: str(job_id), ATTEMPT_LABEL: str(attempt)})
    return {int(pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"]): pod for pod in pods}


def launched(backend, standin, launch=None):
    launch = launch or make_launch()
    backend.launch_job(launch)
    backend._sync(force=True)  # the watch sees the bindings the launch made
    return launch


@pytest.mark.parametrize("version", ["1.30.0", latest_version()])
def test_a_launch_applies_valid_objects_and_binds_each_pod_to_its_placed_node(make_backend, version):
    with KubernetesStandIn(validate_version=version) as api:
        for node in ("gpu-a", "gpu-b"):
            api.put(gpu_node(node))
        api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        backend = make_backend(api.url)
        launched(backend, api)
        objects = api.objects()
        assert ("persistentvolumeclaims", NAMESPACE, "checkpoints") in objects
        assert objects[("services", NAMESPACE, "job-41-1")]["spec"]["clusterIP"] == "None"
        job = objects[("jobs", NAMESPACE, "job-41-1")]
        assert job["spec"]["completionMode"] == "Indexed"
        pods = pods_by_rank(api)
        # Every pod on the node the portal chose for its index, through pods/binding, never kube-scheduler.
        assert {rank: pod["spec"]["nodeName"] for rank, pod in pods.items()} == PLACEMENT
        assert {pod["spec"]["schedulerName"] for pod in pods.values()} == {"gpu-portal"}
        bindings = [r for r in api.requests if r.path.endswith("/binding")]
        assert [(r.method, r.status) for r in bindings] == [("POST", 201)] * 3


def test_launching_twice_changes_nothing_and_binding_again_is_harmless(backend, cluster):
    launch = launched(backend, cluster)
    before = cluster.objects()
    backend.launch_job(launch)
    backend._sync(force=True)
    after = cluster.objects()
    assert {k: v["metadata"]["resourceVersion"] for k, v in after.items()} == {
        k: v["metadata"]["resourceVersion"] for k, v in before.items()
    }
    # A second worker that still saw a pod unbound gets 409 and leaves it where it is.
    pod = next(iter(pods_by_rank(cluster).values()))
    unbound = {**pod, "spec": {**pod["spec"], "nodeName": None}}
    backend._bind(unbound)
    assert cluster.requests[-1].status == 409
    assert pods_by_rank(cluster)[0]["spec"]["nodeName"] == "gpu-b"


def test_a_custom_job_runs_its_image_and_command(backend, cluster):
    launched(backend, cluster, make_launch(template="custom", image="nvcr.io/nvidia/pytorch:24.01-py3",
                                           command=("python", "train.py")))
    container = pods_by_rank(cluster)[0]["spec"]["containers"][0]
    assert (container["image"], container["command"]) == ("nvcr.io/nvidia/pytorch:24.01-py3", ["python", "train.py"])


def test_the_status_follows_the_pods_until_every_replica_exits(backend, cluster):
    launch = launched(backend, cluster)
    assert backend.job_status(41, 1).phase == "running"
    pods = pods_by_rank(cluster)
    cluster.finish_pod(NAMESPACE, pods[0]["metadata"]["name"], 0)
    backend._sync(force=True)
    assert backend.job_status(41, 1).phase == "running"
    for rank in (1, 2):
        cluster.finish_pod(NAMESPACE, pods[rank]["metadata"]["name"], 0)
    backend._sync(force=True)
    status = backend.job_status(launch.job_id, launch.attempt)
    assert (status.phase, status.exit_codes) == ("exited", {0: 0, 1: 0, 2: 0})


def test_the_watch_resumes_from_the_last_resource_version(backend, cluster):
    backend.launch_job(make_launch())  # the first read of the pods is a list
    listed_at = backend.pods.resource_version
    cluster.clear_log()
    backend._sync(force=True)
    watch = [r for r in cluster.requests if r.query.get("watch")]
    assert watch and watch[0].query["resourceVersion"] == [listed_at]
    assert backend.pods.resource_version != listed_at  # the binding events moved it on
    cluster.clear_log()
    backend._sync(force=True)
    watch = [r for r in cluster.requests if r.query.get("watch")]
    assert watch[0].query["resourceVersion"] == [backend.pods.resource_version]
    assert backend.pods.lists == 1


@pytest.mark.parametrize("gone_as", ["event", "status"])
def test_a_watch_answered_410_lists_again_and_loses_no_change(backend, cluster, gone_as):
    launched(backend, cluster)
    pods = pods_by_rank(cluster)
    cluster.gone_as = gone_as
    # While nobody watches, one replica succeeds and one pod vanishes without finishing; then
    # the history is compacted, so a watch from the last version seen cannot tell of either.
    cluster.finish_pod(NAMESPACE, pods[0]["metadata"]["name"], 0)
    cluster.delete("pods", pods[2]["metadata"]["name"], NAMESPACE)
    cluster.compact()
    backend._sync(force=True)
    assert backend.pods.lists == 2
    status = backend.job_status(41, 1)
    assert status.exit_codes == {0: 0}
    assert (status.phase, status.node_lost) == ("lost", False)
    assert "replica 2" in status.reason and "deleted before it finished" in status.reason


def test_stop_deletes_with_the_grace_period_and_the_replicas_exit_after_checkpointing(backend, cluster):
    launched(backend, cluster)
    cluster.clear_log()
    backend.stop_job(41, 1, grace_period_s=120)
    deletes = [r for r in cluster.requests if r.method == "DELETE"]
    job_delete = [r for r in deletes if "/jobs/" in r.path]
    pod_deletes = [r for r in deletes if "/pods/" in r.path]
    # The Job goes first, orphaning its pods so nothing recreates them; each pod then gets the grace period.
    assert [r.query.get("propagationPolicy") for r in job_delete] == [["Orphan"]]
    assert len(pod_deletes) == 3 and all(r.query["gracePeriodSeconds"] == ["120"] for r in pod_deletes)
    assert all(pod["metadata"].get("deletionTimestamp") for pod in pods_by_rank(cluster).values())
    time.sleep(0.1)  # the stand-in's kubelet: SIGTERM, checkpoint, exit 75
    status = backend.job_status(41, 1)
    backend._sync(force=True)
    status = backend.job_status(41, 1)
    assert (status.phase, status.exit_codes) == ("exited", {0: 75, 1: 75, 2: 75})
    assert pods_by_rank(cluster) == {}


def test_kill_deletes_with_one_second_not_a_force_delete(backend, cluster):
    launched(backend, cluster)
    cluster.clear_log()
    backend.kill_job(41, 1)
    assert {r.query["gracePeriodSeconds"][0] for r in cluster.requests if r.method == "DELETE" and "/pods/" in r.path} == {"1"}
    time.sleep(0.1)
    backend._sync(force=True)
    assert backend.job_status(41, 1).phase != "running"


def test_a_process_that_never_saw_the_pods_end_reads_the_jobs_verdict(make_backend, backend, cluster):
    launched(backend, cluster)
    pods = pods_by_rank(cluster)
    cluster.finish_pod(NAMESPACE, pods[1]["metadata"]["name"], 1)
    time.sleep(0.1)  # the Job fails; the controller stops the other replicas and they go
    cluster.objects()
    time.sleep(0.1)
    fresh = make_backend()  # another worker, started after all that
    status = fresh.job_status(41, 1)
    assert (status.phase, status.exit_codes) == ("exited", {1: 1})
    # Once the failed pod is gone too (its TTL), the Job's condition still ends the attempt.
    cluster.delete("pods", pods[1]["metadata"]["name"], NAMESPACE)
    status = make_backend().job_status(41, 1)
    assert status.phase == "lost" and "BackoffLimitExceeded" in status.reason


def test_a_complete_job_ends_the_attempt_even_unseen(make_backend, backend, cluster):
    launched(backend, cluster)
    for pod in pods_by_rank(cluster).values():
        cluster.finish_pod(NAMESPACE, pod["metadata"]["name"], 0)
        cluster.delete("pods", pod["metadata"]["name"], NAMESPACE)
    assert cluster.get("jobs", "job-41-1", NAMESPACE)["status"]["conditions"][0]["type"] == "Complete"
    status = make_backend().job_status(41, 1)
    assert (status.phase, status.exit_codes) == ("exited", {0: 0, 1: 0, 2: 0})


def test_one_pod_the_server_will_not_bind_stops_nothing_else(backend, cluster):
    cluster.inject(403, method="POST", path_contains="/binding", count=1)
    backend.launch_job(make_launch())
    backend._sync(force=True)
    bound = [pod for pod in pods_by_rank(cluster).values() if pod["spec"].get("nodeName")]
    assert len(bound) == 3, "the refused one is bound on the next sync, the others at once"
    assert backend.job_status(41, 1).phase == "running"


def test_a_log_that_cannot_be_read_is_skipped(backend, cluster):
    launched(backend, cluster)
    cluster.inject(503, method="GET", path_contains="/log", count=1)
    assert backend.job_checkpoints(41) == []


def test_a_failed_replica_fails_the_job_and_the_others_stop(backend, cluster):
    launched(backend, cluster)
    pods = pods_by_rank(cluster)
    cluster.finish_pod(NAMESPACE, pods[1]["metadata"]["name"], 1)
    time.sleep(0.1)
    backend._sync(force=True)
    status = backend.job_status(41, 1)
    assert status.phase == "exited" and status.exit_codes[1] == 1
    assert cluster.get("jobs", "job-41-1", NAMESPACE)["status"]["conditions"][0]["type"] == "Failed"


@pytest.mark.parametrize("how", ["not-ready", "gone"])
def test_a_node_lost_past_the_timeout_ends_the_attempt_node_lost(make_backend, cluster, how):
    backend = make_backend(node_lost_timeout_s=30)
    launched(backend, cluster)
    if how == "not-ready":
        cluster.set_node_ready("gpu-a", False)
        assert backend.job_status(41, 1).phase == "running"  # NotReady, but not for long yet
        cluster.set_node_ready("gpu-a", False, since="2020-01-01T00:00:00Z")
    else:
        cluster.delete("nodes", "gpu-a")
    backend._sync(force=True)  # nodes are read once per sync
    status = backend.job_status(41, 1)
    assert (status.phase, status.node_lost) == ("lost", True) and "gpu-a" in status.reason


def test_pods_removed_with_their_deleted_node_end_the_attempt_node_lost_not_failed(backend, cluster):
    launched(backend, cluster)
    # The node goes, and pod GC force-deletes its pods before the portal looks again.
    cluster.delete("nodes", "gpu-a")
    for pod in pods_by_rank(cluster).values():
        if pod["spec"]["nodeName"] == "gpu-a":
            cluster.delete("pods", pod["metadata"]["name"], NAMESPACE)
    backend._sync(force=True)
    status = backend.job_status(41, 1)
    assert (status.phase, status.node_lost) == ("lost", True) and "gpu-a" in status.reason


def test_an_attempt_whose_job_and_pods_are_gone_is_lost(backend, cluster):
    backend._sync(force=True)
    status = backend.job_status(99, 1)
    assert status.phase == "lost" and "gone" in status.reason


def test_logs_metrics_and_checkpoints_come_from_the_pod_log(backend, cluster):
    launched(backend, cluster)
    pods = pods_by_rank(cluster)
    metric = {"step": 10, "loss": 3.5, "samples_per_s": 900.0, "time": "2026-12-03T10:00:00+00:00", "attempt": 1}
    checkpoint = {"step": 10, "path": "checkpoints/step-00000010.pt", "bytes": 5000, "created_at": metric["time"]}
    cluster.write_log(NAMESPACE, pods[0]["metadata"]["name"], "".join(
        line + "\n" for line in (
            "2026-12-03T10:00:00 [rank 0/3] step 10/100 loss 3.5000",
            tagged_line(METRIC_TAG, metric),
            tagged_line(CHECKPOINT_TAG, checkpoint),
            "2026-12-03T10:00:01 [rank 0/3] saved checkpoint step-00000010.pt",
        )
    ))
    cluster.write_log(NAMESPACE, pods[2]["metadata"]["name"], "rank two says hello\n")
    assert backend.job_metrics(41) == [metric]
    assert backend.job_checkpoints(41) == [checkpoint]
    assert backend.job_logs(41, 1, 0, tail=1) == "2026-12-03T10:00:01 [rank 0/3] saved checkpoint step-00000010.pt\n"
    assert backend.job_logs(41, 1, 2, tail=50) == "rank two says hello\n"
    assert backend.job_logs(41, 1, 7, tail=50) == ""


def test_forgetting_an_attempt_removes_its_service_and_keeps_its_finished_pods(backend, cluster):
    launched(backend, cluster)
    for pod in pods_by_rank(cluster).values():
        cluster.finish_pod(NAMESPACE, pod["metadata"]["name"], 0)
    backend.forget_job(41, 1)
    assert cluster.get("services", "job-41-1", NAMESPACE) is None
    assert len(pods_by_rank(cluster)) == 3  # their logs stay readable until ttlSecondsAfterFinished
    assert (41, 1) not in backend.tracker.exits


def test_forgetting_an_attempt_still_running_stops_it(backend, cluster):
    launched(backend, cluster)
    backend.forget_job(41, 1)
    time.sleep(0.1)
    assert pods_by_rank(cluster) == {}
    assert cluster.get("jobs", "job-41-1", NAMESPACE) is None


def test_an_unreachable_api_server_is_a_transient_error(backend, cluster):
    cluster.inject(503, count=5)
    with pytest.raises(TransientBackendError):
        backend.launch_job(make_launch())


def test_the_pod_template_carries_the_placement_of_every_index(backend, cluster):
    launched(backend, cluster)
    template = cluster.get("jobs", "job-41-1", NAMESPACE)["spec"]["template"]
    assert json.loads(template["metadata"]["annotations"]["portal.gpu/placement"]) == {
        str(rank): node for rank, node in PLACEMENT.items()
    }
