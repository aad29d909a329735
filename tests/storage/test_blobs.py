"""The content-addressed blob store (runners.storage.blobs) in a folder: stored once, whole or absent, checked."""

import hashlib

import pytest

from runners.storage.blobs import BlobMissing, BlobStore, HashMismatch

pytestmark = pytest.mark.unit


@pytest.fixture
def blobs(tmp_path):
    return BlobStore(f"file://{tmp_path / 'store'}", "shards")


def test_the_same_bytes_are_stored_once_under_their_hash(blobs, tmp_path):
    sha, size = blobs.put_bytes(b"a shard")
    assert sha == hashlib.sha256(b"a shard").hexdigest() and size == 7
    source = tmp_path / "copy"
    source.write_bytes(b"a shard")
    assert blobs.put_file(source) == (sha, 7)
    assert list(blobs.keys()) == [sha]
    assert blobs.path(sha).endswith(f"/shards/{sha[:2]}/{sha}")
    assert blobs.read(sha) == b"a shard" and blobs.size(sha) == 7


def test_a_file_that_is_not_the_hash_it_is_given_is_refused_and_nothing_stored(blobs, tmp_path):
    source = tmp_path / "f"
    source.write_bytes(b"real bytes")
    with pytest.raises(HashMismatch):
        blobs.put_file(source, sha256="0" * 64)
    assert list(blobs.keys()) == []


def test_a_fetch_of_bytes_that_changed_in_the_store_leaves_nothing_and_says_so(blobs, tmp_path):
    sha, _ = blobs.put_bytes(b"original")
    with open(blobs.path(sha), "wb") as stored:  # the store's bytes rot
        stored.write(b"rotten!!")
    destination = tmp_path / "out" / "blob"
    with pytest.raises(HashMismatch):
        blobs.fetch(sha, destination)
    assert not destination.exists() and list(destination.parent.iterdir()) == []
    with pytest.raises(HashMismatch):
        blobs.read(sha)


def test_a_missing_blob_and_a_malformed_key_are_told_apart(blobs, tmp_path):
    with pytest.raises(BlobMissing):
        blobs.fetch("a" * 64, tmp_path / "x")
    with pytest.raises(BlobMissing):
        blobs.size("a" * 64)
    with pytest.raises(ValueError):
        blobs.path("../../etc/passwd")
    blobs.delete("a" * 64)  # deleting what is not there is fine


def test_kinds_are_kept_apart(tmp_path):
    shards = BlobStore(f"file://{tmp_path}", "shards")
    models = BlobStore(f"file://{tmp_path}", "models")
    sha, _ = shards.put_bytes(b"x")
    assert shards.exists(sha) and not models.exists(sha)
    shards.delete(sha)
    assert not shards.exists(sha)
