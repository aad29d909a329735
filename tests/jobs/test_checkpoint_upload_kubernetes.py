"""A Kubernetes job's checkpoints reach the store through its pods' uploader: the pod spec from the API stand-in,
the uploader's own command (run here, as its image would) against a live portal over HTTP.

The stand-in runs no container, so the test plays each part: the trainer (a checkpoint file in the job folder
on the "volume", a folder here, and its record in the pod's log) and the sidecar (its command and variables
from the pod spec).
"""

import os
import subprocess
import sys
import zipfile

import pytest

from runners.clusters.registry import get_backend
from runners.jobs import reconcile
from runners.jobs import services as jobs
from runners.jobs.models import Checkpoint
from runners.storage import chunks
from runners.storage.blobs import BlobStore
from runners.workloads.progress import CHECKPOINT_TAG, tagged_line
from tests.support.jobs import admit_and_launch, demo_cluster_with_flavors, give_quota, job_data, ready_environment
from tests.support.k8s import gpu_node, job_pods
from tests.support.races import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def cluster(kubernetes_cluster, settings, tmp_path, live_server):
    settings.DATA_STORAGE_URL = f"file://{tmp_path}/store"
    settings.DATA_STORAGE_OPTIONS = {}
    settings.PORTAL_PUBLIC_URL = live_server.url
    kubernetes_cluster.put(gpu_node("gpu-a"))
    get_backend().min_sync_interval_s = 0
    return kubernetes_cluster


def _checkpoint(path, *members: bytes) -> None:
    """A file as torch.save writes one: a zip of uncompressed members."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        for number, member in enumerate(members):
            archive.writestr(f"archive/data/{number}", member)


def _run_uploader(pod: dict, job_dir) -> subprocess.CompletedProcess:
    """The sidecar's command with its pod's variables (RANK from the completion index), here, for one pass."""
    (uploader,) = pod["spec"]["initContainers"]
    command = list(uploader["command"])
    assert command[:3] == ["python", "-m", "runners.workloads.checkpoint_uploader"]
    command[0] = sys.executable
    command[command.index("--job-dir") + 1] = str(job_dir)
    env = {item["name"]: item["value"] for item in uploader["env"] if "value" in item}
    env["RANK"] = pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"]
    return subprocess.run([*command, "--once"], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120, check=False)


def test_the_pods_uploader_stores_a_checkpoint_through_the_portal_and_only_the_chunks_the_store_lacks(
    cluster, tenant, owner, tmp_path
):
    give_quota(tenant, demo_cluster_with_flavors()["h100-80gb"], guaranteed=2, max=2)
    environment = ready_environment(actor=owner, tenant=tenant)
    job = jobs.job_submit(actor=owner, data=job_data(environment, name="tiny", replicas=1, topology={"level": "none"}))
    admit_and_launch(job)

    def bound():
        reconcile.jobs_reconcile_run()
        pods = job_pods(cluster, job, 1)
        return len(pods) == 1 and pods[0]["spec"].get("nodeName")

    assert wait_until(bound, timeout_s=15)
    pod = job_pods(cluster, job, 1)[0]  # admitted by the stand-in under Pod Security "restricted"
    job_dir = tmp_path / "volume" / f"job-{job.id}"
    base = os.urandom(3 << 20)
    for step in (10, 20):
        path = job_dir / "checkpoints" / f"step-{step:08d}.pt"
        _checkpoint(path, *((base, os.urandom(400_000)) if step == 20 else (base,)))
        record = {"step": step, "path": f"checkpoints/{path.name}", "bytes": path.stat().st_size,
                  "created_at": "2026-12-05T10:00:00+00:00"}
        cluster.write_log(environment.namespace, pod["metadata"]["name"], tagged_line(CHECKPOINT_TAG, record) + "\n")
    # Not recorded yet: the portal answers 409 and the uploader leaves it for its next pass.
    early = _run_uploader(pod, job_dir)
    assert early.returncode == 0, early.stderr
    assert not Checkpoint.objects.filter(job=job, store_state="durable").exists()

    reconcile.jobs_reconcile_run()
    assert sorted(Checkpoint.objects.filter(job=job).values_list("step", flat=True)) == [10, 20]
    done = _run_uploader(pod, job_dir)
    assert done.returncode == 0, done.stderr
    assert "checkpoint of step 10: durable" in done.stdout and "checkpoint of step 20: durable" in done.stdout
    store = BlobStore(f"file://{tmp_path}/store", chunks.KIND)
    for checkpoint in Checkpoint.objects.filter(job=job):
        assert checkpoint.store_state == "durable"
        path = job_dir / checkpoint.uri
        assert checkpoint.manifest == chunks.split(path).to_json()
        restored = tmp_path / f"restored-{checkpoint.step}"
        chunks.restore(store, chunks.Manifest.from_json(checkpoint.manifest), restored)
        assert restored.read_bytes() == path.read_bytes()
    # The second checkpoint shares the base's chunks: the store holds them once.
    first, second = (chunks.Manifest.from_json(c.manifest) for c in Checkpoint.objects.filter(job=job).order_by("step"))
    assert chunks.distinct_bytes([first, second]) < second.bytes + 1000
    assert Checkpoint.objects.get(job=job, step=20).stored_bytes < 500_000
