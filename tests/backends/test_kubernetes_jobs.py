"""Training attempts on the Kubernetes backend, against the stand-in: apply, bind, watch, stop, forget, logs, progress.

The stand-in plays the Job controller (one pod per completion index) and a small kubelet
(a bound pod runs; a pod deleted with a grace period exits 75 a moment later, as the
trainer does after checkpointing on SIGTERM); tests finish pods and write their logs.
"""

import json
import logging
import time
from datetime import datetime, timedelta, timezone
from urllib.parse import urlencode
from urllib.request import urlopen

import pytest
from kubernetes_validate.utils import latest_version

from runners.backends import k8s_jobs, kubernetes
from runners.backends.base import (
    PROGRESS_READ_MAX_BYTES,
    AttemptStatus,
    JobLaunch,
    ReplicaPlacement,
    TransientBackendError,
)
from runners.nvidia import names
from runners.workloads.progress import CHECKPOINT_TAG, METRIC_TAG, tagged_line
from tests.support.k8s import api_call, deploy_rbac, environment_namespace, gpu_node, pods_by_rank, training_pod
from tests.support.k8s_standin import KubernetesStandIn
from tests.support.races import wait_until

pytestmark = pytest.mark.e2e

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
    environment_namespace(standin, NAMESPACE)
    return standin


def launched(backend, standin, launch=None):
    """Launch, then sync until the Job controller has made every replica's pod (a moment after the Job)
    and the backend has bound each one, and the watch has seen the bindings."""
    launch = launch or make_launch()
    backend.launch_job(launch)

    def all_bound() -> bool:
        backend._sync(force=True)
        pods = pods_by_rank(standin, launch.job_id, launch.attempt, namespace=launch.namespace)
        return len(pods) == len(launch.replicas) and all(pod["spec"].get("nodeName") for pod in pods.values())

    assert wait_until(all_bound, timeout_s=10)
    backend._sync(force=True)  # the watch sees the last bindings
    return launch


@pytest.mark.parametrize("version", ["1.30.0", latest_version()])
def test_a_launch_applies_valid_objects_and_binds_each_pod_to_its_placed_node(make_backend, version):
    with KubernetesStandIn(validate_version=version) as api:
        for node in ("gpu-a", "gpu-b"):
            api.put(gpu_node(node))
        environment_namespace(api, NAMESPACE)
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
    reached = backend.pods.resource_version
    backend._sync(force=True)
    watch = [r for r in cluster.requests if r.query.get("watch")]
    assert watch[0].query["resourceVersion"] == [reached]
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

    def refused() -> bool:
        backend._sync(force=True)  # binds every pod the Job controller has made by now
        return any(r.status == 403 and r.path.endswith("/binding") for r in cluster.requests)

    assert wait_until(refused, timeout_s=10)
    backend._sync(force=True)
    bound = [pod for pod in pods_by_rank(cluster).values() if pod["spec"].get("nodeName")]
    assert len(bound) == 3, "every pod is bound"
    # Which sync met the refusal depends on when the Job controller made each pod (launch_job syncs too), so
    # the refused binding is followed in the request log: the same pod is bound by a later request, and the
    # other two were never refused.
    bindings = [(r.path, r.status) for r in cluster.requests if r.method == "POST" and r.path.endswith("/binding")]
    refused_at = next(i for i, (_path, status) in enumerate(bindings) if status == 403)
    refused_path = bindings[refused_at][0]
    assert any(path == refused_path and status < 300 for path, status in bindings[refused_at + 1:])
    assert len({path for path, status in bindings if status < 300} - {refused_path}) == 2
    assert [status for _path, status in bindings].count(403) == 1
    assert backend.job_status(41, 1).phase == "running"


