"""The bodies a training attempt is made of on Kubernetes, validated strictly for 1.30 and the newest schema."""

import json

import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from runners.backends.base import JobLaunch, PermanentBackendError, ReplicaPlacement, TrainerSettings
from runners.backends.job_manifests import (
    SCRATCH_VARIABLES,
    checkpoint_pvc_manifest,
    job_manifests,
    rendezvous_service_manifest,
    training_job_manifest,
)
from runners.nvidia import names

pytestmark = pytest.mark.unit

KUBERNETES_VERSIONS = ("1.30.0", latest_version())
OPTIONS = dict(trainer_image="registry.example/portal/trainer:1", scheduler_name="gpu-portal", grace_period_s=120)


def make_launch(**overrides) -> JobLaunch:
    values = dict(
        job_id=7, attempt=2, tenant_slug="acme", namespace="acme--train", name="llm", template="pytorch-ddp",
        replicas=(ReplicaPlacement(0, "gpu-1", (0, 1)), ReplicaPlacement(1, "gpu-2", (4, 5))),
        gpu_resource=names.GPU_RESOURCE, gpus_per_replica=2, cpu_milli_per_replica=8000,
        memory_mib_per_replica=65536, steps=600, checkpoint_every_steps=20, max_runtime_s=3600,
        env=(("DATASET_SPLIT", "train"),),
        trainer=TrainerSettings(lr=0.001, batch_size=64, seq_len=128, seed=9, keep_checkpoints=3),
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
    assert "activeDeadlineSeconds" not in spec, "it would count start-up against max_runtime_s"


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
    assert env["DATASET_SPLIT"]["value"] == "train"
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


def _container(launch: JobLaunch) -> dict:
    return training_job_manifest(launch, **OPTIONS)["spec"]["template"]["spec"]["containers"][0]


def test_the_trainer_runs_on_flags_from_the_spec_a_custom_image_on_its_own_command():
    ddp = _container(make_launch())
    assert ddp["command"] == ["python", "-m", "runners.workloads.train"]
    assert ddp["args"] == [
        "--job-dir", "/checkpoints/job-7", "--steps", "600", "--checkpoint-every", "20", "--max-runtime-s", "3600",
        "--lr", "0.001", "--batch-size", "64", "--seq-len", "128", "--seed", "9", "--keep-checkpoints", "3",
    ]
    custom = _container(make_launch(template="custom", image="nvcr.io/nvidia/pytorch:24.01-py3",
                                    command=("python", "train.py")))
    assert "args" not in custom, "a custom image's command is its own"


def test_the_memory_limit_is_the_specs_and_home_tmp_and_caches_are_the_pods_own_volume():
    container = _container(make_launch(memory_mib_per_replica=3000))
    assert container["resources"]["limits"]["memory"] == "3000Mi" == container["resources"]["requests"]["memory"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    pod = training_job_manifest(make_launch(), **OPTIONS)["spec"]["template"]["spec"]
    assert {"name": "scratch", "emptyDir": {}} in pod["volumes"]
    assert {"name": "scratch", "mountPath": "/scratch"} in container["volumeMounts"]
    for name in ("HOME", "TMPDIR", "XDG_CACHE_HOME", "TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert env[name] == SCRATCH_VARIABLES[name] and env[name].startswith("/scratch")


def test_the_tenants_variables_come_first_and_a_refused_one_builds_nothing():
    names_in_order = [item["name"] for item in _container(make_launch())["env"]]
    assert names_in_order[0] == "DATASET_SPLIT" and len(names_in_order) == len(set(names_in_order))
    for name in ("TRAIN_BATCH_SIZE", "RANK", "TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "LD_PRELOAD", "X\n"):
        with pytest.raises(PermanentBackendError, match="may not set"):
            training_job_manifest(make_launch(env=((name, "1"),)), **OPTIONS)
