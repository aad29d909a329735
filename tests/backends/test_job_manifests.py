"""The bodies a training attempt is made of on Kubernetes, validated strictly for 1.30 and the newest schema."""

import json

import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from runners.backends.base import JobLaunch, ReplicaPlacement
from runners.backends.job_manifests import (
    checkpoint_pvc_manifest,
    job_manifests,
    rendezvous_service_manifest,
    training_job_manifest,
)
from runners.nvidia import names

KUBERNETES_VERSIONS = ("1.30.0", latest_version())
OPTIONS = dict(trainer_image="registry.example/portal/trainer:1", scheduler_name="gpu-portal", grace_period_s=120)


def make_launch(**overrides) -> JobLaunch:
    values = dict(
        job_id=7, attempt=2, tenant_slug="acme", namespace="acme--train", name="llm", template="pytorch-ddp",
        replicas=(ReplicaPlacement(0, "gpu-1", (0, 1)), ReplicaPlacement(1, "gpu-2", (4, 5))),
        gpu_resource=names.GPU_RESOURCE, gpus_per_replica=2, cpu_milli_per_replica=8000,
        memory_mib_per_replica=65536, steps=600, checkpoint_every_steps=20, max_runtime_s=3600,
        env=(("TRAIN_LR", "0.001"),),
    )
    values.update(overrides)
    return JobLaunch(**values)


def _all():
    yield pytest.param(checkpoint_pvc_manifest(namespace="acme--train", tenant_slug="acme", storage_class="standard",
                                               size="100Gi"), id="pvc")
    for label, launch in {
        "ddp": make_launch(),
        "custom": make_launch(template="custom", image="nvcr.io/nvidia/pytorch:24.01-py3",
                              command=("python", "train.py")),
        "mig": make_launch(gpu_resource="nvidia.com/mig-1g.10gb", gpus_per_replica=1,
                           replicas=(ReplicaPlacement(0, "gpu-1", (3,), "1g.10gb", 2),)),
    }.items():
        for manifest in job_manifests(launch, **OPTIONS):
            yield pytest.param(manifest, id=f"{label}-{manifest['kind']}")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("manifest", list(_all()))
def test_every_job_manifest_validates_strictly(manifest, version):
    kubernetes_validate.validate(manifest, version, strict=True)


def test_the_job_is_indexed_one_pod_per_replica_never_retried_by_kubernetes():
    spec = training_job_manifest(make_launch(), **OPTIONS)["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == ("Indexed", 2, 2, 0)
    assert spec["activeDeadlineSeconds"] == 3600


def test_pods_name_the_portals_scheduler_and_carry_where_each_index_goes():
    job = training_job_manifest(make_launch(), **OPTIONS)
    pod = job["spec"]["template"]["spec"]
    assert pod["schedulerName"] == "gpu-portal", "kube-scheduler must never place them"
    assert "nodeSelector" not in pod and "affinity" not in pod and "tolerations" not in pod
    assert json.loads(job["metadata"]["annotations"]["portal.gpu/placement"]) == {"0": "gpu-1", "1": "gpu-2"}


def test_the_pod_is_restricted_and_asks_for_exactly_the_placed_gpus():
    pod = training_job_manifest(make_launch(), **OPTIONS)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "workload" and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    for forbidden in ("hostNetwork", "hostPID", "hostIPC"):
        assert forbidden not in pod
    assert all("hostPath" not in volume for volume in pod["volumes"])
    (container,) = pod["containers"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "privileged" not in container["securityContext"]
    assert container["resources"]["limits"][names.GPU_RESOURCE] == "2"
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert pod["terminationGracePeriodSeconds"] == 120, "preemption and cancel give the grace period"


def test_the_rank_comes_from_the_completion_index_and_rank_0_is_the_rendezvous():
    launch = make_launch()
    env = {item["name"]: item for item in training_job_manifest(launch, **OPTIONS)["spec"]["template"]["spec"]
           ["containers"][0]["env"]}
    assert env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert env["WORLD_SIZE"]["value"] == "2"
    assert env["MASTER_ADDR"]["value"] == "job-7-2-0.job-7-2"
    assert env["TRAIN_JOB_DIR"]["value"] == "/checkpoints/job-7", "every attempt resumes from the same folder"
    assert env["TRAIN_LR"]["value"] == "0.001"
    service = rendezvous_service_manifest(launch)
    assert service["spec"]["clusterIP"] == "None" and service["metadata"]["name"] == "job-7-2"
    assert service["spec"]["selector"] == {"portal.gpu/job-id": "7", "portal.gpu/attempt": "2"}


def test_a_custom_job_runs_its_image_and_command_the_trainer_template_the_portals():
    custom = training_job_manifest(make_launch(template="custom", image="nvcr.io/nvidia/pytorch:24.01-py3",
                                               command=("python", "train.py")), **OPTIONS)
    ddp = training_job_manifest(make_launch(), **OPTIONS)
    assert custom["spec"]["template"]["spec"]["containers"][0]["image"] == "nvcr.io/nvidia/pytorch:24.01-py3"
    assert custom["spec"]["template"]["spec"]["containers"][0]["command"] == ["python", "train.py"]
    assert ddp["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/portal/trainer:1"
