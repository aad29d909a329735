"""The Kubernetes backend where a strict API server (and the controllers behind it) would show it wrong.

Job deadlines counted from the Job's start, a checkpoint claim that cannot change class or
shrink, a 403 that is the server's policy rather than the portal's rights, pods evicted or
refused by the kubelet, an eviction a PodDisruptionBudget answers 429, a drain that tells the
portal's pods by their labels, and a sync that holds no lock of the cache across a network wait.
"""

import logging
import threading
import time

import pytest

from runners.backends.base import JobLaunch, PermanentBackendError, ReplicaPlacement
from runners.nvidia import names
from tests.support.k8s import api_call, environment_namespace, gpu_node, pods_by_rank, portal_pod

pytestmark = pytest.mark.e2e

NAMESPACE = "acme-train"
PLACEMENT = {0: "gpu-b", 1: "gpu-a"}


def make_launch(**overrides) -> JobLaunch:
    values = dict(
        job_id=41, attempt=1, tenant_slug="acme", namespace=NAMESPACE, name="llm", template="pytorch-ddp",
        replicas=tuple(ReplicaPlacement(rank, node, (rank,)) for rank, node in PLACEMENT.items()),
        gpu_resource=names.GPU_RESOURCE, gpus_per_replica=1, cpu_milli_per_replica=4000,
        memory_mib_per_replica=16384, steps=100, checkpoint_every_steps=10, max_runtime_s=3600,
        env=(), grace_period_s=120, resume_from_step=None,
    )
    values.update(overrides)
    return JobLaunch(**values)


@pytest.fixture
def cluster(standin):
    for node in ("gpu-a", "gpu-b"):
        standin.put(gpu_node(node))
    environment_namespace(standin, NAMESPACE)
    return standin


def launched(backend, api, launch=None) -> JobLaunch:
    launch = launch or make_launch()
    backend.launch_job(launch)
    backend._sync(force=True)
    pods = pods_by_rank(api, launch.job_id, launch.attempt)
    assert len(pods) == len(launch.replicas), f"the Job made {len(pods)} pods of {len(launch.replicas)}"
    assert all(pod["spec"].get("nodeName") for pod in pods.values())
    return launch


def status_after(backend, seconds: float, *, until=lambda status: False):
    """The attempt's status read again and again for `seconds` (or until `until` says so): the last one read."""
    end = time.monotonic() + seconds
    while True:
        backend._sync(force=True)
        status = backend.job_status(41, 1)
        if until(status) or time.monotonic() >= end:
            return status
        time.sleep(0.05)


def replace_pod(api, pod: dict, **status) -> None:
    """What the kubelet (or the eviction API) writes on a pod: its status, through the API."""
    metadata = pod["metadata"]
    pod = {**pod, "status": {**(pod.get("status") or {}), **status}}
    code, answer = api_call(api, "PUT", f"/api/v1/namespaces/{metadata['namespace']}/pods/{metadata['name']}", pod)
    assert code == 200, answer


# --- 1. Job deadlines ---------------------------------------------------------------------


def test_a_start_up_longer_than_the_runtime_budget_does_not_end_the_attempt(backend, cluster):
    """The budget counts from the trainer's first step; binding, pulling and starting take longer here."""
    launched(backend, cluster, make_launch(max_runtime_s=1))
    # Three times the budget passes before the trainer's first step: the Job controller must not end it.
    status = status_after(backend, 3, until=lambda status: status.phase != "running")
    assert status.phase == "running", status
    job = cluster.get("jobs", "job-41-1", NAMESPACE)
    conditions = (job.get("status") or {}).get("conditions") or []
    assert not [c for c in conditions if c.get("type") == "Failed"], conditions
    assert all(pod["spec"].get("nodeName") for pod in pods_by_rank(cluster).values())


# --- 2. The checkpoint claim -----------------------------------------------------------


def existing_claim(api, *, size: str, storage_class: str) -> None:
    api.put({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "checkpoints", "namespace": NAMESPACE,
                     "labels": {"app.kubernetes.io/managed-by": "gpu-portal"}},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": size}},
                 "storageClassName": storage_class},
    })