def test_a_log_that_cannot_be_read_now_loses_nothing(backend, cluster):
    launched(backend, cluster)
    checkpoint = {"step": 10, "path": "checkpoints/step-00000010.pt", "bytes": 5000,
                  "created_at": "2026-12-03T10:00:00+00:00"}
    cluster.write_log(NAMESPACE, rank0(cluster)["metadata"]["name"], tagged_line(CHECKPOINT_TAG, checkpoint) + "\n")
    cluster.inject(503, method="GET", path_contains="/log", count=1)
    failed = backend.job_progress(41, 1, {})
    assert [r.status for r in cluster.requests if r.path.endswith("/log")] == [503]
    assert (failed.metrics, failed.checkpoints, failed.cursor) == ([], [], {})
    assert backend.job_status(41, 1).phase == "running"  # the status is read regardless
    # The cursor handed back is where the next read starts: the checkpoint comes then.
    assert backend.job_progress(41, 1, failed.cursor).checkpoints == [checkpoint]


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
    cluster.write_log(NAMESPACE, pods[2]["metadata"]["name"], tagged_line(METRIC_TAG, {**metric, "step": 99}) + "\n")
    read = backend.job_progress(41, 1, {})
    assert (read.metrics, read.checkpoints) == ([metric], [checkpoint])  # rank 0's only
    assert read.bytes_read == backend.log_bytes_read == cluster.log_bytes_served[(NAMESPACE, pods[0]["metadata"]["name"])]
    log_read = [r for r in cluster.requests if r.path.endswith("/log")][-1]
    assert (log_read.query["timestamps"], log_read.query["limitBytes"]) == (["true"], [str(PROGRESS_READ_MAX_BYTES)])
    again = backend.job_progress(41, 1, read.cursor)
    assert (again.metrics, again.checkpoints) == ([], [])
    assert backend.job_logs(41, 1, 0, tail=1) == "2026-12-03T10:00:01 [rank 0/3] saved checkpoint step-00000010.pt\n"
    assert backend.job_logs(41, 1, 2, tail=50) == tagged_line(METRIC_TAG, {**metric, "step": 99}) + "\n"
    assert backend.job_logs(41, 1, 7, tail=50) == ""
    assert not [r for r in cluster.requests if r.query.get("tailLines") and r.query.get("timestamps")]


def test_forgetting_a_finished_attempt_deletes_its_job_pods_and_service(backend, cluster):
    launched(backend, cluster)
    for pod in pods_by_rank(cluster).values():
        cluster.finish_pod(NAMESPACE, pod["metadata"]["name"], 0)
    backend._sync(force=True)
    assert backend.job_status(41, 1).phase == "exited"
    cluster.clear_log()
    # A slow garbage collector, so the pods are still there for the backend's own deletes (a quick one
    # may remove them first on a loaded machine, and then there is nothing left to delete).
    cluster.gc_delay_s = 60
    backend.forget_job(41, 1)
    deletes = [r for r in cluster.requests if r.method == "DELETE"]
    # The Job first, with the garbage collector behind it; then every pod, finished or not; then the Service.
    assert [r.query.get("propagationPolicy") for r in deletes if "/jobs/" in r.path] == [["Background"]]
    assert {r.query.get("gracePeriodSeconds")[0] for r in deletes if "/pods/" in r.path} == {"1"}
    assert cluster.get("jobs", "job-41-1", NAMESPACE) is None
    assert pods_by_rank(cluster) == {}
    assert cluster.get("services", "job-41-1", NAMESPACE) is None
    assert (41, 1) not in backend.tracker.attempts()
    # Again, and with a pod that went meanwhile (404): nothing is left, nothing fails.
    backend.forget_job(41, 1)
    cluster.put(training_pod(41, 1, 0, "gpu-a", namespace=NAMESPACE))
    cluster.inject(404, method="DELETE", path_contains="/pods/", reason="NotFound")
    backend.forget_job(41, 1)


def test_forgetting_an_attempt_still_running_stops_it(backend, cluster):
    launched(backend, cluster)
    backend.forget_job(41, 1)
    time.sleep(0.1)
    assert pods_by_rank(cluster) == {}
    assert cluster.get("jobs", "job-41-1", NAMESPACE) is None


