"""Chunking an open file in one read, a window at a time (what the checkpoint store's agent does with a job
folder's checkpoint): the same chunks as the whole file's, and a file truncated meanwhile is an error to retry,
never a crash."""

import os
import random
import zipfile

import pytest

from runners.storage import chunks
from runners.storage.blobs import BlobStore

pytestmark = pytest.mark.unit

MIB = 1 << 20


def _zip(path, sizes, seed):
    rng = random.Random(seed)
    with zipfile.ZipFile(path, "w") as archive:
        for number, size in enumerate(sizes):
            archive.writestr(f"archive/data/{number}", rng.randbytes(size))


@pytest.mark.parametrize("make", ["empty", "small", "plain", "zip"])
def test_the_windowed_read_cuts_what_the_whole_file_cuts(tmp_path, make):
    path = tmp_path / "checkpoint.pt"
    if make == "zip":
        _zip(path, [100, 300_000, 9 * MIB, 20 * MIB, 40, 3 * MIB], seed=1)
    else:
        path.write_bytes({"empty": b"", "small": os.urandom(1000), "plain": os.urandom(40 * MIB)}[make])
    with open(path, "rb") as handle:
        windowed = chunks.split_open(handle, window_bytes=2 * chunks.MAX_CHUNK_BYTES)
    assert windowed == chunks.split(path)


def test_storing_an_open_file_writes_each_new_chunk_once_under_its_hash(tmp_path):
    path = tmp_path / "checkpoint.pt"
    _zip(path, [6 * MIB, 2 * MIB], seed=2)
    store = BlobStore(f"file://{tmp_path}/store", chunks.KIND)
    with open(path, "rb") as handle:
        manifest, written = chunks.store_open(store, handle)
    assert manifest == chunks.split(path) and written == chunks.distinct_bytes([manifest])
    with open(path, "rb") as handle:
        assert chunks.store_open(store, handle) == (manifest, 0)
    chunks.restore(store, manifest, tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == path.read_bytes()


def test_a_file_truncated_while_it_is_read_is_an_error_to_retry(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(os.urandom(40 * MIB))

    def truncate(_piece, _sha256):
        os.truncate(path, MIB)

    with open(path, "rb") as handle, pytest.raises(chunks.ChangedWhileRead):
        chunks.split_open(handle, truncate, window_bytes=2 * chunks.MAX_CHUNK_BYTES)
