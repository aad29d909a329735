"""The checkpoint uploader in a job's pods: a native sidecar (an init container that restarts), validated strictly
for 1.30 and the newest schema, within Pod Security "restricted", holding no store credentials."""

import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from runners.backends.base import BundleRef, JobLaunch, ReplicaPlacement, TrainerSettings
from runners.backends.job_manifests import UPLOAD_URL_VARIABLE, job_manifests, training_job_manifest
from runners.nvidia import names
from tests.support.k8s_standin import _restricted_violations

pytestmark = pytest.mark.unit

OPTIONS = dict(trainer_image="registry.example/portal/trainer:1", scheduler_name="gpu-portal", grace_period_s=120)
URL = "https://portal.example.com/checkpoints/upload/eyJqb2IiOjd9:signature/"


def make_launch(**overrides) -> JobLaunch:
    values = dict(
        job_id=7, attempt=2, tenant_slug="acme", namespace="acme--train", name="llm", template="pytorch-ddp",
        replicas=(ReplicaPlacement(0, "gpu-1", (0, 1)), ReplicaPlacement(1, "gpu-2", (4, 5))),
        gpu_resource=names.GPU_RESOURCE, gpus_per_replica=2, cpu_milli_per_replica=8000,
        memory_mib_per_replica=65536, steps=600, checkpoint_every_steps=20, max_runtime_s=3600,
        trainer=TrainerSettings(lr=0.001, batch_size=64, seq_len=128, seed=9, keep_checkpoints=3),
        checkpoint_upload_url=URL,
    )
    values.update(overrides)
    return JobLaunch(**values)


def _pod(launch: JobLaunch) -> dict:
    return training_job_manifest(launch, **OPTIONS)["spec"]["template"]["spec"]


@pytest.mark.parametrize("version", ("1.30.0", latest_version()))
def test_the_job_with_its_uploader_validates_strictly(version):
    for manifest in job_manifests(make_launch(), **OPTIONS):
        kubernetes_validate.validate(manifest, version, strict=True)


def test_the_uploader_is_a_native_sidecar_reading_the_job_folder_with_the_signed_url_only():
    pod = _pod(make_launch())
    (uploader,) = pod["initContainers"]
    assert uploader["name"] == "checkpoint-uploader" and uploader["restartPolicy"] == "Always"
    assert uploader["image"] == OPTIONS["trainer_image"]
    assert uploader["command"] == ["python", "-m", "runners.workloads.checkpoint_uploader",
                                   "--job-dir", "/checkpoints/job-7"]
    env = {item["name"]: item for item in uploader["env"]}
    assert env[UPLOAD_URL_VARIABLE]["value"] == URL
    assert env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    assert not any("STORAGE" in name or "AWS" in name or "SECRET" in name for name in env), "no store credentials"
    mounts = {mount["name"]: mount for mount in uploader["volumeMounts"]}
    assert mounts["checkpoints"]["readOnly"] is True and mounts["checkpoints"]["mountPath"] == "/checkpoints"
    assert uploader["resources"]["requests"] == uploader["resources"]["limits"], "the pod stays as placed"
    assert _restricted_violations(pod) == []


def test_a_script_pod_fetches_its_bundle_first_then_runs_the_uploader_beside_the_script():
    launch = make_launch(template="script", command=("python", "train.py"), bundle=BundleRef(
        sha256="ab" * 32, url="file:///x", fetch_url="https://portal.example.com/bundles/fetch/t/"))
    pod = _pod(launch)
    assert [container["name"] for container in pod["initContainers"]] == ["fetch-bundle", "checkpoint-uploader"]
    assert "restartPolicy" not in pod["initContainers"][0]
    assert _restricted_violations(pod) == []


@pytest.mark.parametrize("url", ["", "/checkpoints/upload/token/"])
def test_without_an_absolute_upload_url_there_is_no_uploader(url):
    assert "initContainers" not in _pod(make_launch(checkpoint_upload_url=url))