def test_only_pods_of_open_attempts_are_bound(backend, cluster, caplog):
    backend.jobs_open({(43, 1)})
    # A leftover of an attempt that has ended (41/1) and a pod of an open one (43/1), both Pending.
    cluster.put(training_pod(41, 1, 0, None, namespace=NAMESPACE))
    cluster.put(training_pod(43, 1, 0, None, namespace=NAMESPACE))
    with caplog.at_level(logging.WARNING, logger="runners.backends.kubernetes"):
        for _ in range(3):
            backend._sync(force=True)
    assert pods_by_rank(cluster, 41)[0]["spec"].get("nodeName") is None
    assert pods_by_rank(cluster, 43)[0]["spec"]["nodeName"] == "gpu-a"
    noted = [r for r in caplog.records if "job-41-1-0-pod" in r.getMessage()]
    assert len(noted) == 1 and "not open" in noted[0].getMessage()  # once, not every pass
    # A launch opens its own attempt in this process at once, though jobs_open did not name it.
    launched(backend, cluster, make_launch(job_id=42))
    assert {pod["spec"].get("nodeName") for pod in pods_by_rank(cluster, 42).values()} == {"gpu-a", "gpu-b"}
    # Forgotten, it is closed here too; and a pod of the leftover attempt stays unbound until the portal opens it.
    backend.forget_job(42, 1)
    cluster.put(training_pod(42, 1, 0, None, namespace=NAMESPACE))
    backend._sync(force=True)
    assert pods_by_rank(cluster, 42)[0]["spec"].get("nodeName") is None
    assert pods_by_rank(cluster, 41)[0]["spec"].get("nodeName") is None
    backend.jobs_open({(41, 1), (43, 1)})
    backend._sync(force=True)
    assert pods_by_rank(cluster, 41)[0]["spec"]["nodeName"] == "gpu-a"


def test_jobs_open_prunes_the_trackers_whichever_process_ended_the_attempt(make_backend, backend, cluster):
    other = make_backend()  # another worker process
    launched(backend, cluster)
    launched(backend, cluster, make_launch(job_id=42))
    other.jobs_open({(41, 1), (42, 1)})
    for pod in pods_by_rank(cluster).values():
        cluster.finish_pod(NAMESPACE, pod["metadata"]["name"], 0)
    other._sync(force=True)
    assert other.job_status(41, 1).phase == "exited"
    assert other.tracker.attempts() == {(41, 1), (42, 1)}
    backend.forget_job(41, 1)  # this process ends it; the other one only hears of it
    other._sync(force=True)  # the deletions of 41's pods come in
    other.jobs_open({(42, 1)})
    assert other.tracker.attempts() == {(42, 1)}
    assert all((41, 1) not in table for table in (other.tracker.exits, other.tracker.vanished,
                                                  other.tracker.replicas, other.tracker.vanished_nodes))
    backend.jobs_open(set())
    assert backend.tracker.attempts() == set()


def test_only_a_true_failed_condition_ends_an_attempt_and_names_the_reason():
    stale = {"type": "Failed", "status": "False", "reason": "Stale", "message": "not this one"}
    decided = {"type": "FailureTarget", "status": "True", "reason": "BackoffLimitExceeded",
               "message": "Job has reached the specified backoff limit"}

    def status(*conditions):
        return k8s_jobs.attempt_status(replicas=1, pods=[], exits={}, vanished={},
                                       job={"status": {"conditions": list(conditions)}}, lost_nodes={})

    ended = status(stale, decided)
    assert ended.phase == "lost" and "BackoffLimitExceeded" in ended.reason and "Stale" not in ended.reason
    assert status(stale).phase == "running"


# --- Progress from rank 0's log, incrementally ------------------------------------------------

T0 = datetime(2026, 12, 3, 10, 0, 5, tzinfo=timezone.utc)


def rank0(standin, job_id=41, attempt=1) -> dict:
    return pods_by_rank(standin, job_id, attempt)[0]


def metric_line(step: int) -> str:
    return tagged_line(METRIC_TAG, {"step": step, "loss": 1.0 / step, "samples_per_s": 900.0,
                                    "time": "2026-12-03T10:00:00+00:00", "attempt": 1})


def steps(read) -> list[int]:
    return [record["step"] for record in read.metrics]


