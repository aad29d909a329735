"""On the Kubernetes backend a checkpoint stays on the environment's volume in the cluster: its download is a 409
that names the backend and says how a member copies it (the stand-in API server behind the backend)."""

import pytest
from django.utils import timezone

from runners.jobs import services as jobs
from runners.jobs.models import Checkpoint
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment
from tests.support.k8s import gpu_node

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]


def test_a_checkpoint_download_on_kubernetes_is_a_409_saying_how_to_copy_it(
    kubernetes_cluster, tenant, owner, client_for
):
    kubernetes_cluster.put(gpu_node("gpu-a"))
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=2)
    environment = ready_environment(actor=owner, tenant=tenant)
    job = jobs.job_submit(actor=owner, data=job_data(environment, name="tiny", replicas=1, topology={"level": "none"}))
    Checkpoint.objects.create(job=job, step=20, uri="checkpoints/step-00000020.pt", bytes=1000,
                              created_at=timezone.now())
    response = client_for(owner).get(f"/api/v1/jobs/{job.id}/checkpoints/20/download/")
    assert response.status_code == 409
    detail = response.json()["detail"]
    namespace = environment.namespace
    assert "kubernetes backend" in detail and "'checkpoints'" in detail and "portal kubeconfig" in detail
    assert (f"kubectl -n {namespace} cp <pod>:/checkpoints/job-{job.id}/checkpoints/step-00000020.pt "
            f"./step-00000020.pt") in detail
    # A step it has not recorded is still the 404 naming the step: nothing is asked of the cluster for it.
    missing = client_for(owner).get(f"/api/v1/jobs/{job.id}/checkpoints/7/download/")
    assert missing.status_code == 404 and "step" in missing.json()
