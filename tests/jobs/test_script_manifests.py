"""A `script` attempt on Kubernetes: the init container that fetches the bundle, the code volume read-only as
the working directory, the tenant's command with the usual variables, every manifest validated strictly."""

import json

import kubernetes_validate
import pytest

from runners.backends.base import BundleRef, PermanentBackendError
from runners.backends.job_manifests import CODE_MOUNT, job_manifests, training_job_manifest
from tests.backends.test_job_manifests import KUBERNETES_VERSIONS, OPTIONS, make_launch

pytestmark = pytest.mark.unit

SHA = "ef" * 32
FETCH_URL = "https://portal.example.com/bundles/fetch/eyJidW5kbGUiOjF9:sig/"


def script_launch(**overrides):
    values = dict(
        template="script", command=("python", "train.py", "--epochs", "3"),
        bundle=BundleRef(sha256=SHA, url=f"s3://bundles/acme/{SHA}.tar.gz", fetch_url=FETCH_URL),
        hyperparameters_json=json.dumps({"lr": 0.1, "layers": [64, 64]}),
    )
    values.update(overrides)
    return make_launch(**values)


def _pod(launch) -> dict:
    return training_job_manifest(launch, **OPTIONS)["spec"]["template"]["spec"]


def _env(container) -> dict:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("launch", [
    pytest.param(script_launch(), id="runtime-image"),
    pytest.param(script_launch(image="nvcr.io/nvidia/pytorch:24.01-py3", resume_from_step=40), id="own-image"),
    pytest.param(script_launch(cpu_milli_per_replica=250, memory_mib_per_replica=512), id="small-replica"),
])
def test_every_script_manifest_validates_strictly(launch, version):
    for manifest in job_manifests(launch, **OPTIONS):
        kubernetes_validate.validate(manifest, version, strict=True)


def test_an_init_container_fetches_the_bundle_into_the_code_volume_mounted_read_only_as_the_working_directory():
    pod = _pod(script_launch())
    (fetch,) = pod["initContainers"]
    assert fetch["image"] == OPTIONS["trainer_image"], "the portal's runtime image, which has gpuportal.fetch"
    assert fetch["command"] == ["python", "-m", "gpuportal.fetch", FETCH_URL, CODE_MOUNT, "--sha256", SHA]
    assert {"name": "code", "mountPath": CODE_MOUNT} in fetch["volumeMounts"]
    assert fetch["securityContext"] == pod["containers"][0]["securityContext"]
    (main,) = pod["containers"]
    assert main["workingDir"] == CODE_MOUNT
    assert {"name": "code", "mountPath": CODE_MOUNT, "readOnly": True} in main["volumeMounts"]
    assert {"name": "code", "emptyDir": {}} in pod["volumes"]
    # Never the storage URL: the pod has no credentials for it.
    assert f"s3://bundles/acme/{SHA}.tar.gz" not in json.dumps(pod)


def test_the_main_container_runs_the_command_as_given_with_the_usual_variables_and_the_hyperparameters():
    (main,) = _pod(script_launch(resume_from_step=40))["containers"]
    assert main["image"] == OPTIONS["trainer_image"]
    assert main["command"] == ["python", "train.py", "--epochs", "3"] and "args" not in main
    env = _env(main)
    assert env["RANK"] == {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert (env["WORLD_SIZE"], env["PORTAL_ATTEMPT"], env["TRAIN_JOB_DIR"]) == ("2", "2", "/checkpoints/job-7")
    assert json.loads(env["PORTAL_HYPERPARAMETERS"]) == {"lr": 0.1, "layers": [64, 64]}
    assert env["PORTAL_RESUME_FROM_STEP"] == "40"
    assert env["TRAIN_MAX_RUNTIME_S"] == "3600"
    assert {"name": "checkpoints", "mountPath": "/checkpoints"} in main["volumeMounts"]


def test_a_first_attempt_has_nothing_to_resume_from():
    assert "PORTAL_RESUME_FROM_STEP" not in _env(_pod(script_launch())["containers"][0])


def test_the_tenants_image_runs_the_command_and_the_portals_the_fetch():
    pod = _pod(script_launch(image="nvcr.io/nvidia/pytorch:24.01-py3"))
    assert pod["containers"][0]["image"] == "nvcr.io/nvidia/pytorch:24.01-py3"
    # The fetch needs gpuportal, which the tenant's image need not have.
    assert pod["initContainers"][0]["image"] == OPTIONS["trainer_image"]


def test_the_fetch_asks_for_no_more_than_a_replica_has():
    fetch = _pod(script_launch(cpu_milli_per_replica=250, memory_mib_per_replica=512))["initContainers"][0]
    assert fetch["resources"]["limits"] == {"cpu": "250m", "memory": "512Mi"}
    assert fetch["resources"]["requests"] == fetch["resources"]["limits"]


def test_the_shipped_trainer_and_custom_images_get_no_init_container_nor_code_volume():
    for launch in (make_launch(), make_launch(template="custom", image="nvcr.io/nvidia/pytorch:24.01-py3",
                                              command=("python", "train.py"))):
        pod = _pod(launch)
        assert "initContainers" not in pod and all(volume["name"] != "code" for volume in pod["volumes"])
        assert "PORTAL_HYPERPARAMETERS" not in _env(pod["containers"][0])


@pytest.mark.parametrize("bundle", [None, BundleRef(sha256=SHA, url=f"file:///var/bundles/acme/{SHA}.tar.gz")])
def test_a_script_launch_without_a_url_a_pod_can_fetch_builds_nothing_and_says_what_to_set(bundle):
    with pytest.raises(PermanentBackendError, match="PORTAL_PUBLIC_URL"):
        job_manifests(script_launch(bundle=bundle), **OPTIONS)
