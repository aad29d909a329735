"""A job's checkpoints as files: the download (a file, or a folder as a .tar.gz), its 404s, and a script's
checkpoints whose files the SDK deleted marked deleted (so storage stops being charged for them).

The checkpoints are written by the SDK's own `write_checkpoint` into the local backend's job folder and
recorded by the portal's progress read, as a running script's are.
"""

import io
import os
import tarfile

import pytest
from django.utils import timezone
from gpuportal import write_checkpoint

from runners.bundles.models import Bundle
from runners.clusters.registry import get_backend
from runners.jobs import attempts
from runners.jobs import services as jobs
from runners.jobs.models import Checkpoint, Job
from runners.scheduling import services as scheduling
from tests.support.jobs import give_quota, job_data, play_launch, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

SHA = "ab" * 32


@pytest.fixture
def environment(flavors, tenant, owner):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8, max_priority=50)
    return ready_environment(actor=owner, tenant=tenant)


@pytest.fixture
def running(owner, tenant, environment):
    """A script job whose first attempt runs: (the job, its attempt, its folder on the local backend)."""
    Bundle.objects.create(tenant=tenant, sha256=SHA, size_bytes=2048, unpacked_bytes=8192, files=3)
    job = jobs.job_submit(actor=owner, data=job_data(environment, name="sweep", template="script", bundle=SHA,
                                                     command=["python", "train.py"], hyperparameters={}))
    scheduling.cycle_run()
    attempt = play_launch(job)
    return Job.objects.get(id=job.id), attempt, get_backend().jobs.job_dir(job.id)


def _saved(job_dir, step, content: bytes, tmp_path, *, keep=3):
    """A checkpoint file written as a script's SDK writes it (moved into checkpoints/, recorded, older ones pruned)."""
    source = tmp_path / f"model-{step}.pt"
    source.write_bytes(content)
    return write_checkpoint(job_dir, step, source, attempt=1, keep=keep)


def _recorded(job, attempt, *, drain=False):
    attempts.progress_record(Job.objects.get(id=job.id), attempt, get_backend(), drain=drain)


def _download(client, job, step):
    return client.get(f"/api/v1/jobs/{job.id}/checkpoints/{step}/download/")


def test_a_viewer_downloads_a_checkpoint_file_with_its_length_and_a_plain_file_name(
    running, client_for, viewer, tmp_path
):
    job, attempt, job_dir = running
    content = os.urandom(300_000)
    _saved(job_dir, 10, content, tmp_path)
    _recorded(job, attempt)
    response = _download(client_for(viewer), job, 10)
    assert response.status_code == 200
    assert b"".join(response.streaming_content) == content
    assert response["Content-Length"] == str(len(content))
    assert response["Content-Disposition"] == f'attachment; filename="sweep-{job.id}-step-10.pt"'
    assert Checkpoint.objects.get(job=job, step=10).bytes == len(content)


def test_a_folder_checkpoint_comes_as_a_tar_gz_of_its_files_and_folders_never_a_link_or_fifo(
    running, client_for, owner, tmp_path
):
    job, attempt, job_dir = running
    saved = tmp_path / "save"
    (saved / "shards").mkdir(parents=True)
    (saved / "config.json").write_text('{"layers": 2}')
    (saved / "shards" / "part-0.bin").write_bytes(b"\x01" * 70_000)
    final = write_checkpoint(job_dir, 20, saved, attempt=1)
    secret = tmp_path / "another-tenants-file"
    secret.write_text("not theirs to read")
    # What a script may leave in its own folder: links out of it and a FIFO (a read of it would hang).
    (final / "escape").symlink_to(secret)
    (final / "shards" / "escape-folder").symlink_to(tmp_path)
    os.mkfifo(final / "hang")
    _recorded(job, attempt)

    response = _download(client_for(owner), job, 20)
    assert response.status_code == 200 and response["Content-Type"] == "application/gzip"
    assert response["Content-Disposition"] == f'attachment; filename="sweep-{job.id}-step-20.tar.gz"'
    assert "Content-Length" not in response
    with tarfile.open(fileobj=io.BytesIO(b"".join(response.streaming_content)), mode="r:gz") as archive:
        members = {member.name: member for member in archive.getmembers()}
        top = final.name  # step-00000020: the folder as the SDK named it
        assert sorted(members) == [top, f"{top}/config.json", f"{top}/shards", f"{top}/shards/part-0.bin"]
        assert members[f"{top}/shards"].isdir() and members[f"{top}/config.json"].isfile()
        assert archive.extractfile(f"{top}/config.json").read() == b'{"layers": 2}'
        assert archive.extractfile(f"{top}/shards/part-0.bin").read() == b"\x01" * 70_000


