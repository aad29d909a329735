"""A script job end to end on the Kubernetes backend, against the API stand-in and a live portal.

A bundle packed from a folder and stored as an upload is; the job's attempt is an indexed Job whose
pods fetch the bundle in an init container. The stand-in runs no container, so the test plays each
part: the init container's own command (from the pod spec, run here against the live portal's signed
URL), then the script (its pods' logs and exit codes).
"""

import subprocess
import sys

import pytest
from gpuportal import bundle as packing

from runners.bundles import services as bundles
from runners.clusters.registry import get_backend
from runners.jobs import reconcile
from runners.jobs import services as jobs
from runners.jobs.models import Job
from runners.workloads.progress import CHECKPOINT_TAG, METRIC_TAG, tagged_line
from tests.support.jobs import (
    admit_and_launch,
    demo_cluster_with_flavors,
    give_quota,
    job_data,
    ready_environment,
    reconcile_until,
)
from tests.support.k8s import gpu_node, job_pods
from tests.support.races import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TRAIN = b"import os\nprint('rank', os.environ['RANK'])\n"


@pytest.fixture
def cluster(kubernetes_cluster, settings, tmp_path, live_server):
    settings.PREEMPTION_GRACE_PERIOD_S = 7
    settings.BUNDLE_STORAGE_URL = f"file://{tmp_path / 'bundle-storage'}"
    settings.BUNDLE_STORAGE_OPTIONS = {}
    settings.PORTAL_PUBLIC_URL = live_server.url
    for node in ("gpu-a", "gpu-b"):
        kubernetes_cluster.put(gpu_node(node))
    get_backend().min_sync_interval_s = 0  # every reconcile pass reads the watch
    return kubernetes_cluster


@pytest.fixture
def environment(cluster, tenant, owner):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    return ready_environment(actor=owner, tenant=tenant)


@pytest.fixture
def stored(tenant, owner, tmp_path):
    """A project folder packed as the CLI packs it and stored as an upload is: the bundle row."""
    folder = tmp_path / "project"
    (folder / "pkg").mkdir(parents=True)
    (folder / "train.py").write_bytes(TRAIN)
    (folder / "pkg" / "model.py").write_bytes(b"LAYERS = 2\n")
    archive = tmp_path / "project.tar.gz"
    archive.write_bytes(packing.pack(folder))
    with archive.open("rb") as upload:
        bundle, created = bundles.store(tenant, owner, upload)
    assert created
    return bundle


def _script(environment, bundle, **overrides):
    return job_data(environment, template="script", bundle=bundle.sha256, command=["python", "train.py"],
                    hyperparameters={"lr": 0.01}, replicas=2, topology={"level": "none", "mode": "preferred"},
                    **overrides)


def _launched_pods(cluster, job) -> dict[int, dict]:
    """The attempt's pods by rank, once the Job controller made them and the portal bound them."""
    def bound():
        reconcile.jobs_reconcile_run()
        pods = job_pods(cluster, job, 1)
        return len(pods) == job.replicas and all(pod["spec"].get("nodeName") for pod in pods.values())

    assert wait_until(bound, timeout_s=15)
    return job_pods(cluster, job, 1)


def _play_the_init_container(pod: dict, dest) -> subprocess.CompletedProcess:
    """Run the pod's init container command here, as its image would: python is this interpreter, and the
    code volume is `dest`."""
    fetch, _uploader = pod["spec"]["initContainers"]  # the checkpoint uploader is the native sidecar after it
    command = list(fetch["command"])
    assert command[:3] == ["python", "-m", "gpuportal.fetch"]
    command[0], command[4] = sys.executable, str(dest)
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_a_script_job_runs_as_an_indexed_job_whose_pods_fetch_the_bundle_and_it_ends_succeeded(
    cluster, environment, stored, owner, tmp_path
):
    job = jobs.job_submit(actor=owner, data=_script(environment, stored))
    admit_and_launch(job)
    made = cluster.get("jobs", f"job-{job.id}-1", environment.namespace)
    assert (made["spec"]["completionMode"], made["spec"]["completions"]) == ("Indexed", 2)
    pods = _launched_pods(cluster, job)
    assert sorted(pods) == [0, 1]
    for pod in pods.values():
        main = pod["spec"]["containers"][0]
        assert (main["command"], main["workingDir"]) == (["python", "train.py"], "/code")
        assert {"name": "code", "mountPath": "/code", "readOnly": True} in main["volumeMounts"]

    # Each pod's init container fetches the bundle from the portal with the URL signed for the attempt.
    for rank, pod in pods.items():
        code = tmp_path / f"code-{rank}"
        fetched = _play_the_init_container(pod, code)
        assert fetched.returncode == 0, fetched.stderr
        assert (code / "train.py").read_bytes() == TRAIN and (code / "pkg" / "model.py").read_bytes() == b"LAYERS = 2\n"

    # The script runs, reports through the SDK's tagged lines, and both ranks exit 0: done.
    metric = tagged_line(METRIC_TAG, {"step": 5, "loss": 1.5, "attempt": 1})
    checkpoint = tagged_line(CHECKPOINT_TAG, {"step": 5, "path": "checkpoints/step-00000005.pt", "bytes": 10,
                                              "attempt": 1})
    cluster.write_log(environment.namespace, pods[0]["metadata"]["name"], f"rank 0\n{metric}\n{checkpoint}\n")
    for pod in pods.values():
        cluster.finish_pod(environment.namespace, pod["metadata"]["name"], 0)
    job = reconcile_until(job, {"succeeded"}, timeout_s=15, pause_s=0.05)
    assert job.attempts.get().outcome == "succeeded"
    assert list(job.checkpoints.values_list("step", flat=True)) == [5]
    assert list(job.metrics.values_list("step", flat=True)) == [5]


def test_the_fetch_refuses_a_tampered_url_and_the_init_container_fails_saying_so(
    cluster, environment, stored, owner, tmp_path
):
    job = jobs.job_submit(actor=owner, data=_script(environment, stored))
    admit_and_launch(job)
    pod = _launched_pods(cluster, job)[0]
    pod["spec"]["initContainers"][0]["command"][3] += "x"  # one character of the signature changed
    fetched = _play_the_init_container(pod, tmp_path / "code")
    assert fetched.returncode == 1 and "HTTP Error 404" in fetched.stderr
    assert not (tmp_path / "code" / "train.py").exists()


def test_pods_of_a_script_drained_from_outside_that_stopped_on_the_sdks_stop_are_requeued_not_done(
    cluster, environment, stored, owner
):
    job = jobs.job_submit(actor=owner, data=_script(environment, stored))
    admit_and_launch(job)
    pods = _launched_pods(cluster, job)
    checkpoint = tagged_line(CHECKPOINT_TAG, {"step": 8, "path": "checkpoints/step-00000008.pt", "bytes": 10,
                                              "attempt": 1})
    stopped = "PORTAL_STOPPED " + '{"attempt": 1, "rank": 0, "reason": "SIGTERM received", "checkpoint_step": 8}'
    cluster.write_log(environment.namespace, pods[0]["metadata"]["name"], f"{checkpoint}\n{stopped}\n")
    for pod in pods.values():
        cluster.finish_pod(environment.namespace, pod["metadata"]["name"], 0)
    job = reconcile_until(job, {"queued", "admitted", "running"}, timeout_s=15, pause_s=0.05)
    first = Job.objects.get(id=job.id).attempts.get(number=1)
    assert (first.outcome, first.exit_code) == ("preempted", 75)
    assert first.stop_recorded_at is not None
