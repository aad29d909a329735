"""Packing a folder into WebDataset shards (gpuportal.datasets) and reading them back: deterministic, bounded,
whole samples, and a shard whose bytes are not its hash never used."""

import os
import tarfile

import pytest
from gpuportal import datasets as packing

pytestmark = pytest.mark.unit


def _folder(root, files: dict[str, bytes]):
    for path, data in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return root


FILES = {f"train/{index:04d}.{ext}": bytes([index % 251]) * (700 + index) for index in range(40) for ext in ("jpg", "cls")}


def test_the_same_files_make_the_same_shards_whoever_packs_them_and_whenever(tmp_path):
    first = packing.pack_folder(_folder(tmp_path / "a", FILES), tmp_path / "out-a", max_bytes=20 * 1024)
    # Written in another order, with other times and modes: the same shards, byte for byte.
    second_root = tmp_path / "b"
    for path in reversed(list(FILES)):
        _folder(second_root, {path: FILES[path]})
        os.utime(second_root / path, (1, 1))
        os.chmod(second_root / path, 0o600)
    second = packing.pack_folder(second_root, tmp_path / "out-b", max_bytes=20 * 1024)
    assert [(s.sha256, s.bytes) for s in first] == [(s.sha256, s.bytes) for s in second]
    assert len(first) > 1
    assert packing.manifest_sha256((s.sha256, s.bytes) for s in first) == \
        packing.manifest_sha256((s.sha256, s.bytes) for s in second)


def test_shards_are_bounded_hold_whole_samples_and_are_plain_tars(tmp_path):
    shards = packing.pack_folder(_folder(tmp_path / "a", FILES), tmp_path / "out", max_bytes=20 * 1024)
    seen = []
    for shard in shards:
        assert shard.bytes == shard.path.stat().st_size <= 20 * 1024
        with tarfile.open(shard.path) as tar:  # any tar reader reads it
            names = tar.getnames()
            assert all(info.mtime == 0 and info.uid == 0 and info.uname == "" for info in tar)
        keys = [packing.sample_key(name)[0] for name in names]
        assert len(set(keys)) * 2 == len(names) == shard.files and shard.samples == len(set(keys))
        seen.extend(names)
    assert sorted(seen) == sorted(FILES)


def test_samples_read_back_with_their_fields_in_order(tmp_path):
    shards = packing.pack_folder(_folder(tmp_path / "a", FILES), tmp_path / "out", max_bytes=20 * 1024)
    samples = [sample for shard in shards for sample in packing.iter_shard_samples(shard.path)]
    assert [sample["__key__"] for sample in samples] == [f"train/{index:04d}" for index in range(40)]
    assert samples[3]["jpg"] == FILES["train/0003.jpg"] and samples[3]["cls"] == FILES["train/0003.cls"]
    with open(shards[0].path, "rb") as handle:
        assert packing.shard_index(handle)[0] == ("train/0000.cls", 700)


def test_keys_follow_webdatasets_rule():
    assert packing.sample_key("a/b/x.seg.png") == ("a/b/x", "seg.png")
    assert packing.sample_key("dir.d/file") == ("dir.d/file", "")
    assert packing.sample_key(".hidden") == (".hidden", "")


def test_a_sample_larger_than_a_shard_is_refused_not_split(tmp_path):
    _folder(tmp_path / "a", {"big.bin": b"x" * 50_000})
    with pytest.raises(packing.DatasetError, match="larger than a shard"):
        packing.pack_folder(tmp_path / "a", tmp_path / "out", max_bytes=20 * 1024)


def test_links_are_left_out_and_an_empty_folder_is_refused(tmp_path):
    root = _folder(tmp_path / "a", {"one.txt": b"1"})
    (root / "link.txt").symlink_to("/etc/hostname")
    assert [member.path for member in packing.folder_members(root)] == ["one.txt"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(packing.DatasetError, match="no files"):
        packing.folder_members(tmp_path / "empty")


def test_a_job_streams_its_shards_with_prefetch_split_by_rank(tmp_path):
    shards = packing.pack_folder(_folder(tmp_path / "a", FILES), tmp_path / "out", max_bytes=20 * 1024)
    manifest = {"images": {"version": 3, "shards": [{"sha256": s.sha256, "bytes": s.bytes, "path": str(s.path)}
                                                    for s in shards]}}
    dataset = packing.open_dataset(manifest, "images", work_dir=tmp_path / "work", verify_local=True)
    assert dataset.version == 3
    keys = [sample["__key__"] for sample in dataset]
    assert keys == [f"train/{index:04d}" for index in range(40)]
    ranks = [[s["__key__"] for s in dataset.samples(rank=rank, world_size=2, prefetch_samples=2)] for rank in (0, 1)]
    assert sorted(ranks[0] + ranks[1]) == keys and ranks[0] and ranks[1]
    folder = dataset.path
    assert sorted(p.name for p in folder.iterdir() if p.suffix == ".tar") == \
        [f"shard-{index:05d}.tar" for index in range(len(shards))]
    with pytest.raises(packing.DatasetError, match="names no dataset 'text'"):
        packing.open_dataset(manifest, "text", work_dir=tmp_path / "work")


def test_a_local_shard_that_is_not_its_hash_is_never_read(tmp_path):
    shards = packing.pack_folder(_folder(tmp_path / "a", FILES), tmp_path / "out", max_bytes=20 * 1024)
    with open(shards[0].path, "r+b") as handle:
        handle.seek(600)
        handle.write(b"\xff")
    manifest = {"images": {"version": 1, "shards": [{"sha256": s.sha256, "bytes": s.bytes, "path": str(s.path)}
                                                    for s in shards]}}
    dataset = packing.open_dataset(manifest, "images", work_dir=tmp_path / "work", verify_local=True)
    with pytest.raises(packing.ShardHashMismatch):
        list(dataset)
