"""The node cache (runners.storage.nodecache): the size bound, pins, LRU order, checked fills, several processes."""

import hashlib
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runners.storage.blobs import BlobStore, HashMismatch
from runners.storage.nodecache import BlobWanted, CacheFull, NodeCache

pytestmark = pytest.mark.unit


def _store(tmp_path: Path) -> BlobStore:
    return BlobStore(f"file://{tmp_path / 'store'}", "shards")


def _put(store: BlobStore, size: int, seed: int) -> BlobWanted:
    data = hashlib.sha256(f"{seed}".encode()).digest() * (size // 32 + 1)
    sha, stored = store.put_bytes(data[:size])
    return BlobWanted(sha, stored)


def _hash(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_a_second_fill_is_a_hit_that_pulls_nothing(tmp_path):
    store = _store(tmp_path)
    blob = _put(store, 1000, 1)
    cache = NodeCache(tmp_path / "cache", 10_000)
    first = cache.fill(store, blob, holder="a")
    second = cache.fill(store, blob, holder="b")
    assert (first.hit, first.pulled_bytes) == (False, 1000)
    assert (second.hit, second.pulled_bytes) == (True, 0)
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.bytes_pulled, stats.bytes_held) == (1, 1, 1000, 1000)
    assert _hash(second.path) == blob.sha256
    assert os.stat(second.path).st_mode & 0o777 == 0o444


def test_it_evicts_the_least_recently_used_unpinned_blob(tmp_path):
    store = _store(tmp_path)
    old, used, new = (_put(store, 400, seed) for seed in range(3))
    cache = NodeCache(tmp_path / "cache", 1000)
    cache.fill(store, old, holder="job-1")
    cache.fill(store, used, holder="job-1")
    cache.release("job-1")
    cache.fill(store, old, holder="job-2")  # old is now the more recently used of the two
    cache.release("job-2")
    cache.fill(store, new, holder="job-3")
    held = {entry.sha256 for entry in cache.snapshot().entries}
    assert held == {old.sha256, new.sha256}
    assert not cache.blob_path(used.sha256).exists()
    assert cache.stats().evictions == 1


def test_a_pinned_blob_is_never_evicted_and_a_full_cache_says_why(tmp_path):
    store = _store(tmp_path)
    first, second = _put(store, 600, 1), _put(store, 600, 2)
    cache = NodeCache(tmp_path / "cache", 1000)
    cache.fill(store, first, holder="job-1")
    with pytest.raises(CacheFull, match="pinned"):
        cache.fill(store, second, holder="job-2")
    assert cache.blob_path(first.sha256).is_file()
    assert cache.stats().bytes_held == 600  # the refused fill reserved nothing
    cache.release("job-1")
    cache.fill(store, second, holder="job-2")
    assert not cache.blob_path(first.sha256).exists()


def test_a_blob_whose_bytes_are_not_its_key_is_never_served(tmp_path):
    store = _store(tmp_path)
    blob = _put(store, 500, 1)
    Path(store.path(blob.sha256)).write_bytes(b"x" * 500)  # the store's copy corrupted
    cache = NodeCache(tmp_path / "cache", 10_000)
    with pytest.raises(HashMismatch):
        cache.fill(store, blob, holder="job-1")
    assert not cache.blob_path(blob.sha256).exists()
    assert cache.snapshot().entries == ()
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []


def test_a_view_links_only_the_holders_blobs_and_goes_with_its_release(tmp_path):
    store = _store(tmp_path)
    mine, theirs = _put(store, 100, 1), _put(store, 100, 2)
    cache = NodeCache(tmp_path / "cache", 10_000)
    cache.fill_view(store, [theirs], holder="job-2")
    filled = cache.fill_view(store, [mine], holder="job-1")
    view = cache.view_dir("job-1")
    assert sorted(os.listdir(view)) == [mine.sha256]
    assert filled[0].path == str(view / mine.sha256) and _hash(filled[0].path) == mine.sha256
    assert cache.release("job-1") == 1
    assert not view.exists() and cache.blob_path(mine.sha256).is_file()


def test_it_refuses_a_holder_that_is_not_a_plain_name(tmp_path):
    cache = NodeCache(tmp_path / "cache", 100)
    with pytest.raises(ValueError, match="holder"):
        cache.release("../../etc")


class CacheMachine(RuleBasedStateMachine):
    """Random fills, re-fills and releases by a few holders over blobs of random sizes: the bound, the
    pins and the content hold after every step."""

    def __init__(self):
        super().__init__()
        import tempfile

        self.folder = Path(tempfile.mkdtemp(prefix="nodecache-"))
        self.store = _store(self.folder)
        self.capacity = 3000
        self.cache = NodeCache(self.folder / "cache", self.capacity)
        self.blobs: list[BlobWanted] = []
        self.pinned: dict[str, set[str]] = {}

    @rule(size=st.integers(min_value=1, max_value=1500), seed=st.integers(0, 10**6))
    def add_blob(self, size, seed):
        self.blobs.append(_put(self.store, size, seed))

    @precondition(lambda self: self.blobs)
    @rule(index=st.integers(0, 100), holder=st.sampled_from(["job-1", "job-2", "job-3"]))
    def fill(self, index, holder):
        blob = self.blobs[index % len(self.blobs)]
        pinned_bytes = sum(
            b.bytes for b in self.blobs if any(b.sha256 in shas for shas in self.pinned.values())
        )
        already = any(blob.sha256 in shas for shas in self.pinned.values())
        try:
            filled = self.cache.fill(self.store, blob, holder=holder)
        except CacheFull:
            # Refused only when the pinned blobs leave no room for it.
            assert not already and pinned_bytes + blob.bytes > self.capacity
            return
        assert _hash(filled.path) == blob.sha256
        self.pinned.setdefault(holder, set()).add(blob.sha256)

    @rule(holder=st.sampled_from(["job-1", "job-2", "job-3"]))
    def release(self, holder):
        self.cache.release(holder)
        self.pinned.pop(holder, None)

    @invariant()
    def the_bound_the_pins_and_the_bytes_hold(self):
        snapshot = self.cache.snapshot()
        assert snapshot.stats.bytes_held <= self.capacity
        held = {entry.sha256 for entry in snapshot.entries}
        for shas in self.pinned.values():
            assert shas <= held
        for entry in snapshot.entries:
            assert _hash(str(self.cache.blob_path(entry.sha256))) == entry.sha256
        on_disk = {path.name for path in (self.folder / "cache" / "blobs").glob("*/*")}
        assert on_disk == held

    def teardown(self):
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