def test_the_stand_in_serves_logs_as_the_api_server_does(cluster, backend):
    launched(backend, cluster)
    name = rank0(cluster)["metadata"]["name"]
    cluster.append_log(NAMESPACE, name, [(T0 - timedelta(seconds=1), "before"), (T0 + timedelta(microseconds=250), "a"),
                                         (T0 + timedelta(microseconds=500), "b")])

    def get(**query):
        url = f"{cluster.url}/api/v1/namespaces/{NAMESPACE}/pods/{name}/log?{urlencode(query)}"
        with urlopen(url) as answer:
            return answer.read().decode()

    assert get(timestamps="true") == ("2026-12-03T10:00:04.000000000Z before\n2026-12-03T10:00:05.000250000Z a\n"
                                      "2026-12-03T10:00:05.000500000Z b\n")
    # sinceTime is inclusive, to the second: a fraction is dropped, as the API server does on the way to the kubelet.
    assert get(sinceTime="2026-12-03T10:00:05.9Z") == "a\nb\n"
    assert get(sinceTime="2026-12-03T10:00:06Z") == ""
    # limitBytes counts the timestamps and cuts the last line where it falls.
    assert get(timestamps="true", limitBytes=40) == "2026-12-03T10:00:04.000000000Z before\n20"
    assert get(tailLines=1, timestamps="true") == "2026-12-03T10:00:05.000500000Z b\n"


def test_lines_in_the_same_second_as_the_cursor_are_neither_lost_nor_doubled(backend, cluster):
    launched(backend, cluster)
    name = rank0(cluster)["metadata"]["name"]
    cluster.append_log(NAMESPACE, name, [(T0 + timedelta(milliseconds=100), metric_line(1)),
                                         (T0 + timedelta(milliseconds=200), metric_line(2))])
    first = backend.job_progress(41, 1, {})
    assert steps(first) == [1, 2]
    assert first.cursor["since"] == "2026-12-03T10:00:05Z" and first.cursor["skip"] == 2
    # More in that same second, two of them at one and the same instant.
    same = T0 + timedelta(milliseconds=300)
    cluster.append_log(NAMESPACE, name, [(same, metric_line(3)), (same, metric_line(4))])
    second = backend.job_progress(41, 1, first.cursor)
    assert [r.query.get("sinceTime") for r in cluster.requests if r.path.endswith("/log")][-1] == ["2026-12-03T10:00:05Z"]
    assert steps(second) == [3, 4]
    cluster.append_log(NAMESPACE, name, [(same, metric_line(5))])
    third = backend.job_progress(41, 1, second.cursor)
    assert steps(third) == [5]
    cluster.append_log(NAMESPACE, name, [(T0 + timedelta(seconds=1), metric_line(6))])
    fourth = backend.job_progress(41, 1, third.cursor)
    assert steps(fourth) == [6] and fourth.cursor["since"] == "2026-12-03T10:00:06Z"
    assert steps(backend.job_progress(41, 1, fourth.cursor)) == []


def test_a_rotated_log_loses_no_line_written_after_the_cursor(backend, cluster):
    launched(backend, cluster)
    name = rank0(cluster)["metadata"]["name"]
    cluster.append_log(NAMESPACE, name, [(T0 + timedelta(milliseconds=100), metric_line(1)),
                                         (T0 + timedelta(milliseconds=200), metric_line(2))])
    first = backend.job_progress(41, 1, {})
    cluster.rotate_log(NAMESPACE, name)  # the kubelet serves only the new file from now on
    cluster.append_log(NAMESPACE, name, [(T0 + timedelta(milliseconds=300), metric_line(3)),
                                         (T0 + timedelta(milliseconds=400), metric_line(4)),
                                         (T0 + timedelta(seconds=1), metric_line(5))])
    assert steps(backend.job_progress(41, 1, first.cursor)) == [3, 4, 5]