def test_a_step_the_job_has_not_recorded_or_whose_file_went_is_a_404_naming_the_step(
    running, client_for, owner, tmp_path
):
    job, attempt, job_dir = running
    for step in (10, 20):
        _saved(job_dir, step, b"weights %d" % step, tmp_path)
    _recorded(job, attempt)
    client = client_for(owner)
    never = _download(client, job, 7)
    assert never.status_code == 404
    assert never.json() == {"step": [f"Job sweep #{job.id} has no checkpoint of step 7; its checkpoints kept are "
                                     f"steps 10, 20."]}
    assert _download(client, job, 2**40).status_code == 404  # past any step: the same answer, not a 500
    # Its file deleted behind the portal's back, or put in its place as a link to another tenant's file.
    (job_dir / "checkpoints" / "step-00000010.pt").unlink()
    (job_dir / "checkpoints" / "step-00000010.pt").symlink_to(job_dir / "checkpoints" / "step-00000020.pt")
    gone = _download(client, job, 10)
    assert gone.status_code == 404 and "deleted its checkpoint of step 10" in gone.json()["step"][0]


def test_another_tenants_job_is_a_404_whatever_the_step(running, client_for, outsider, tmp_path):
    job, attempt, job_dir = running
    _saved(job_dir, 10, b"weights", tmp_path)
    _recorded(job, attempt)
    response = _download(client_for(outsider), job, 10)
    assert response.status_code == 404 and b"weights" not in response.content
    assert "step" not in response.json()  # nothing about the job's checkpoints either


def test_a_path_out_of_the_job_folder_in_a_record_is_never_read(running, client_for, owner, tmp_path):
    job, attempt, job_dir = running
    other = get_backend().jobs.job_dir(job.id + 1000)
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "step-1.pt").write_bytes(b"another job's weights")
    relative = f"../{other.name}/checkpoints/step-1.pt"
    Checkpoint.objects.create(job=job, step=1, uri=relative, bytes=21, created_at=timezone.now())
    response = _download(client_for(owner), job, 1)
    assert response.status_code == 404 and "step" in response.json()


def test_the_checkpoints_the_sdk_deleted_are_marked_deleted_at_the_newest_checkpoints_time(running, tmp_path):
    job, attempt, job_dir = running
    for step in (10, 20):
        _saved(job_dir, step, b"weights", tmp_path, keep=2)
        _recorded(job, attempt)
    assert not Checkpoint.objects.filter(job=job, deleted_at__isnull=False).exists()
    _saved(job_dir, 30, b"weights", tmp_path, keep=2)  # the SDK deletes step 10's file
    _recorded(job, attempt)
    rows = {row.step: row for row in Checkpoint.objects.filter(job=job)}
    assert rows[10].deleted_at == rows[30].created_at
    assert rows[20].deleted_at is None and rows[30].deleted_at is None


def test_a_file_deleted_after_its_newer_checkpoint_was_read_is_marked_when_the_attempt_ends(running, tmp_path):
    job, attempt, job_dir = running
    for step in (10, 20):
        _saved(job_dir, step, b"weights", tmp_path, keep=0)
        _recorded(job, attempt)
    (job_dir / "checkpoints" / "step-00000010.pt").unlink()  # the script's own clean-up, after the last record
    _recorded(job, attempt)
    assert Checkpoint.objects.get(job=job, step=10).deleted_at is None  # nothing new recorded: not looked at
    _recorded(job, attempt, drain=True)
    assert Checkpoint.objects.get(job=job, step=10).deleted_at is not None
    assert Checkpoint.objects.get(job=job, step=20).deleted_at is None
