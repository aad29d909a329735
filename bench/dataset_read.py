"""Reading a dataset of many small files: straight from S3 (s3fs) against the SDK's shards, streamed and from a node cache.

    .venv/bin/python bench/dataset_read.py [--files 20000] [--file-kb 4] [--shard-mb 16] [--repeats 5] \\
        [--server process|thread] [--reader-cpu 0 --server-cpu 1 | --no-pin] [--json out.json]

No database and no portal processes: the storage layer's pure parts and the SDK, against moto's S3 server
(the S3-compatible server the suite starts; `--server process` runs it as its own process, pinned with
`taskset` to `--server-cpu`, while this process is pinned to `--reader-cpu`, so that the server and the
reader do not share one interpreter's lock; `--server thread` runs it in this process, as the suite's
tests do).

The dataset is `--files` files of about `--file-kb` KB each (random bytes, sizes spread from half to one and a
half times that), one sample a file (`train/000123.bin`): the shape that makes training I/O-bound. It is put
in the bucket twice:

- **raw**: each file an object under `s3://bench-raw/train/`, as a team keeps a dataset it reads without the
  portal;
- **store**: packed by `gpuportal.datasets.pack` into WebDataset shards of at most `--shard-mb` MB, each a blob
  of the portal's content-addressed store (`runners.storage.blobs.BlobStore`, `s3://bench-store/store/shards/..`),
  as a pushed or registered version's shards are.

Then a node cache (`runners.storage.nodecache.NodeCache`, a local folder) is filled with the shards from the
store, as an attempt's supervisor does before its ranks start (its time is reported apart: it is the
prefetch, not the read).

Three readers, each reading every sample and touching every byte (the sum of the bytes is checked against the
dataset's), timed from the first request to the last sample:

- **(a) s3fs**, the files straight from the storage URL. Its documented knobs are tried once each before the
  repeats, on the first `--tune-files` files (`--no-tune` skips them): `fs.open(path).read()` per file (a HEAD
  and a ranged GET each; `default_block_size` and `cache_type` only change how much one GET asks for, and a
  file is smaller than any block), `fs.cat_file` per file (one GET), and `fs.cat(paths, batch_size=N)`,
  s3fs's concurrent fetch (N requests in flight on its event loop) for each N of `--batch-sizes`. The fastest
  is the one the repeats time: the reader a team tuning its loader would keep. The listing (`fs.find`) is
  done once beforehand and not timed, which favours (a).
- **(b) SDK streaming from the store**: `gpuportal.datasets.JobDataset` over shard entries that are URLs signed
  by the S3 server (presigned GETs of the store's blobs; inside a job, the portal's signed URLs serve the same
  checked bytes), each shard downloaded to a fresh folder and checked against its sha256 by the SDK's fetch
  thread while its read thread streams the previous shard's samples.
- **(c) SDK from the node cache**: the same `JobDataset` over shard entries that are local paths in the node
  cache's view, as a job placed on a node whose cache holds them reads them.

`--repeats` rounds, each timing (a), (b) and (c) once, in an order that alternates (a b c, then c b a), so a
slow spell of the shared machine falls on each mode alike. Reported per mode: median, min and max of samples/s
and MB/s (the files' bytes, not the tars' headers), and the ratio of the medians (c)/(a) and (c)/(b). The
node cache's files are in the page cache after its fill, as a warm node's NVMe cache mostly is; the S3
server holds its objects in memory: both sides are served from memory, so the ratio is what the request
count costs, which is what a dataset of many small files suffers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "sdk"))

from gpuportal import datasets as sdk  # noqa: E402

from runners.storage.blobs import BlobStore  # noqa: E402
from runners.storage.nodecache import BlobWanted, NodeCache  # noqa: E402
from tests.support.portal_up import free_port  # noqa: E402
from tests.support.s3 import MotoS3  # noqa: E402

RAW_BUCKET = "bench-raw"
STORE_BUCKET = "bench-store"
KEY, SECRET, REGION = "bench", "bench-secret", "us-east-1"
MB = 1_000_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=20000, help="How many files (one sample each).")
    parser.add_argument("--file-kb", type=float, default=4.0, help="Their mean size in KB (spread 0.5x to 1.5x).")
    parser.add_argument("--shard-mb", type=float, default=16.0, help="The shards' bound, in MB.")
    parser.add_argument("--repeats", type=int, default=5, help="Rounds of (a), (b), (c).")
    parser.add_argument("--batch-sizes", default="4,16,64",
                        help="s3fs cat batch sizes tried for (a) (requests in flight), comma-separated.")
    parser.add_argument("--tune-files", type=int, default=4000, help="How many of the files each reader tried reads.")
    parser.add_argument("--no-tune", dest="tune", action="store_false",
                        help="Time (a) with the first batch size, without trying the other readers first.")
    parser.add_argument("--server", choices=("process", "thread"), default="process")
    parser.add_argument("--reader-cpu", type=int, default=0)
    parser.add_argument("--server-cpu", type=int, default=1)
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="Pin neither the reader nor the server.")
    parser.add_argument("--seed", type=int, default=35)
    parser.add_argument("--json", type=Path, help="Also write the figures here.")
    return parser.parse_args(argv)


@contextlib.contextmanager
def s3_server(kind: str, cpu: int | None) -> Iterator[str]:
    """moto's S3 server on a loopback port: its endpoint URL, for as long as the block runs."""
    if kind == "thread":
        with MotoS3() as server:
            yield server.endpoint
        return
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    if cpu is not None and shutil.which("taskset"):
        command = ["taskset", "-c", str(cpu), *command]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(endpoint + "/moto-api/", timeout=2):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's server did not answer on {endpoint}") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def make_files(count: int, mean_kb: float, seed: int) -> dict[str, bytes]:
    """The dataset: `count` files of random bytes, about `mean_kb` KB each, by their path inside it."""
    rng = random.Random(seed)
    mean = int(mean_kb * 1000)
    return {f"train/{i:06d}.bin": rng.randbytes(rng.randint(mean // 2, mean * 3 // 2)) for i in range(count)}


def s3_filesystem(endpoint: str, **options):
    import s3fs

    return s3fs.S3FileSystem(key=KEY, secret=SECRET, endpoint_url=endpoint, skip_instance_cache=True,
                             client_kwargs={"region_name": REGION}, **options)


def boto_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                        region_name=REGION)


# --- The readers: each yields (samples, bytes) of what it read -------------------------------------------


def read_s3fs(fs, paths: list[str], how: str) -> tuple[int, int]:
    """(a): every file straight from the bucket, `how` one of open, cat_file, cat:<batch size>."""
    samples = size = 0
    if how == "open":
        for path in paths:
            with fs.open(path, "rb") as handle:
                size += len(handle.read())
            samples += 1
    elif how == "cat_file":
        for path in paths:
            size += len(fs.cat_file(path))
            samples += 1
    else:
        batch = int(how.split(":", 1)[1])
        step = max(batch * 4, 256)  # a loader hands the fetched samples on as they come, a few batches at a time
        for start in range(0, len(paths), step):
            for data in fs.cat(paths[start:start + step], batch_size=batch, on_error="raise").values():
                size += len(data)
                samples += 1
    return samples, size


def read_sdk(entries: list[sdk.ShardEntry], work_dir: Path) -> tuple[int, int]:
    """(b) and (c): the SDK's JobDataset over these shard entries (URLs or local paths), its samples streamed."""
    dataset = sdk.JobDataset("bench", 1, entries, work_dir)
    samples = size = 0
    for sample in dataset.samples():
        size += len(sample["bin"])
        samples += 1
    return samples, size


def timed(read: Callable[[], tuple[int, int]], expect: tuple[int, int]) -> dict:
    started = time.perf_counter()
    samples, size = read()
    seconds = time.perf_counter() - started
    if (samples, size) != expect:
        raise AssertionError(f"read {samples} samples, {size} bytes; the dataset holds {expect[0]}, {expect[1]}")
    return {"seconds": seconds, "samples_per_s": samples / seconds, "mb_per_s": size / MB / seconds}


def spread(rows: list[dict], key: str) -> dict:
    values = [row[key] for row in rows]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(args: argparse.Namespace) -> dict:
    if args.pin:
        os.sched_setaffinity(0, {args.reader_cpu})
    files = make_files(args.files, args.file_kb, args.seed)
    expect = (len(files), sum(len(data) for data in files.values()))
    figures: dict = {
        "files": len(files), "bytes": expect[1], "file_kb": args.file_kb, "shard_mb": args.shard_mb,
        "repeats": args.repeats, "server": args.server,
        "pinned": {"reader_cpu": args.reader_cpu, "server_cpu": args.server_cpu} if args.pin else None,
    }
    work = Path(tempfile.mkdtemp(prefix="dataset-read-"))
    try:
        with s3_server(args.server, args.server_cpu if args.pin else None) as endpoint:
            client = boto_client(endpoint)
            for bucket in (RAW_BUCKET, STORE_BUCKET):
                client.create_bucket(Bucket=bucket)
            fs = s3_filesystem(endpoint)

            started = time.perf_counter()
            items = list(files.items())
            for start in range(0, len(items), 1000):
                fs.pipe({f"{RAW_BUCKET}/{path}": data for path, data in items[start:start + 1000]})
            figures["raw_upload_s"] = time.perf_counter() - started

            started = time.perf_counter()
            members = [sdk.Member(path, len(data), lambda data=data: _bytes_io(data)) for path, data in files.items()]
            shards = sdk.pack(members, work / "packed", int(args.shard_mb * MB))
            options = {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint, "region_name": REGION}}
            store = BlobStore(f"s3://{STORE_BUCKET}/store", "shards", options)
            for shard in shards:
                store.put_file(shard.path, shard.sha256)
            figures["pack_and_store_s"] = time.perf_counter() - started
            figures["shards"] = len(shards)
            figures["shard_bytes"] = sum(shard.bytes for shard in shards)
            shutil.rmtree(work / "packed")

            started = time.perf_counter()
            cache = NodeCache(work / "node-cache", figures["shard_bytes"] * 2)
            filled = cache.fill_view(store, [BlobWanted(s.sha256, s.bytes, "shards") for s in shards], holder="bench")
            figures["cache_fill_s"] = time.perf_counter() - started
            cached = [sdk.ShardEntry(s.sha256, s.bytes, path=f.path) for s, f in zip(shards, filled, strict=True)]

            def presigned(sha256: str) -> str:
                key = store.path(sha256).split("/", 1)[1]
                return client.generate_presigned_url("get_object", Params={"Bucket": STORE_BUCKET, "Key": key},
                                                     ExpiresIn=3600)

            streamed = [sdk.ShardEntry(s.sha256, s.bytes, url=presigned(s.sha256)) for s in shards]

            fs.invalidate_cache()
            paths = sorted(fs.find(f"{RAW_BUCKET}/train/"))
            if len(paths) != len(files):
                raise AssertionError(f"the bucket lists {len(paths)} files, not {len(files)}")

            batch_sizes = [int(size) for size in args.batch_sizes.split(",") if size.strip()]
            tried = [f"cat:{size}" for size in batch_sizes]
            if args.tune:
                tried = ["open", "cat_file", *tried]
            tuning = {}
            subset = paths[:args.tune_files]
            expect_subset = (len(subset), sum(len(files[path.split("/", 1)[1]]) for path in subset))
            for how in tried if len(tried) > 1 else []:
                tuning[how] = timed(lambda how=how: read_s3fs(fs, subset, how), expect_subset)
            figures["s3fs_tuning"] = tuning
            best = max(tuning, key=lambda how: tuning[how]["samples_per_s"]) if tuning else tried[0]
            figures["s3fs_reader"] = best

            runs = 0

            def fresh() -> Path:
                nonlocal runs
                runs += 1
                folder = work / f"stream-{runs}"
                return folder

            modes = {
                "a_s3fs": lambda: read_s3fs(fs, paths, best),
                "b_sdk_stream": lambda: read_sdk(streamed, fresh()),
                "c_sdk_node_cache": lambda: read_sdk(cached, work / "cache-reads"),
            }
            rows: dict[str, list[dict]] = {mode: [] for mode in modes}
            for repeat in range(args.repeats):
                order = list(modes) if repeat % 2 == 0 else list(reversed(modes))
                for mode in order:
                    rows[mode].append(timed(modes[mode], expect))
                for folder in work.glob("stream-*"):
                    shutil.rmtree(folder, ignore_errors=True)
            figures["runs"] = rows
            figures["summary"] = {mode: {"samples_per_s": spread(values, "samples_per_s"),
                                         "mb_per_s": spread(values, "mb_per_s")} for mode, values in rows.items()}
            medians = {mode: figures["summary"][mode]["samples_per_s"]["median"] for mode in modes}
            figures["ratio_c_over_a"] = medians["c_sdk_node_cache"] / medians["a_s3fs"]
            figures["ratio_c_over_b"] = medians["c_sdk_node_cache"] / medians["b_sdk_stream"]
            figures["ratio_b_over_a"] = medians["b_sdk_stream"] / medians["a_s3fs"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return figures


def _bytes_io(data: bytes):
    import io

    return io.BytesIO(data)


def report(figures: dict) -> str:
    lines = [f"{figures['files']} files, {figures['bytes'] / MB:.1f} MB; {figures['shards']} shards "
             f"({figures['shard_bytes'] / MB:.1f} MB); S3 server: moto ({figures['server']}); pinned: {figures['pinned']}",
             f"put raw files {figures['raw_upload_s']:.1f} s, pack and store shards {figures['pack_and_store_s']:.1f} s, "
             f"fill the node cache {figures['cache_fill_s']:.2f} s"]
    for how, row in figures["s3fs_tuning"].items():
        lines.append(f"  s3fs {how:>10}: {row['samples_per_s']:9.0f} samples/s {row['mb_per_s']:7.2f} MB/s")
    lines.append(f"(a) reads with s3fs {figures['s3fs_reader']}")
    for mode, summary in figures["summary"].items():
        rate, mbs = summary["samples_per_s"], summary["mb_per_s"]
        lines.append(f"{mode:>17}: {rate['median']:9.0f} samples/s (min {rate['min']:.0f}, max {rate['max']:.0f}); "
                     f"{mbs['median']:7.2f} MB/s (min {mbs['min']:.2f}, max {mbs['max']:.2f})")
    lines.append(f"(c)/(a) = {figures['ratio_c_over_a']:.1f}x   (c)/(b) = {figures['ratio_c_over_b']:.2f}x   "
                 f"(b)/(a) = {figures['ratio_b_over_a']:.1f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    args = parse_args(argv)
    figures = run(args)
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()
