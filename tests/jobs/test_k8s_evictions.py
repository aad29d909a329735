"""Pods the cluster stops, end to end on the Kubernetes backend: a drain, an eviction from outside, a kubelet refusal.

The portal's services against the API stand-in, whose eviction subresource marks the pod with
a DisruptionTarget condition and deletes it with its grace period (the trainer exits 75), and
whose kubelet refuses a pod its node has no room for (Failed, OutOf<resource>, no container run).
"""

import time

import pytest

from runners.clusters import services as clusters
from runners.clusters.models import NodePool, PartitionProfile
from runners.clusters.registry import get_backend
from runners.jobs import attempts, reconcile
from runners.jobs import services as jobs
from runners.nvidia import names
from tests.support.jobs import (
    admit_and_launch,
    demo_cluster_with_flavors,
    give_quota,
    job_data,
    ready_environment,
    reconcile_until,
)
from tests.support.k8s import api_call, gpu_node, job_pods, portal_pod
from tests.support.partitions import drive_partition_change

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]

OTHERS = "acme-train"  # a namespace the portal did not make, for pods that are not its jobs


@pytest.fixture
def cluster(kubernetes_cluster, settings):
    settings.PREEMPTION_GRACE_PERIOD_S = 7
    for namespace in ("gpu-operator", OTHERS):
        kubernetes_cluster.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    for node in ("gpu-a", "gpu-b"):
        kubernetes_cluster.put(gpu_node(node))
    get_backend().min_sync_interval_s = 0  # every reconcile pass reads the watch
    return kubernetes_cluster


@pytest.fixture
def flavors(cluster):
    return demo_cluster_with_flavors()


def _running_job(tenant, owner, flavors, *, guaranteed=8):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=guaranteed, max=8)
    environment = ready_environment(actor=owner, tenant=tenant)
    job = jobs.job_submit(actor=owner, data=job_data(environment, replicas=2))
    attempt = admit_and_launch(job)
    reconcile.jobs_reconcile_run()
    return job, attempt


def test_a_drain_stops_the_portals_job_through_the_portal_and_evicts_only_what_is_not_its_own(
    cluster, flavors, tenant, owner, staff, client_for, django_capture_on_commit_callbacks
):
    job, attempt = _running_job(tenant, owner, flavors, guaranteed=0)  # no guarantee on the pool being re-cut
    node = attempt.placement[0]["node"]
    pods = job_pods(cluster, job)
    assert all(pod["metadata"]["name"].startswith(f"job-{job.id}-1-") for pod in pods.values())
    cluster.put(portal_pod("someone-elses", node, namespace=OTHERS))
    PartitionProfile.objects.create(name="h100-4g-3g", gpu_model="H100-80GB", kind="mig", layout=["4g.40gb", "3g.40gb"])
    pool = NodePool.objects.get(name="h100-pool")
    with django_capture_on_commit_callbacks():
        response = client_for(staff).post(f"/api/v1/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g", "drain": "preempt"})
    assert response.status_code == 202, response.content
    change_id = response.json()["id"]
    cluster.clear_log()

    state, delay_s, lease = clusters.partition_change_step(change_id=change_id, lease=None)  # cordon and drain
    evictions = [r.path for r in cluster.requests if r.method == "POST" and r.path.endswith("/eviction")]
    # The job's pods are the portal's to stop (checkpoint, requeue): never evicted behind its back.
    assert evictions == [f"/api/v1/namespaces/{OTHERS}/pods/someone-elses/eviction"]
    job.refresh_from_db()
    assert job.state == "preempted", job.reason
    attempts.job_stop_run(job_id=job.id)  # what the job_stop task sent after commit does
    job = reconcile_until(job, {"queued"}, timeout_s=10, pause_s=0.05)
    first = job.attempts.get(number=1)
    assert (first.outcome, first.exit_code) == ("preempted", 75)
    assert "re-partitioned" in first.reason
    for _ in range(300):
        if delay_s is None:
            break
        time.sleep(delay_s)
        state, delay_s, lease = clusters.partition_change_step(change_id=change_id, lease=lease)
    assert state == "succeeded"


def test_a_pod_evicted_from_outside_requeues_the_job_saying_so(cluster, flavors, tenant, owner):
    job, _attempt = _running_job(tenant, owner, flavors)
    pod = job_pods(cluster, job)[1]["metadata"]
    # What `kubectl drain` does: the eviction API, with the pod's own grace period.
    status, answer = api_call(cluster, "POST", f"/api/v1/namespaces/{pod['namespace']}/pods/{pod['name']}/eviction",
                              {"apiVersion": "policy/v1", "kind": "Eviction",
                               "metadata": {"name": pod["name"], "namespace": pod["namespace"]}})
    assert status == 201, answer
    job = reconcile_until(job, {"queued", "failed"}, timeout_s=10, pause_s=0.05)
    first = job.attempts.get(number=1)
    assert first.outcome == "preempted", first.reason
    assert pod["name"] in first.reason and "EvictionByEvictionAPI" in first.reason
    assert job.state == "queued" and job.failures == 0, job.reason


def test_a_pod_the_kubelet_refuses_requeues_the_job_and_is_no_failure_of_its_own(cluster, flavors, tenant, owner):
    # Someone else's pods hold every GPU of both nodes; the portal's inventory does not see them.
    for node in ("gpu-a", "gpu-b"):
        hog = portal_pod(f"hog-{node}", node, namespace=OTHERS)
        hog["spec"]["containers"][0]["resources"] = {"requests": {names.GPU_RESOURCE: "8"},
                                                     "limits": {names.GPU_RESOURCE: "8"}}
        cluster.put(hog)
    job, _attempt = _running_job(tenant, owner, flavors)
    job = reconcile_until(job, {"queued", "failed"}, timeout_s=10, pause_s=0.05)
    first = job.attempts.get(number=1)
    assert first.outcome == "preempted", first.reason
    assert f"OutOf{names.GPU_RESOURCE}" in first.reason
    assert job.state == "queued" and job.failures == 0, job.reason


def test_a_drain_whose_eviction_a_disruption_budget_refuses_asks_again_and_goes_on(
    cluster, flavors, staff, client_for, django_capture_on_commit_callbacks
):
    cluster.put(portal_pod("server-1", "gpu-a", namespace=OTHERS))
    # Its PodDisruptionBudget allows no disruption at first (another replica is not ready yet).
    cluster.inject(429, method="POST", path_contains="/pods/server-1/eviction", reason="TooManyRequests",
                   message="Cannot evict pod as it would violate the pod's disruption budget.")
    PartitionProfile.objects.create(name="h100-4g-3g", gpu_model="H100-80GB", kind="mig", layout=["4g.40gb", "3g.40gb"])
    pool = NodePool.objects.get(name="h100-pool")
    with django_capture_on_commit_callbacks():
        response = client_for(staff).post(f"/api/v1/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g", "drain": "preempt"})
    assert response.status_code == 202, response.content
    cluster.clear_log()
    assert drive_partition_change(response.json()["id"]) == "succeeded"
    evictions = [r for r in cluster.requests if r.method == "POST" and r.path.endswith("/pods/server-1/eviction")]
    assert [r.status for r in evictions] == [429, 201]
