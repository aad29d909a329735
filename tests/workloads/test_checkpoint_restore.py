"""The supervisor's restore of a durable checkpoint into the job folder: from the store's chunks, checked, whole or
not at all, only when the folder's copy is not the manifest's, never following a link the script put there."""

import json
import os

import pytest

from runners.storage import chunks
from runners.storage.blobs import BlobStore
from runners.workloads.checkpoint_restore import RESTORE_RECORD, STORAGE_VARIABLE, restore_checkpoint

pytestmark = pytest.mark.unit


@pytest.fixture
def world(tmp_path):
    """A store holding one checkpoint's chunks, a job folder, an attempt folder, the plan and the environment."""
    url = f"file://{tmp_path}/store"
    content = os.urandom(3 << 20)
    source = tmp_path / "source.pt"
    source.write_bytes(content)
    manifest, _written = chunks.store_file(BlobStore(url, chunks.KIND), source)
    job_dir, attempt_dir = tmp_path / "job", tmp_path / "job" / "attempts" / "2"
    attempt_dir.mkdir(parents=True)
    plan = {"step": 40, "path": "checkpoints/step-00000040.pt", "job_dir": str(job_dir),
            "manifest": manifest.to_json(), "why": "check", "owner": None}
    environ = {STORAGE_VARIABLE: json.dumps({"url": url, "options": {}})}
    return content, manifest, job_dir, attempt_dir, plan, environ


def _record(attempt_dir):
    return json.loads((attempt_dir / RESTORE_RECORD).read_text())


@pytest.mark.parametrize("damage", ["missing", "flipped", "folder missing"])
def test_a_missing_or_damaged_copy_is_restored_from_the_store_byte_for_byte(world, damage):
    content, _manifest, job_dir, attempt_dir, plan, environ = world
    target = job_dir / plan["path"]
    if damage != "folder missing":
        target.parent.mkdir(parents=True)
    if damage == "flipped":
        target.write_bytes(bytes([content[0] ^ 1]) + content[1:])
    assert restore_checkpoint(attempt_dir, {"restore": plan}, environ) is None
    assert target.read_bytes() == content
    record = _record(attempt_dir)
    assert record["restored"] and record["bytes"] == len(content)
    assert record["why"] == ("damaged" if damage == "flipped" else "missing")


def test_a_whole_copy_is_left_alone(world):
    content, _manifest, job_dir, attempt_dir, plan, environ = world
    target = job_dir / plan["path"]
    target.parent.mkdir(parents=True)
    target.write_bytes(content)
    before = target.stat().st_ino
    assert restore_checkpoint(attempt_dir, {"restore": plan}, {}) is None  # no store needed
    assert target.stat().st_ino == before and _record(attempt_dir) | {"seconds": 0} == {
        "step": 40, "path": plan["path"], "why": "whole", "restored": False, "bytes": 0, "seconds": 0}


def test_another_nodes_checkpoint_is_restored_even_over_a_copy_in_the_shared_folder(world):
    content, _manifest, job_dir, attempt_dir, plan, environ = world
    target = job_dir / plan["path"]
    target.parent.mkdir(parents=True)
    target.write_bytes(content)
    assert restore_checkpoint(attempt_dir, {"restore": {**plan, "why": "elsewhere"}}, environ) is None
    assert target.read_bytes() == content and _record(attempt_dir)["restored"]


def test_a_link_the_script_put_in_the_path_is_never_followed(world, tmp_path):
    _content, _manifest, job_dir, attempt_dir, plan, environ = world
    elsewhere = tmp_path / "portal-files"
    elsewhere.mkdir()
    job_dir.mkdir(exist_ok=True)
    (job_dir / "checkpoints").symlink_to(elsewhere)
    failure = restore_checkpoint(attempt_dir, {"restore": {**plan, "why": "missing"}}, environ)
    assert failure and "cannot be restored into the job folder" in failure
    assert list(elsewhere.iterdir()) == []


def test_a_chunk_missing_from_the_store_leaves_nothing_and_says_why(world, tmp_path):
    _content, manifest, job_dir, attempt_dir, plan, environ = world
    BlobStore(f"file://{tmp_path}/store", chunks.KIND).delete(manifest.chunks[-1].sha256)
    failure = restore_checkpoint(attempt_dir, {"restore": {**plan, "why": "missing"}}, environ)
    assert failure and "not in the store" in failure
    assert sorted(path.name for path in (job_dir / "checkpoints").iterdir()) == []


def test_without_the_store_in_its_environment_the_supervisor_says_so(world):
    _content, _manifest, _job_dir, attempt_dir, plan, _environ = world
    assert STORAGE_VARIABLE in restore_checkpoint(attempt_dir, {"restore": {**plan, "why": "missing"}}, {})
