"""The node cache filled by several processes at once: the fcntl lock keeps the bound, and a blob another
process is filling is waited for, not pulled twice."""

import hashlib
import json
import multiprocessing
from pathlib import Path

import pytest

from runners.storage.blobs import BlobStore
from runners.storage.nodecache import BlobWanted, CacheFull, NodeCache
from tests.storage.test_nodecache import _put, _store

pytestmark = pytest.mark.e2e


def _fill_in_process(root: str, store_url: str, blobs: list[tuple[str, int]], holder: str, capacity: int, out: str):
    cache = NodeCache(root, capacity)
    store = BlobStore(store_url, "shards")
    served = []
    for sha, size in blobs:
        try:
            filled = cache.fill(store, BlobWanted(sha, size), holder=holder)
        except CacheFull:
            continue
        served.append([filled.path, sha, hashlib.sha256(Path(filled.path).read_bytes()).hexdigest()])
        assert cache.stats().bytes_held <= capacity
    cache.release(holder)
    Path(out).write_text(json.dumps(served))


def test_several_processes_filling_at_once_keep_the_bound_and_pull_each_blob_once(tmp_path):
    store = _store(tmp_path)
    blobs = [_put(store, 5000 + seed, seed) for seed in range(12)]
    shared = [(blob.sha256, blob.bytes) for blob in blobs]
    capacity = sum(blob.bytes for blob in blobs)  # all fit: each is pulled by one process only
    context = multiprocessing.get_context("fork")
    workers = [
        context.Process(target=_fill_in_process, args=(
            str(tmp_path / "cache"), store.url, shared[index:] + shared[:index], f"p{index}", capacity,
            str(tmp_path / f"out-{index}.json")))
        for index in range(4)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    for index in range(4):
        for _path, sha, found in json.loads((tmp_path / f"out-{index}.json").read_text()):
            assert found == sha
    stats = NodeCache(tmp_path / "cache", capacity).stats()
    assert stats.misses == len(blobs) and stats.bytes_pulled == capacity
    assert stats.hits == 3 * len(blobs)


def test_several_processes_over_a_small_cache_never_pass_its_bound(tmp_path):
    store = _store(tmp_path)
    blobs = [(blob.sha256, blob.bytes) for blob in (_put(store, 3000, seed) for seed in range(10))]
    capacity = 10_000
    context = multiprocessing.get_context("fork")
    workers = [
        context.Process(target=_fill_in_process, args=(
            str(tmp_path / "cache"), store.url, blobs[index::2] + blobs[: index], f"p{index}", capacity,
            str(tmp_path / f"out-{index}.json")))
        for index in range(4)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    cache = NodeCache(tmp_path / "cache", capacity)
    assert cache.stats().bytes_held <= capacity
    assert cache.holders() == set()
    for _path, sha, found in (row for index in range(4)
                              for row in json.loads((tmp_path / f"out-{index}.json").read_text())):
        assert found == sha
