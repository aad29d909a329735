"""The sweep of open versions: a push abandoned past its lease is discarded with its upload parts (one touched
since is kept), a registration whose message was lost is sent again and then packed once, at most so many
times before it is failed with the reason, and parts of versions no longer open are removed."""

import io
from datetime import timedelta

import pytest
from django.utils import timezone
from gpuportal import datasets as packing

from runners.datasets import services
from runners.datasets.models import DatasetVersion, VersionState
from runners.datasets.tasks import versions_sweep

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

FILES = {f"{index:03d}.txt": f"sample {index}\n".encode() * 300 for index in range(20)}


@pytest.fixture
def shards(tmp_path):
    root = tmp_path / "files"
    root.mkdir()
    for path, data in FILES.items():
        (root / path).write_bytes(data)
    return packing.pack_folder(root, tmp_path / "packed", max_bytes=20 * 1024)


def _half_pushed(owner, tenant, dataset, shards):
    """An open upload with every shard declared and the first 1000 bytes of the first one received."""
    version, _ = services.version_open(actor=owner, tenant=tenant, dataset=dataset,
                                       manifest_sha256=packing.manifest_sha256((s.sha256, s.bytes) for s in shards))
    services.shards_declare(actor=owner, tenant=tenant, version=version, shards=[
        {"position": i, "sha256": s.sha256, "bytes": s.bytes, "samples": s.samples} for i, s in enumerate(shards)])
    first = shards[0].path.read_bytes()[:1000]
    services.shard_receive(actor=owner, tenant=tenant, version=version, sha256=shards[0].sha256, offset=0,
                           stream=io.BytesIO(first), length=len(first))
    return version


def _age(version, seconds):
    DatasetVersion.objects.filter(id=version.id).update(touched_at=timezone.now() - timedelta(seconds=seconds),
                                                        created_at=timezone.now() - timedelta(seconds=seconds))


def test_an_abandoned_push_is_discarded_with_its_parts_and_a_live_one_kept(owner, tenant, shards, settings, data_store):
    settings.DATASET_UPLOAD_LEASE_S = 3600
    dataset = services.dataset_create(actor=owner, tenant=tenant, name="images")
    abandoned = _half_pushed(owner, tenant, dataset, shards)
    parts = data_store / "uploads" / str(abandoned.id)
    assert parts.is_dir() and any(parts.rglob("*-1000"))
    _age(abandoned, 3601)
    live = _half_pushed(owner, tenant, services.dataset_create(actor=owner, tenant=tenant, name="text"), shards)
    _age(live, 7200)
    services.version_open(actor=owner, tenant=tenant, dataset=live.dataset, manifest_sha256=live.manifest_sha256)

    assert versions_sweep() == {"discarded": 1, "resent": 0, "failed": 0, "orphan_parts": 0}
    assert not DatasetVersion.objects.filter(id=abandoned.id).exists() and not parts.exists()
    assert DatasetVersion.objects.get(id=live.id).state == VersionState.OPEN
    assert (data_store / "uploads" / str(live.id)).is_dir()
    # The same push again opens a new version (its number free again: nobody but the push ever saw it).
    again, created = services.version_open(actor=owner, tenant=tenant, dataset=dataset,
                                           manifest_sha256=abandoned.manifest_sha256)
    assert created and again.id != abandoned.id and again.state == VersionState.OPEN


def test_parts_of_a_version_no_longer_open_are_removed(owner, tenant, shards, data_store):
    dataset = services.dataset_create(actor=owner, tenant=tenant, name="images")
    version = _half_pushed(owner, tenant, dataset, shards)
    DatasetVersion.objects.filter(id=version.id).delete()  # a discard cut between its row and its files
    stray = data_store / "uploads" / str(version.id)
    assert stray.is_dir()
    assert versions_sweep()["orphan_parts"] == 1 and not stray.exists()
    assert versions_sweep()["orphan_parts"] == 0


def test_a_lost_registration_is_sent_again_packed_once_and_failed_after_the_last_send(
        owner, tenant, settings, tmp_path, django_capture_on_commit_callbacks):
    settings.DATASET_SOURCE_URLS = [f"file://{tmp_path}/incoming/{{tenant}}/"]
    settings.DATASET_REGISTER_SHARD_BYTES = 20 * 1024
    settings.DATASET_REGISTER_LEASE_S = 600
    settings.DATASET_REGISTER_MAX_SENDS = 2
    source = tmp_path / "incoming" / "acme" / "set"
    source.mkdir(parents=True)
    for path, data in FILES.items():
        (source / path).write_bytes(data)
    dataset = services.dataset_create(actor=owner, tenant=tenant, name="reg")
    with django_capture_on_commit_callbacks(execute=False) as lost:
        version = services.version_register(actor=owner, tenant=tenant, dataset=dataset, url=f"file://{source}")
    assert len(lost) == 1 and version.register_sends == 1

    _age(version, 599)
    with django_capture_on_commit_callbacks(execute=False) as sent:
        assert versions_sweep()["resent"] == 0  # within its lease: a worker may be packing it
    assert sent == []
    _age(version, 601)
    with django_capture_on_commit_callbacks(execute=False) as sent:
        assert versions_sweep() == {"discarded": 0, "resent": 1, "failed": 0, "orphan_parts": 0}
    assert len(sent) == 1
    assert DatasetVersion.objects.get(id=version.id).register_sends == 2
    # The message sent again runs; the first one, had it come back after all, finds it sealed and does nothing.
    assert services.version_register_run(version.id) == VersionState.SEALED
    assert services.version_register_run(version.id) == VersionState.SEALED
    assert DatasetVersion.objects.get(id=version.id).files == len(FILES)

    # A registration that never finishes is failed once it was sent DATASET_REGISTER_MAX_SENDS times.
    with django_capture_on_commit_callbacks(execute=False):
        stuck = services.version_register(actor=owner, tenant=tenant, dataset=dataset, url=f"file://{source}")
    for _ in range(2):
        _age(stuck, 601)
        with django_capture_on_commit_callbacks(execute=False):
            versions_sweep()
    stuck.refresh_from_db()
    assert stuck.state == VersionState.FAILED and stuck.register_sends == 2
    assert "sent to a worker 2 times" in stuck.reason