def test_lines_slightly_out_of_order_across_a_second_are_neither_lost_nor_doubled():
    # stdout and stderr are stamped apart, so one may land in the file a moment out of order.
    def line(stamp: str, step: int) -> bytes:
        return f"2026-12-03T10:00:{stamp}Z {metric_line(step)}\n".encode()

    start = k8s_jobs.LogCursor(41, 1, "uid-1")
    first = k8s_jobs.read_progress(line("06.100000000", 1) + line("05.999999999", 2) + line("06.200000000", 3),
                                   start, limit=10_000)
    assert [m["step"] for m in first.metrics] == [1, 2, 3]
    assert (first.cursor.since, first.cursor.skip) == (int(T0.timestamp()) + 1, 2)
    # From 10:00:06 the server sends lines 1 and 3 again (2 is before it), then what is new.
    second = k8s_jobs.read_progress(line("06.100000000", 1) + line("06.200000000", 3) + line("06.300000000", 4),
                                    first.cursor, limit=10_000)
    assert [m["step"] for m in second.metrics] == [4]


def test_a_read_takes_at_most_the_limit_and_the_rest_comes_next(backend, cluster, monkeypatch, caplog):
    monkeypatch.setattr(kubernetes, "PROGRESS_READ_MAX_BYTES", 600)
    launched(backend, cluster)
    name = rank0(cluster)["metadata"]["name"]
    # Thirty records, two a second (about 360 bytes a second with their timestamps); then one line
    # longer than a read may be, alone in its second; then two more records.
    cluster.append_log(NAMESPACE, name, [(T0 + timedelta(milliseconds=500 * i), metric_line(i + 1)) for i in range(30)])
    cluster.append_log(NAMESPACE, name, [(T0 + timedelta(seconds=20), "x" * 2000),
                                         (T0 + timedelta(seconds=21), metric_line(31)),
                                         (T0 + timedelta(seconds=21, milliseconds=1), metric_line(32))])
    cursor, seen, reads = {}, [], 0
    with caplog.at_level(logging.WARNING, logger="runners.backends.kubernetes"):
        while True:
            read = backend.job_progress(41, 1, cursor)
            assert read.bytes_read <= 600
            reads += 1
            seen += steps(read)
            if read.cursor == cursor:
                break
            cursor = read.cursor
            assert reads < 50
    assert seen == list(range(1, 33))  # whole records only: none cut, none lost, none twice
    assert reads > 10
    # The over-long line cannot be read whole: its second is given up on, and said so.
    assert ["2026-12-03T10:00:25Z" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [True]


def test_a_cursor_survives_its_pod_going_and_a_cursor_of_another_pod_starts_afresh(backend, cluster):
    launched(backend, cluster)
    name = rank0(cluster)["metadata"]["name"]
    cluster.append_log(NAMESPACE, name, [(T0, metric_line(1))])
    first = backend.job_progress(41, 1, {})
    cursor = json.loads(json.dumps(first.cursor))  # the portal keeps it as JSON
    assert cursor == first.cursor and cursor["pod_uid"] == rank0(cluster)["metadata"]["uid"]
    cluster.append_log(NAMESPACE, name, [(T0 + timedelta(seconds=1), metric_line(2))])
    backend.min_sync_interval_s = 3600  # the cache still lists the pod when it goes
    cluster.delete("pods", name, NAMESPACE)
    gone = backend.job_progress(41, 1, cursor)
    assert (steps(gone), gone.cursor, gone.bytes_read) == ([], cursor, 0)
    backend._sync(force=True)  # now the cache knows it is gone
    assert backend.job_progress(41, 1, cursor).cursor == cursor
    # A new rank-0 pod of the attempt (another uid) is read from its start, whatever the cursor says.
    cluster.put(training_pod(41, 1, 0, "gpu-b", namespace=NAMESPACE))
    cluster.write_log(NAMESPACE, "job-41-1-0-pod", metric_line(7) + "\n", at=T0 - timedelta(hours=1))
    backend._sync(force=True)
    fresh = backend.job_progress(41, 1, cursor)
    assert steps(fresh) == [7] and fresh.cursor["pod_uid"] != cursor["pod_uid"]
    # And a cursor of another attempt starts afresh too.
    launched(backend, cluster, make_launch(attempt=2))
    cluster.write_log(NAMESPACE, rank0(cluster, attempt=2)["metadata"]["name"], metric_line(8) + "\n",
                      at=T0 - timedelta(hours=1))
    other = backend.job_progress(41, 2, fresh.cursor)
    assert steps(other) == [8] and other.cursor["attempt"] == 2


def test_a_reconcile_pass_over_200_attempts_reads_each_log_once_then_only_what_is_new(backend, cluster):
    attempts = sorted((1000 + i, 1) for i in range(200))
    # 2,000 lines a pod, one a second; every tenth a metric record.
    t0_ns = int(T0.timestamp()) * 1_000_000_000
    log = [(t0_ns + i * 1_000_000_000,
            metric_line(i + 1) if i % 10 == 0 else f"[rank 0/1] step {i + 1}/100000 loss {1.0 / (i + 1):.6f} lr 0.003")
           for i in range(2000)]
    names = {}
    for job_id, attempt in attempts:
        pod = cluster.put(training_pod(job_id, attempt, 0, "gpu-a", namespace=NAMESPACE))
        names[(job_id, attempt)] = pod["metadata"]["name"]
        cluster.append_log(NAMESPACE, pod["metadata"]["name"], log)
    whole_logs = sum(len(text) + 1 for log in cluster.pod_logs.values() for _at, _shown, text in log)
    backend.jobs_open(set(attempts))
    cursors, records = {}, {key: [] for key in attempts}

    def reconcile_pass() -> int:
        cluster.log_reads.clear()
        before = backend.log_bytes_read
        for key in attempts:
            read = backend.job_progress(*key, cursors.get(key, {}))
            cursors[key] = read.cursor
            records[key] += steps(read)
        assert sorted(cluster.log_reads.values()) == [1] * 200  # each log once a pass
        return backend.log_bytes_read - before

    first = reconcile_pass()
    assert all(found == list(range(1, 2001, 10)) for found in records.values())
    # Ten new lines a pod (one a metric record), then the next pass.
    new_lines = [metric_line(2001)] + [f"[rank 0/1] step {2001 + i}/100000 loss 0.000500 lr 0.003" for i in range(1, 10)]
    for key in attempts:
        cluster.append_log(NAMESPACE, names[key], [(T0 + timedelta(seconds=2000 + i), line)
                                                   for i, line in enumerate(new_lines)])
    new_bytes = 200 * sum(len(line) + 1 for line in new_lines)
    second = reconcile_pass()
    assert all(found == [*range(1, 2001, 10), 2001] for found in records.values())  # none lost, none twice
    served = sum(cluster.log_bytes_served.values())
    assert served == first + second
    print(f"\nwhole logs {whole_logs} B; first pass read {first} B; 10 new lines a pod: {new_bytes} B "
          f"(without timestamps); second pass read {second} B")
    third = reconcile_pass()
    print(f"third pass, nothing new: {third} B")
    assert first >= whole_logs
    assert second <= 2 * new_bytes, "the second pass reads about the new lines, not the whole logs"
    assert third < new_bytes / 5  # nothing new: only the last line again, per pod


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


# --- Pods the cluster will not make, and pods that come late ---------------------------------

EVENTS_PATH = f"/api/v1/namespaces/{NAMESPACE}/events"


def tight_quota(standin, gpus: str) -> None:
    """A ResourceQuota on the namespace's GPUs, as a cluster operator might set one (not the portal's)."""
    standin.put({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "operator-gpus", "namespace": NAMESPACE},
                 "spec": {"hard": {"requests.nvidia.com/gpu": gpus}}})


