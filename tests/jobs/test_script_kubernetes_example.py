"""Issue 34's newcomer bundle on the Kubernetes backend: the SDK's DDP example (sdk/examples/ddp), packed as
`portal run` packs it, runs as an indexed Job of two pods whose init container fetches that bundle.

The stand-in runs no container, so the test plays each of them from the pod spec the portal made: the init
container's command (against the live portal's signed URL), then the main container's command in the folder
it filled, with the pod's variables (RANK from the pod's completion index); the two ranks' output is their
pods' logs and their exit codes the pods' ends. Only MASTER_ADDR and MASTER_PORT (the headless Service's name
and port, which nothing here resolves) and the pod's folders (the checkpoint volume, the scratch folder)
point at this machine's.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpuportal import bundle as packing

from runners.backends import job_manifests
from runners.bundles import services as bundles
from runners.jobs import services as jobs
from tests.jobs.test_script_kubernetes import (  # noqa: F401  (fixtures)
    _launched_pods,
    _play_the_init_container,
    cluster,
    environment,
)
from tests.support.jobs import admit_and_launch, job_data, reconcile_until
from tests.workloads.script_runs import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

EXAMPLE = Path(__file__).resolve().parents[2] / "sdk" / "examples" / "ddp"
STEPS, CHECKPOINT_EVERY = 30, 10


@pytest.fixture
def example_bundle(tenant, owner, tmp_path):
    archive = tmp_path / "ddp.tar.gz"
    archive.write_bytes(packing.pack(EXAMPLE))
    with archive.open("rb") as upload:
        return bundles.store(tenant, owner, upload)[0]


def _variables(pod: dict, container: dict) -> dict[str, str]:
    """The container's variables as the kubelet gives them: values, and fieldRefs read from the pod."""
    found = {}
    for variable in container["env"]:
        if "value" in variable:
            found[variable["name"]] = variable["value"]
            continue
        path = variable["valueFrom"]["fieldRef"]["fieldPath"]
        annotation = path.removeprefix("metadata.annotations['").removesuffix("']")
        assert annotation != path, f"{variable['name']}: only annotation fieldRefs are played here, not {path}"
        found[variable["name"]] = pod["metadata"]["annotations"][annotation]
    return found


def test_the_ddp_example_bundle_runs_as_an_indexed_job_of_two_pods_and_ends_succeeded(
    cluster, environment, example_bundle, owner, tmp_path  # noqa: F811
):
    job = jobs.job_submit(actor=owner, data=job_data(
        environment, template="script", bundle=example_bundle.sha256, command=["python", "train.py"], replicas=2,
        hyperparameters={"steps": STEPS, "checkpoint_every": CHECKPOINT_EVERY},
        topology={"level": "none", "mode": "preferred"}))
    admit_and_launch(job)
    name = f"job-{job.id}-1"
    made = cluster.get("jobs", name, environment.namespace)
    assert (made["spec"]["completionMode"], made["spec"]["completions"], made["spec"]["parallelism"]) == (
        "Indexed", 2, 2)
    service = cluster.get("services", name, environment.namespace)
    assert service["spec"]["clusterIP"] == "None", "the headless Service that names rank 0's pod"
    pods = _launched_pods(cluster, job)
    assert sorted(pods) == [0, 1]

    job_dir = tmp_path / "checkpoint-volume" / f"job-{job.id}"
    port = free_port()
    running = {}
    for rank, pod in pods.items():
        # The init container: the portal's runtime image fetching this bundle by its digest.
        fetch, _uploader = pod["spec"]["initContainers"]  # then the checkpoint uploader, a native sidecar
        assert fetch["command"][-2:] == ["--sha256", example_bundle.sha256]
        code = tmp_path / f"code-{rank}"
        fetched = _play_the_init_container(pod, code)
        assert fetched.returncode == 0, fetched.stderr
        assert sorted(p.name for p in code.iterdir()) == ["train.py"]
        assert (code / "train.py").read_bytes() == (EXAMPLE / "train.py").read_bytes()

        # The main container: the command in the fetched folder, with the pod's variables.
        (main,) = pod["spec"]["containers"]
        assert (main["command"], main["workingDir"]) == (["python", "train.py"], "/code")
        assert {"name": "code", "mountPath": "/code", "readOnly": True} in main["volumeMounts"]
        variables = _variables(pod, main)
        assert (variables["RANK"], variables["WORLD_SIZE"]) == (str(rank), "2")
        assert (variables["MASTER_ADDR"], variables["MASTER_PORT"]) == (
            f"{name}-0.{name}", str(job_manifests.RENDEZVOUS_PORT))
        assert variables["TRAIN_JOB_DIR"] == f"{job_manifests.CHECKPOINT_MOUNT}/job-{job.id}"
        assert variables["PORTAL_ATTEMPT"] == "1" and "PORTAL_RESUME_FROM_STEP" not in variables
        scratch = tmp_path / f"scratch-{rank}"
        scratch.mkdir()
        here = {name: value.replace(job_manifests.SCRATCH_MOUNT, str(scratch))
                for name, value in variables.items() if name in job_manifests.SCRATCH_VARIABLES}
        env = {"PATH": os.environ["PATH"], "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **variables, **here,
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TRAIN_JOB_DIR": str(job_dir)}
        log = (tmp_path / f"rank-{rank}.log").open("w")
        running[rank] = (subprocess.Popen([sys.executable, *main["command"][1:]], cwd=code, env=env, stdout=log,
                                          stderr=subprocess.STDOUT), log)

    for rank, (process, log) in running.items():
        exit_code = process.wait(timeout=120)
        log.close()
        text = (tmp_path / f"rank-{rank}.log").read_text()
        assert exit_code == 0, text
        pod = pods[rank]["metadata"]["name"]
        cluster.write_log(environment.namespace, pod, text)
        cluster.finish_pod(environment.namespace, pod, exit_code)

    job = reconcile_until(job, {"succeeded"}, timeout_s=30, pause_s=0.05)
    assert job.attempts.get().outcome == "succeeded"
    assert sorted(job.checkpoints.values_list("step", flat=True)) == [10, 20, 30]
    steps = sorted(job.metrics.values_list("step", flat=True))
    assert steps[0] == 1 and steps[-1] == STEPS, "the loss curve, read from rank 0's log"
    losses = dict(job.metrics.values_list("step", "loss"))
    assert losses[STEPS] < losses[1] / 100, "it learned"
