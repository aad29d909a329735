"""A job whose pods the cluster refuses, end to end on the Kubernetes backend against the API stand-in.

The namespace's ResourceQuota (an operator's, put by the test) is smaller than the job's pods: the
stand-in's Job controller makes what fits, records FailedCreate for the rest and keeps trying. One
reconcile pass later the job's reason names the exceeded quota while its attempt stays running; once
the quota grows the pods appear, the reason is the running one again, and the job runs on to its end.
"""

import pytest

from runners.clusters.registry import get_backend
from runners.jobs import reconcile
from runners.jobs import services as jobs
from runners.jobs.reconcile import WAITING_MARK
from tests.support.jobs import (
    admit_and_launch,
    demo_cluster_with_flavors,
    give_quota,
    job_data,
    ready_environment,
    reconcile_until,
)
from tests.support.k8s import api_call, gpu_node, job_pods
from tests.support.races import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]


@pytest.fixture
def cluster(kubernetes_cluster):
    for node in ("gpu-a", "gpu-b"):
        kubernetes_cluster.put(gpu_node(node))
    get_backend().min_sync_interval_s = 0  # every reconcile pass reads the watch
    return kubernetes_cluster


def operator_quota(cluster, namespace: str, gpus: str) -> None:
    cluster.put({"apiVersion": "v1", "kind": "ResourceQuota",
                 "metadata": {"name": "operator-gpus", "namespace": namespace},
                 "spec": {"hard": {"requests.nvidia.com/gpu": gpus}}})


def test_a_job_over_the_namespace_quota_says_so_at_once_and_runs_once_it_grows(cluster, tenant, owner, client_for):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    environment = ready_environment(actor=owner, tenant=tenant)
    namespace = environment.namespace
    operator_quota(cluster, namespace, "1")  # the job's two pods of one GPU each: the second is refused
    job = jobs.job_submit(actor=owner, data=job_data(environment, replicas=2))
    attempt = admit_and_launch(job)
    job.refresh_from_db()
    running_reason = job.reason
    assert wait_until(lambda: cluster.events(namespace, reason="FailedCreate"), timeout_s=10)

    reconcile.jobs_reconcile_run()
    job.refresh_from_db()
    attempt.refresh_from_db()
    assert job.state == "running" and attempt.ended_at is None
    assert job.reason.startswith(f"{running_reason}{WAITING_MARK}Waiting for its pods")
    assert "exceeded quota: operator-gpus" in job.reason
    detail = client_for(owner).get(f"/api/v1/jobs/{job.id}/").json()
    assert detail["reason"] == job.reason
    # Further passes while the refusal holds write nothing new: no JobEvent, the same reason.
    events = list(job.events.values_list("to_state", "reason"))
    shown = job.reason
    reconcile.jobs_reconcile_run()
    job.refresh_from_db()
    assert job.reason == shown and list(job.events.values_list("to_state", "reason")) == events

    status, answer = api_call(cluster, "PATCH", f"/api/v1/namespaces/{namespace}/resourcequotas/operator-gpus",
                              {"spec": {"hard": {"requests.nvidia.com/gpu": "2"}}},
                              content_type="application/merge-patch+json")
    assert status == 200, answer

    def both_bound() -> bool:
        reconcile.jobs_reconcile_run()
        pods = job_pods(cluster, job)
        return len(pods) == 2 and all(pod["spec"].get("nodeName") for pod in pods.values())

    assert wait_until(both_bound, timeout_s=15)
    reconcile.jobs_reconcile_run()
    job.refresh_from_db()
    assert (job.state, job.reason) == ("running", running_reason)
    for pod in job_pods(cluster, job).values():
        cluster.finish_pod(namespace, pod["metadata"]["name"], 0)
    job = reconcile_until(job, {"succeeded"}, timeout_s=10, pause_s=0.05)
    assert [a.outcome for a in job.attempts.all()] == ["succeeded"]