def test_an_attempt_over_quota_says_why_it_waits_and_runs_once_the_quota_grows(backend, cluster):
    tight_quota(cluster, "2")  # three replicas of one GPU each: the third is refused
    backend.launch_job(make_launch())
    assert wait_until(lambda: cluster.events(NAMESPACE, reason="FailedCreate"), timeout_s=10)
    cluster.clear_log()
    status = backend.job_status(41, 1)
    assert status.phase == "running"
    assert status.waiting == ("Waiting for its pods: the cluster refuses to create them (exceeded quota: operator-gpus, "
                              "requested: requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=2, "
                              "limited: requests.nvidia.com/gpu=2).")
    # One list of the Job's FailedCreate Events, allowed by deploy/'s RBAC (the stand-in enforces it).
    reads = [r for r in cluster.requests if r.path == EVENTS_PATH]
    assert [(r.status, r.query["fieldSelector"]) for r in reads] == [
        (200, ["involvedObject.kind=Job,involvedObject.name=job-41-1,reason=FailedCreate"])]
    status, answer = api_call(cluster, "PATCH", f"/api/v1/namespaces/{NAMESPACE}/resourcequotas/operator-gpus",
                              {"spec": {"hard": {"requests.nvidia.com/gpu": "3"}}},
                              content_type="application/merge-patch+json")
    assert status == 200, answer

    def all_bound() -> bool:
        backend._sync(force=True)
        pods = pods_by_rank(cluster)
        return len(pods) == 3 and all(pod["spec"].get("nodeName") for pod in pods.values())

    assert wait_until(all_bound, timeout_s=10)
    backend._sync(force=True)
    cluster.clear_log()
    status = backend.job_status(41, 1)
    assert (status.phase, status.waiting) == ("running", "")
    assert not [r for r in cluster.requests if r.path == EVENTS_PATH], "every replica has a pod: nothing to ask"