def test_a_changed_storage_class_or_a_smaller_size_leaves_the_existing_claim_alone(make_backend, cluster):
    existing_claim(cluster, size="200Gi", storage_class="fast-rwx")
    backend = make_backend(checkpoint_storage_class="cheap-rwx", checkpoint_volume_size="100Gi")
    launched(backend, cluster)
    claim = cluster.get("persistentvolumeclaims", "checkpoints", NAMESPACE)
    # A real server answers 422 to either change (storageClassName is immutable; a claim never shrinks).
    assert claim["spec"]["storageClassName"] == "fast-rwx"
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert not [r for r in cluster.requests if r.method == "PATCH" and "persistentvolumeclaims" in r.path]


def test_a_larger_size_grows_the_claim_by_its_request_alone(make_backend, cluster):
    existing_claim(cluster, size="100Gi", storage_class="fast-rwx")
    cluster.expandable_storage_classes = {"fast-rwx"}
    backend = make_backend(checkpoint_storage_class="cheap-rwx", checkpoint_volume_size="300Gi")
    launched(backend, cluster)
    claim = cluster.get("persistentvolumeclaims", "checkpoints", NAMESPACE)
    assert claim["spec"]["resources"]["requests"]["storage"] == "300Gi"
    assert claim["spec"]["storageClassName"] == "fast-rwx"


def test_a_claim_whose_class_cannot_expand_is_reported_and_the_launch_goes_on(make_backend, cluster, caplog):
    existing_claim(cluster, size="100Gi", storage_class="fixed-rwx")
    backend = make_backend(checkpoint_volume_size="300Gi")  # the stand-in answers 403, as the resize admission does
    with caplog.at_level(logging.WARNING, logger="runners.backends.kubernetes"):
        launched(backend, cluster)
    assert cluster.get("jobs", "job-41-1", NAMESPACE) is not None, "the launch went on with the volume there is"
    warning = " ".join(record.getMessage() for record in caplog.records)
    assert "stays at 100Gi, not 300Gi" in warning and "allowVolumeExpansion" in warning and "fixed-rwx" in warning
    assert "credentials" not in warning


def test_a_403_over_quota_is_reported_as_what_it_is_and_an_rbac_one_as_credentials(backend, cluster):
    cluster.inject(403, method="PATCH", path_contains="/jobs/job-41-1", reason="Forbidden",
                   message='jobs.batch "job-41-1" is forbidden: exceeded quota: compute, requested: count/jobs.batch=1, '
                           "used: count/jobs.batch=4, limited: count/jobs.batch=4")
    with pytest.raises(PermanentBackendError) as quota:
        backend.launch_job(make_launch())
    assert "exceeded quota" in str(quota.value) and "credentials" not in str(quota.value)
    cluster.inject(403, method="PATCH", path_contains="/jobs/job-41-1", reason="Forbidden",
                   message='jobs.batch "job-41-1" is forbidden: User "system:serviceaccount:gpu-portal:portal" cannot '
                           'patch resource "jobs" in API group "batch" in the namespace "acme-train"')
    with pytest.raises(PermanentBackendError) as rbac:
        backend.launch_job(make_launch())
    assert "credentials" in str(rbac.value)


# --- 3. Evictions and the drain ------------------------------------------------------------


def test_an_evicted_pod_gone_before_its_exit_was_seen_is_preempted_with_its_reason(backend, cluster):
    launched(backend, cluster)
    pod = pods_by_rank(cluster)[0]
    # What the eviction API writes before the kubelet stops the pod; then the pod goes at once.
    replace_pod(cluster, pod, conditions=[{"type": "DisruptionTarget", "status": "True",
                                           "reason": "EvictionByEvictionAPI",
                                           "message": "Eviction API: evicting"}])
    backend._sync(force=True)
    cluster.delete("pods", pod["metadata"]["name"], NAMESPACE)
    status = status_after(backend, 5, until=lambda status: status.phase != "running")
    assert status.phase == "preempted", status
    assert "evicted" in status.reason and "EvictionByEvictionAPI" in status.reason
    assert pod["metadata"]["name"] in status.reason


