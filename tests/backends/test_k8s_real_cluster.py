"""The Kubernetes backend against a real cluster (kind or k3s, without GPUs), where KUBECONFIG points at one.

Skipped here, saying why (tests/backends/conftest.py). Each test makes its own namespace and
deletes it. A cluster without GPUs is enough: its kubelet refuses a pod asking for one.
"""

import time
import uuid

import pytest

from runners.backends.base import JobLaunch, ReplicaPlacement
from runners.nvidia import names
from tests.support.k8s import make_spec

pytestmark = [pytest.mark.e2e, pytest.mark.real_cluster]


@pytest.fixture
def environment(real_backend):
    spec = make_spec(environment_id=90000 + uuid.uuid4().int % 10000, namespace=f"portal-test-{uuid.uuid4().hex[:8]}",
                     members=(), quota_hard={})
    real_backend.ensure_environment(spec)
    yield spec
    real_backend.delete_environment(spec)


def _launch(spec, node: str) -> JobLaunch:
    return JobLaunch(
        job_id=1, attempt=1, tenant_slug=spec.tenant_slug, namespace=spec.namespace, name="real", template="pytorch-ddp",
        replicas=(ReplicaPlacement(0, node, (0,)),), gpu_resource=names.GPU_RESOURCE, gpus_per_replica=1,
        cpu_milli_per_replica=100, memory_mib_per_replica=128, steps=10, checkpoint_every_steps=5, max_runtime_s=60,
        env=(), grace_period_s=5, resume_from_step=None,
    )


def test_the_checkpoint_claim_is_made_once_and_a_changed_class_or_size_breaks_no_launch(real_backend, environment):
    node = real_backend._checked("Node", "list")[1]["items"][0]["metadata"]["name"]
    real_backend.launch_job(_launch(environment, node))
    claim = real_backend._checked("PersistentVolumeClaim", "read", "checkpoints", environment.namespace)[1]
    real_backend.checkpoint_storage_class = "another-class"
    real_backend.checkpoint_volume_size = "1Mi"
    real_backend.forget_job(1, 1)
    real_backend.launch_job(_launch(environment, node))  # a strict server answers 422 to either change
    again = real_backend._checked("PersistentVolumeClaim", "read", "checkpoints", environment.namespace)[1]
    assert again["spec"].get("storageClassName") == claim["spec"].get("storageClassName")
    assert again["spec"]["resources"]["requests"]["storage"] == claim["spec"]["resources"]["requests"]["storage"]


def test_a_pod_the_kubelet_refuses_ends_the_attempt_as_preempted_with_its_reason(real_backend, environment):
    node = real_backend._checked("Node", "list")[1]["items"][0]["metadata"]["name"]
    real_backend.jobs_open({(1, 1)})
    real_backend.launch_job(_launch(environment, node))
    deadline = time.monotonic() + 60
    status = real_backend.job_status(1, 1)
    while status.phase == "running" and time.monotonic() < deadline:
        time.sleep(1)
        real_backend._sync(force=True)
        status = real_backend.job_status(1, 1)
    assert status.phase == "preempted", status
    assert f"OutOf{names.GPU_RESOURCE}" in status.reason
