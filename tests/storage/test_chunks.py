"""Checkpoints as content-defined chunks: a frozen base dedupes, a restore is checked and atomic."""

import os
import random

import pytest
import torch

from runners.storage import chunks
from runners.storage.blobs import BlobMissing, BlobStore, HashMismatch

pytestmark = pytest.mark.unit


@pytest.fixture
def store(tmp_path):
    return BlobStore(f"file://{tmp_path}/store", chunks.KIND)


def fine_tune_checkpoints(folder, count, *, layers=8, width=1024, rank=2):
    """``count`` torch.save'd state dicts of a LoRA fine-tune: a frozen base, adapters and their Adam
    moments changing at every step, each file named by its step as the SDK names them. With the defaults the
    adapters and their moments are 1.2% of the base (a LoRA of rank 2 on 1024-wide layers)."""
    generator = torch.Generator().manual_seed(7)
    base = {f"layers.{i}.weight": torch.randn(width, width, generator=generator) for i in range(layers)}
    adapters = {f"layers.{i}.lora_{side}": torch.zeros(width, rank) for i in range(layers) for side in "AB"}
    paths = []
    for step in range(count):
        for tensor in adapters.values():
            tensor.add_(torch.randn(tensor.shape, generator=generator))
        state = {"model": {**base, **adapters}, "step": step,
                 "optimizer": {name: {"exp_avg": tensor * 0.1, "exp_avg_sq": tensor * tensor}
                               for name, tensor in adapters.items()}}
        path = folder / f"step-{step * 10}.pt"
        torch.save(state, path)
        paths.append(path)
    return base, paths


def test_a_frozen_base_under_a_fine_tune_is_stored_once(tmp_path, store):
    base, paths = fine_tune_checkpoints(tmp_path, 10)
    written = [chunks.store_file(store, path)[1] for path in paths]
    one = paths[0].stat().st_size
    base_bytes = sum(tensor.numel() * 4 for tensor in base.values())
    # Every later checkpoint writes only what changed: far less than the frozen base.
    assert max(written[1:]) < base_bytes / 10, written
    assert sum(written) < 1.2 * one, (sum(written), one)


def test_an_unchanged_state_dict_saved_under_another_name_gives_the_same_data_chunks(tmp_path):
    state = {"weight": torch.randn(1024, 512), "bias": torch.randn(512)}
    torch.save(state, tmp_path / "step-10.pt")
    torch.save(state, tmp_path / "step-2000.pt")
    first, second = chunks.split(tmp_path / "step-10.pt"), chunks.split(tmp_path / "step-2000.pt")
    big_first = {chunk.sha256 for chunk in first.chunks if chunk.bytes >= chunks.MIN_CHUNK_BYTES}
    big_second = {chunk.sha256 for chunk in second.chunks if chunk.bytes >= chunks.MIN_CHUNK_BYTES}
    assert big_first and big_first == big_second
    assert first.sha256 != second.sha256  # the archive's member names hold the file's name


def test_a_split_is_deterministic_and_covers_the_file(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(5 * chunks.AVERAGE_CHUNK_BYTES + 123))
    manifest = chunks.split(path)
    assert manifest == chunks.split(path)
    assert sum(chunk.bytes for chunk in manifest.chunks) == manifest.bytes == path.stat().st_size
    assert all(chunk.bytes <= chunks.MAX_CHUNK_BYTES for chunk in manifest.chunks)


def test_restore_joins_the_chunks_back_into_the_same_bytes(tmp_path, store):
    _, paths = fine_tune_checkpoints(tmp_path, 2)
    manifest, _ = chunks.store_file(store, paths[1])
    assert chunks.restore(store, manifest, tmp_path / "restored.pt") == manifest.bytes
    assert (tmp_path / "restored.pt").read_bytes() == paths[1].read_bytes()
    assert torch.load(tmp_path / "restored.pt")["step"] == 1


def test_a_tampered_chunk_is_refused_and_nothing_is_left_at_the_destination(tmp_path, store):
    path = tmp_path / "data.bin"
    # Seeded: random bytes from os.urandom were now and then one chunk (a cut point lands anywhere up to
    # MAX_CHUNK_BYTES), and the test needs a second one to damage.
    path.write_bytes(random.Random(1).randbytes(3 * chunks.AVERAGE_CHUNK_BYTES))
    manifest, _ = chunks.store_file(store, path)
    assert len(manifest.chunks) >= 2
    victim = store.path(manifest.chunks[1].sha256)
    with open(victim, "r+b") as handle:
        handle.write(b"X")
    destination = tmp_path / "out" / "restored.bin"
    with pytest.raises(HashMismatch):
        chunks.restore(store, manifest, destination)
    assert not destination.exists() and list(destination.parent.iterdir()) == []


def test_a_missing_chunk_is_named_and_the_restore_fails(tmp_path, store):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(3 * chunks.AVERAGE_CHUNK_BYTES))
    manifest, _ = chunks.store_file(store, path)
    store.delete(manifest.chunks[0].sha256)
    assert chunks.missing(store, manifest) == [manifest.chunks[0].sha256]
    with pytest.raises(BlobMissing):
        chunks.restore(store, manifest, tmp_path / "restored.bin")
    assert chunks.store_chunks(store, path, manifest) == manifest.chunks[0].bytes
    assert chunks.missing(store, manifest) == []


def test_an_empty_file_is_a_manifest_of_no_chunks(tmp_path, store):
    (tmp_path / "empty").write_bytes(b"")
    manifest, written = chunks.store_file(store, tmp_path / "empty")
    assert (manifest.chunks, manifest.bytes, written) == ((), 0, 0)
    chunks.restore(store, manifest, tmp_path / "restored")
    assert (tmp_path / "restored").read_bytes() == b""


def test_a_manifest_round_trips_and_a_malformed_one_is_refused(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(2 * chunks.AVERAGE_CHUNK_BYTES))
    manifest = chunks.split(path)
    assert chunks.Manifest.from_json(manifest.to_json()) == manifest
    broken = manifest.to_json()
    broken["bytes"] += 1
    with pytest.raises(ValueError, match="add up"):
        chunks.Manifest.from_json(broken)
    with pytest.raises(ValueError):
        chunks.Manifest.from_json({"version": 1, "sha256": "x", "bytes": 0, "chunks": []})


def test_collect_deletes_only_the_chunks_no_manifest_names(tmp_path, store):
    _, paths = fine_tune_checkpoints(tmp_path, 3)
    manifests = [chunks.store_file(store, path)[0] for path in paths]
    kept = manifests[1:]
    referenced = {chunk.sha256 for manifest in kept for chunk in manifest.chunks}
    count, freed = chunks.collect(store, referenced)
    assert count > 0 and freed > 0
    assert set(store.keys()) == referenced
    assert freed + chunks.distinct_bytes(kept) == chunks.distinct_bytes(manifests)
    for manifest in kept:
        assert chunks.missing(store, manifest) == []
