"""The local backend's node caches: the supervisor fills a node's cache with the job's shards before the ranks
start, pins them for the attempt, hands the script its manifest, and the sandbox shows it only its own shards.

Real supervisors and sandboxed scripts, started through LocalBackend as the portal's launch does.
"""

import json
import uuid
from pathlib import Path

import pytest

from runners.backends.base import DatasetMount, ShardRef
from runners.backends.local import LocalBackend
from runners.storage.blobs import BlobStore
from runners.storage.nodecache import BlobWanted, NodeCache
from runners.workloads import sandbox, supervise
from tests.backends.test_local_sandbox import ended, logs, script_launch, stored_bundle

pytestmark = pytest.mark.e2e

READS = r'''
import hashlib, json, os

targets = json.loads(os.environ["PORTAL_HYPERPARAMETERS"])
manifest = json.load(open(os.environ["PORTAL_DATASETS"]))
found = {"hashes": {}, "versions": {name: dataset["version"] for name, dataset in manifest.items()}}
for dataset in manifest.values():
    for shard in dataset["shards"]:
        with open(shard["path"], "rb") as stream:
            found["hashes"][shard["sha256"]] = hashlib.sha256(stream.read()).hexdigest()
        last = shard["path"]


def attempt(name, action):
    try:
        action()
        found[name] = "done"
    except Exception as exc:
        found[name] = type(exc).__name__


attempt("read_other_blob", lambda: open(targets["other_blob"], "rb").read(1))
try:
    found["cache_listing"] = sorted(os.listdir(targets["cache_root"]))
except OSError as exc:
    found["cache_listing"] = type(exc).__name__
attempt("write_shard", lambda: open(last, "ab").write(b"x"))
with open(os.path.join(os.environ["TRAIN_JOB_DIR"], f"rank-{os.environ['RANK']}.json"), "w") as stream:
    json.dump(found, stream)
'''


def make_backend(tmp_path) -> LocalBackend:
    return LocalBackend(workspace_dir=tmp_path / "workspaces", use_nvml=False, jobs_dir=tmp_path / "jobs",
                        node_caches={"data_storage_url": f"file://{tmp_path / 'blobstore'}"})


def shards(tmp_path, count: int, size: int = 40_000) -> tuple[ShardRef, ...]:
    store = BlobStore(f"file://{tmp_path / 'blobstore'}", "shards")
    refs = []
    for index in range(count):
        sha, stored = store.put_bytes(uuid.uuid4().bytes * (size // 16) + bytes([index]))
        refs.append(ShardRef(sha, stored))
    return tuple(refs)


def fills(backend, launch) -> list[dict]:
    return json.loads((backend.jobs.attempt_dir(launch.job_id, launch.attempt) / supervise.CACHE_FILLS_FILE).read_text())


def test_a_two_rank_job_placed_twice_on_one_node_pulls_nothing_the_second_time(tmp_path):
    backend = make_backend(tmp_path)
    ref = stored_bundle(tmp_path, {"reads.py": READS})
    mounts = (DatasetMount("corpus", 3, shards(tmp_path, 3)),)
    cache_root = tmp_path / "node-cache" / "sim-1"
    # Another tenant's shard, already in the same node's cache: the job must not see it.
    other = shards(tmp_path, 1)[0]
    NodeCache(cache_root, 10**9).fill(BlobStore(f"file://{tmp_path / 'blobstore'}", "shards"),
                                      BlobWanted(other.sha256, other.bytes), holder="job-99-attempt-1")
    targets = {"other_blob": str(NodeCache(cache_root, 10**9).blob_path(other.sha256)), "cache_root": str(cache_root)}
    runs = []
    for job_id in (41, 42):
        launch = script_launch(job_id, ref, ("python", "reads.py"), ranks=2, hyperparameters=targets)
        launch = type(launch)(**{**launch.__dict__, "datasets": mounts})
        backend.launch_job(launch)
        status = ended(backend, launch)
        assert status.phase == "exited" and status.exit_codes == {0: 0, 1: 0}, logs(backend, launch)
        runs.append((launch, fills(backend, launch)))
        for rank in (0, 1):
            found = json.loads((backend.jobs.job_dir(job_id) / f"rank-{rank}.json").read_text())
            assert found["hashes"] == {shard.sha256: shard.sha256 for shard in mounts[0].shards}
            assert found["versions"] == {"corpus": 3}
            assert found["write_shard"] != "done"
            if sandbox.unavailable() is None:  # the sandbox shows the job its own shards and nothing else
                assert found["read_other_blob"] == "FileNotFoundError"
                assert found["cache_listing"] == ["views"]  # no blobs/, index or other holders' views
        pinned = NodeCache(cache_root, 10**9).holders()
        assert f"job-{job_id}-attempt-1" in pinned  # pinned while the attempt is not forgotten
        backend.forget_job(launch.job_id, launch.attempt)
        assert f"job-{job_id}-attempt-1" not in NodeCache(cache_root, 10**9).holders()
    total = sum(shard.bytes for shard in mounts[0].shards)
    (first, first_fills), (_second, second_fills) = runs
    # One fill per node, whatever the number of its ranks; the second placement pulls nothing.
    assert [(f["node"], f["misses"], f["bytes_pulled"]) for f in first_fills] == [("sim-1", 3, total)]
    assert [(f["node"], f["hits"], f["misses"], f["bytes_pulled"]) for f in second_fills] == [("sim-1", 3, 0, 0)]
    snapshot = backend.node_cache_snapshots({"sim-1": None})["sim-1"]
    assert snapshot.stats.bytes_pulled == total + other.bytes


def test_a_shard_that_does_not_hash_to_its_key_is_refused_and_no_rank_starts(tmp_path):
    backend = make_backend(tmp_path)
    ref = stored_bundle(tmp_path, {"reads.py": READS})
    bad = shards(tmp_path, 1)[0]
    path = Path(BlobStore(f"file://{tmp_path / 'blobstore'}", "shards").path(bad.sha256))
    path.write_bytes(b"\0" * bad.bytes)  # the store's copy corrupted
    launch = script_launch(43, ref, ("python", "reads.py"), hyperparameters={"other_blob": "/", "cache_root": "/"})
    launch = type(launch)(**{**launch.__dict__, "datasets": (DatasetMount("corpus", 1, (bad,)),)})
    backend.launch_job(launch)
    status = ended(backend, launch)
    assert status.phase == "lost" and "not what its key names" in status.reason
    assert not (backend.jobs.job_dir(43) / "rank-0.json").exists()
    cache = NodeCache(tmp_path / "node-cache" / "sim-1", 10**9)
    assert cache.snapshot().entries == ()