def test_an_evicted_pod_whose_trainer_checkpointed_is_preempted_with_its_reason(backend, cluster):
    launched(backend, cluster)
    pods = pods_by_rank(cluster)
    replace_pod(cluster, pods[1], conditions=[{"type": "DisruptionTarget", "status": "True",
                                               "reason": "TerminationByKubelet", "message": "node pressure"}])
    backend._sync(force=True)
    for pod in pods.values():
        cluster.finish_pod(NAMESPACE, pod["metadata"]["name"], 75)
    status = status_after(backend, 5, until=lambda status: status.phase != "running")
    assert status.phase == "preempted", status
    assert "TerminationByKubelet" in status.reason


def test_a_pod_the_kubelet_refuses_is_preempted_with_its_reason_not_a_replica_exit(backend, cluster):
    launched(backend, cluster)
    pod = pods_by_rank(cluster)[1]
    # The kubelet's admission refusal: Failed, with a reason, and no container ever started.
    replace_pod(cluster, {**pod, "status": {}}, phase="Failed", reason=f"OutOf{names.GPU_RESOURCE}",
                message=f"Pod was rejected: Node didn't have enough resource: {names.GPU_RESOURCE}, requested: 1, "
                        "used: 8, capacity: 8")
    status = status_after(backend, 5, until=lambda status: status.phase != "running")
    assert status.phase == "preempted", status
    assert f"OutOf{names.GPU_RESOURCE}" in status.reason and "gpu-a" in status.reason
    assert 1 not in status.exit_codes, "the kubelet never ran it: there is no exit of its own"


def test_the_drain_knows_the_portals_job_pods_by_their_labels(backend, cluster):
    launched(backend, cluster)
    cluster.put(portal_pod("someone-elses", "gpu-a"))
    workloads = backend.node_workloads("gpu-a")
    pod = pods_by_rank(cluster)[1]["metadata"]["name"]
    assert f"{NAMESPACE}/{pod}" in workloads and pod.startswith("job-41-1-")
    assert backend.workload_job(f"{NAMESPACE}/{pod}") == "job-41"
    assert backend.workload_job(f"{NAMESPACE}/someone-elses") == "someone-elses"


def test_an_eviction_a_disruption_budget_refuses_is_left_for_the_next_step(backend, cluster):
    cluster.put(portal_pod("server-1", "gpu-a"))
    cluster.inject(429, method="POST", path_contains="/pods/server-1/eviction", reason="TooManyRequests",
                   message="Cannot evict pod as it would violate the pod's disruption budget.")
    backend.evict("gpu-a", f"{NAMESPACE}/server-1", grace_period_s=30)  # not an error: asked again later
    assert cluster.get("pods", "server-1", NAMESPACE) is not None
    backend.evict("gpu-a", f"{NAMESPACE}/server-1", grace_period_s=30)
    pod = cluster.get("pods", "server-1", NAMESPACE)
    assert pod is None or pod["metadata"].get("deletionTimestamp"), "the second ask evicted it"


# --- 5. The sync and its lock ----------------------------------------------------------------


def test_a_watch_in_flight_holds_no_lock_that_status_reads_or_jobs_open_need(backend, cluster):
    launched(backend, cluster)
    # The next watch waits 2 s on the server, as a real one waits for events up to its timeout.
    cluster.inject(200, method="GET", path_contains="/api/v1/pods", delay_s=2.0)
    watching = threading.Thread(target=backend._sync, kwargs={"force": True})
    watching.start()
    try:
        time.sleep(0.3)  # the watch is on the wire
        backend.jobs_open({(41, 1)})
        backend.job_status(41, 1)  # answered from the cache
        assert watching.is_alive(), "these did not wait for the watch"
    finally:
        watching.join()