def test_the_events_are_read_only_for_an_attempt_missing_pods(backend, cluster):
    launched(backend, cluster)
    cluster.clear_log()
    for _ in range(3):
        assert backend.job_status(41, 1) == AttemptStatus("running")
    assert not [r for r in cluster.requests if "/events" in r.path]


def test_a_refused_replica_reads_as_waiting_even_once_others_ran(backend, cluster):
    tight_quota(cluster, "1")
    launch = make_launch(replicas=tuple(ReplicaPlacement(rank, "gpu-a", (rank,)) for rank in (0, 1)))
    backend.launch_job(launch)

    def one_bound_one_refused() -> bool:
        backend._sync(force=True)
        bound = [pod for pod in pods_by_rank(cluster).values() if pod["spec"].get("nodeName")]
        return len(bound) == 1 and bool(cluster.events(NAMESPACE, reason="FailedCreate"))

    assert wait_until(one_bound_one_refused, timeout_s=10)
    status = backend.job_status(41, 1)
    assert status.phase == "running" and "exceeded quota: operator-gpus" in status.waiting


def test_a_slow_job_controller_still_launches_binds_and_ends(make_backend):
    """The start-up delay case: the Job's pods come 1.5 s after it, long after the launch has returned."""
    with KubernetesStandIn(admin_tokens={"standin-token"}, portal_rbac=deploy_rbac(), watch_hold_s=0.1, check_answers=True,
                           controller_delay_s=1.5) as slow:
        for node in ("gpu-a", "gpu-b"):
            slow.put(gpu_node(node))
        environment_namespace(slow, NAMESPACE)
        backend = make_backend(slow.url)
        backend.launch_job(make_launch())
        assert slow.pods(NAMESPACE, as_is=True) == []  # the launch returned before any pod exists
        status = backend.job_status(41, 1)
        assert (status.phase, status.waiting) == ("running", "")  # nothing refuses them: they just come later

        def all_bound() -> bool:
            backend._sync(force=True)
            pods = pods_by_rank(slow)
            return len(pods) == 3 and all(pod["spec"].get("nodeName") == PLACEMENT[rank] for rank, pod in pods.items())

        assert wait_until(all_bound, timeout_s=15)
        for pod in pods_by_rank(slow).values():
            slow.finish_pod(NAMESPACE, pod["metadata"]["name"], 0)
        assert wait_until(lambda: backend.job_status(41, 1).phase == "exited", timeout_s=10)
        assert backend.job_status(41, 1).exit_codes == {0: 0, 1: 0, 2: 0}
        assert slow.invalid_answers == [] and slow.controller_errors == []
