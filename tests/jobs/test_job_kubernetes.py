"""Training jobs end to end on the Kubernetes backend: the portal's services against the API stand-in.

Submit, cycle, launch and reconcile are the functions the Celery tasks call; the stand-in
plays the Job controller and the kubelet, and the test plays the trainer (its pods' logs
and exit codes).
"""


import pytest

from runners.clusters.registry import get_backend
from runners.jobs import attempts, reconcile
from runners.jobs import services as jobs
from runners.jobs.models import Job
from runners.scheduling import services as scheduling
from runners.workloads.progress import CHECKPOINT_TAG, tagged_line
from tests.support.jobs import (
    admit_and_launch,
    demo_cluster_with_flavors,
    give_quota,
    job_data,
    ready_environment,
    reconcile_until,
)
from tests.support.k8s import gpu_node, job_pods

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]


@pytest.fixture
def cluster(kubernetes_cluster, settings):
    settings.PREEMPTION_GRACE_PERIOD_S = 7
    for node in ("gpu-a", "gpu-b"):
        kubernetes_cluster.put(gpu_node(node))
    get_backend().min_sync_interval_s = 0  # every reconcile pass reads the watch
    return kubernetes_cluster


@pytest.fixture
def flavors(cluster):
    return demo_cluster_with_flavors()


def test_a_job_runs_where_placed_is_preempted_with_the_grace_period_and_resumes_from_its_checkpoint(
    cluster, flavors, tenant, other_tenant, owner, outsider, django_capture_on_commit_callbacks
):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=0, max=16)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=16, max=16)
    acme_env = ready_environment(actor=owner, tenant=tenant)
    globex_env = ready_environment(actor=outsider, tenant=other_tenant)
    borrower = jobs.job_submit(actor=owner, data=job_data(acme_env, name="borrower", replicas=2, gpus_per_replica=4))
    attempt = admit_and_launch(borrower)
    reconcile.jobs_reconcile_run()
    pods = job_pods(cluster, borrower, 1)
    # Bound by the portal to the node it placed each replica on; both on one node (topology node).
    placed = {replica["replica"]: replica["node"] for replica in attempt.placement}
    assert {rank: pod["spec"]["nodeName"] for rank, pod in pods.items()} == placed
    assert len(set(placed.values())) == 1
    checkpoint = {"step": 10, "path": "checkpoints/step-00000010.pt", "bytes": 4096,
                  "created_at": "2026-12-03T10:00:00+00:00"}
    cluster.write_log(acme_env.namespace, pods[0]["metadata"]["name"], tagged_line(CHECKPOINT_TAG, checkpoint) + "\n")
    reconcile.jobs_reconcile_run()
    assert list(borrower.checkpoints.values_list("step", flat=True)) == [10]

    # Globex claims its guarantee: the borrower is preempted; its pods are deleted with the grace period.
    owed = jobs.job_submit(actor=outsider, data=job_data(globex_env, name="owed", replicas=2, gpus_per_replica=8,
                                                         topology={"level": "none", "mode": "preferred"},
                                                         priority=50))
    cluster.clear_log()
    with django_capture_on_commit_callbacks(execute=True):
        assert scheduling.cycle_run()["preempted"] == [borrower.id]
    attempts.job_stop_run(job_id=borrower.id)  # what the job_stop task sent after commit does
    pod_deletes = [r for r in cluster.requests if r.method == "DELETE" and "/pods/" in r.path]
    assert len(pod_deletes) == 2 and {r.query["gracePeriodSeconds"][0] for r in pod_deletes} == {"7"}
    borrower = reconcile_until(borrower, {"queued"}, timeout_s=10, pause_s=0.05)
    first = borrower.attempts.get(number=1)
    assert (first.outcome, first.exit_code) == ("preempted", 75)
    assert "resumes from step 10" in borrower.reason

    # The owed job runs and finishes; then the borrower comes back, resuming from step 10.
    admit_and_launch(owed)
    reconcile.jobs_reconcile_run()
    for pod in job_pods(cluster, owed, 1).values():
        cluster.finish_pod(globex_env.namespace, pod["metadata"]["name"], 0)
    owed = reconcile_until(owed, {"succeeded"}, timeout_s=10, pause_s=0.05)
    second = admit_and_launch(borrower)
    second.refresh_from_db()
    assert second.number == 2 and second.resumed_from_step == 10
    reconcile.jobs_reconcile_run()
    for pod in job_pods(cluster, borrower, 2).values():
        assert pod["spec"]["nodeName"]
        cluster.finish_pod(acme_env.namespace, pod["metadata"]["name"], 0)
    borrower = reconcile_until(borrower, {"succeeded"}, timeout_s=10, pause_s=0.05)
    assert [a.outcome for a in borrower.attempts.order_by("number")] == ["preempted", "succeeded"]


def test_cancel_deletes_with_the_grace_period_and_the_job_ends_cancelled(
    cluster, flavors, tenant, owner, django_capture_on_commit_callbacks
):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    environment = ready_environment(actor=owner, tenant=tenant)
    job = jobs.job_submit(actor=owner, data=job_data(environment, replicas=2))
    admit_and_launch(job)
    reconcile.jobs_reconcile_run()
    cluster.clear_log()
    with django_capture_on_commit_callbacks(execute=True):
        jobs.job_cancel(actor=owner, job=Job.objects.get(id=job.id))
    attempts.job_stop_run(job_id=job.id)  # what the job_stop task sent after commit does
    deletes = [r for r in cluster.requests if r.method == "DELETE"]
    assert {r.query["gracePeriodSeconds"][0] for r in deletes if "/pods/" in r.path} == {"7"}
    assert [r.query["propagationPolicy"] for r in deletes if "/jobs/" in r.path] == [["Orphan"]]
    job = reconcile_until(job, {"cancelled"}, timeout_s=10, pause_s=0.05)
    assert job.attempts.get().outcome == "cancelled"


def test_a_node_lost_on_kubernetes_requeues_the_job(cluster, flavors, tenant, owner):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    environment = ready_environment(actor=owner, tenant=tenant)
    job = jobs.job_submit(actor=owner, data=job_data(environment, replicas=1, topology={"level": "none", "mode": "required"}))
    attempt = admit_and_launch(job)
    reconcile.jobs_reconcile_run()
    node = attempt.placement[0]["node"]
    cluster.delete("nodes", node)
    job = reconcile_until(job, {"queued"}, timeout_s=10, pause_s=0.05)
    assert job.attempts.get(number=1).outcome == "node_lost"
    assert node in job.attempts.get(number=1).reason
    # The inventory no longer offers the node, so the next placement goes elsewhere.
    scheduling.cycle_run()
    job.refresh_from_db()
    assert job.attempts.get(number=2).placement[0]["node"] != node
