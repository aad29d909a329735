"""Datasets as shards: packing a folder into WebDataset tars, and reading a job's datasets back.

**The format** is WebDataset's: a shard is a plain POSIX tar (PAX headers for long names) whose members are
the dataset's files; the files of one sample share a key, the path up to the first dot of the file's
name (``train/0001.jpg`` and ``train/0001.cls`` are the sample ``train/0001`` with the fields ``jpg`` and
``cls``), and they lie next to each other in the tar. Any WebDataset reader (``webdataset``, ``torchdata``,
``tar tf``) reads these shards as they are. They are written here with the standard library's ``tarfile``
rather than the ``webdataset`` package's TarWriter: the SDK runs in a team's own environment and pulls in
nothing but its four small dependencies, and the headers are ours to fix (mtime 0, owner 0, mode 0444,
no user names), which is what makes packing deterministic: the same files give the same shards, byte
for byte, whoever packs them and whenever.

**Packing** sorts the samples by key, and fills each shard with whole samples up to ``max_bytes`` (the
tar's size, headers and padding included); a sample larger than that on its own is refused, never split.
Symbolic links are left out (a link could reach outside the folder).

**Reading**: inside a job, ``gpuportal.init().dataset("name")`` opens one of the datasets the job's spec
names, from the manifest the portal wrote for the attempt (``PORTAL_DATASETS``): each shard is a local
path (the node's cache) or a signed URL (downloaded and checked against its sha256 before a byte is
used). ``.path`` is a folder holding the version's shards (``shard-00000.tar``, ...), for any tar reader;
iterating the dataset streams its samples, a background thread reading the next shards ahead.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shutil
import tarfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gpuportal import _protocol as protocol
from gpuportal import fetch

DEFAULT_SHARD_BYTES = 64 * 1024 * 1024
BLOCK = 512
RECORD = tarfile.RECORDSIZE  # a tar is padded to a whole number of records
CHUNK = 1 << 20
_KEY = re.compile(r"^((?:.*/|)[^./][^./]*)\.([^/]*)$")


class DatasetError(Exception):
    """A dataset that cannot be packed or read as asked; the message says why and what to do."""


def sample_key(path: str) -> tuple[str, str]:
    """(key, field) of a file's path inside the dataset: WebDataset's rule, the name cut at its first dot.
    A name without a dot (or starting with one) is a sample of its own with the field ""."""
    match = _KEY.match(path)
    return (match.group(1), match.group(2)) if match else (path, "")


@dataclass(frozen=True)
class Member:
    """A file to pack: its path inside the dataset (POSIX, relative), its size, and how to open it."""

    path: str
    size: int
    open: Callable[[], IO[bytes]] = field(compare=False, repr=False)


@dataclass(frozen=True)
class Shard:
    """A packed shard: where it lies, its sha256, its bytes, how many samples and files it holds."""

    path: Path
    sha256: str
    bytes: int
    samples: int
    files: int


def _header_bytes(path: str) -> int:
    """The tar header blocks one member takes (a PAX header before it when the name is long or not ASCII)."""
    plain = len(path.encode("utf-8")) <= 100 and path.isascii()
    return BLOCK if plain else 3 * BLOCK + BLOCK * (len(path.encode("utf-8")) // BLOCK + 1)


def _member_bytes(member: Member) -> int:
    return _header_bytes(member.path) + -(-member.size // BLOCK) * BLOCK


def _tar_bytes(payload: int) -> int:
    """A tar's size: its members, the two zero blocks that end it, padded to whole records."""
    return -(-(payload + 2 * BLOCK) // RECORD) * RECORD


def plan(members: Iterable[Member], max_bytes: int = DEFAULT_SHARD_BYTES) -> list[list[Member]]:
    """The shards the members make, each a list of whole samples in key order, each tar at most max_bytes."""
    if max_bytes < RECORD:
        raise DatasetError(f"a shard holds at least {RECORD} bytes; max_bytes={max_bytes} is too small")
    samples: dict[str, list[Member]] = {}
    for member in sorted(members, key=lambda m: (sample_key(m.path), m.path)):
        samples.setdefault(sample_key(member.path)[0], []).append(member)
    shards: list[list[Member]] = []
    current: list[Member] = []
    payload = 0
    for key, files in samples.items():
        size = sum(_member_bytes(member) for member in files)
        if _tar_bytes(size) > max_bytes:
            raise DatasetError(f"the sample {key!r} ({size} bytes) is larger than a shard may be ({max_bytes} bytes); "
                               "split it, or pack with larger shards")
        if current and _tar_bytes(payload + size) > max_bytes:
            shards.append(current)
            current, payload = [], 0
        current.extend(files)
        payload += size
    if current:
        shards.append(current)
    return shards


def write_shard(members: list[Member], target: IO[bytes]) -> None:
    """Write the members as one tar with fixed headers (the same files give the same bytes)."""
    with tarfile.open(fileobj=target, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for member in members:
            info = tarfile.TarInfo(member.path)
            info.size, info.mtime, info.mode = member.size, 0, 0o444
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with member.open() as source:
                tar.addfile(info, _Exactly(source, member.size, member.path))


class _Exactly:
    """A file read no further than `size` bytes, and refused when it is shorter (it changed while packed)."""

    def __init__(self, source: IO[bytes], size: int, path: str):
        self.source, self.left, self.path = source, size, path

    def read(self, size: int = -1) -> bytes:
        size = self.left if size is None or size < 0 else min(size, self.left)
        data = self.source.read(size)
        if len(data) < size:
            raise DatasetError(f"{self.path} changed while it was packed (shorter than listed); pack again")
        self.left -= len(data)
        return data


def folder_members(folder: str | os.PathLike) -> list[Member]:
    """Every regular file under the folder (symbolic links left out), by its POSIX path inside it."""
    root = Path(folder)
    if not root.is_dir():
        raise DatasetError(f"{folder}: not a folder")
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [name for name in subdirs if not (Path(directory) / name).is_symlink()]
        for name in files:
            path = Path(directory) / name
            if path.is_symlink() or not path.is_file():
                continue
            relative = path.relative_to(root).as_posix()
            found.append(Member(relative, path.stat().st_size, lambda path=path: open(path, "rb")))
    if not found:
        raise DatasetError(f"{folder} holds no files")
    return found


def pack(members: Iterable[Member], out_dir: str | os.PathLike, max_bytes: int = DEFAULT_SHARD_BYTES,
         progress: Callable[[int], None] | None = None) -> list[Shard]:
    """Pack the members into shards in out_dir (shard-00000.tar, ...): each hashed as it is written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for position, members_of_shard in enumerate(plan(members, max_bytes)):
        path = out / f"shard-{position:05d}.tar"
        with open(path, "wb") as raw:
            hashing = _Hashing(raw)
            write_shard(members_of_shard, hashing)
        shards.append(Shard(path=path, sha256=hashing.digest.hexdigest(), bytes=hashing.size,
                            samples=len({sample_key(m.path)[0] for m in members_of_shard}),
                            files=len(members_of_shard)))
        if progress:
            progress(sum(m.size for m in members_of_shard))
    return shards


def pack_folder(folder: str | os.PathLike, out_dir: str | os.PathLike, max_bytes: int = DEFAULT_SHARD_BYTES,
                progress: Callable[[int], None] | None = None) -> list[Shard]:
    return pack(folder_members(folder), out_dir, max_bytes, progress)


class _Hashing:
    def __init__(self, target: IO[bytes]):
        self.target, self.digest, self.size = target, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.target.write(data)

    def tell(self) -> int:
        return self.size


def manifest_sha256(shards: Iterable[tuple[str, int]]) -> str:
    """The digest of a version's shard list ((sha256, bytes), in order): how a push finds its open version again."""
    digest = hashlib.sha256()
    for sha256, size in shards:
        digest.update(f"{sha256} {size}\n".encode())
    return digest.hexdigest()


def shard_index(source: IO[bytes]) -> list[tuple[str, int]]:
    """The members of a shard ([(name, bytes)], in order): its index, read from its own headers."""
    with tarfile.open(fileobj=source, mode="r:") as tar:
        return [(info.name, info.size) for info in tar if info.isfile()]


def iter_shard_samples(source: IO[bytes] | str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The samples of one shard, in order: {"__key__": key, "<field>": bytes, ...}."""
    handle = open(source, "rb") if isinstance(source, (str, os.PathLike)) else source
    try:
        with tarfile.open(fileobj=handle, mode="r|") as tar:
            sample: dict[str, Any] = {}
            for info in tar:
                if not info.isfile():
                    continue
                key, name = sample_key(info.name)
                if sample and sample["__key__"] != key:
                    yield sample
                    sample = {}
                sample["__key__"] = key
                extracted = tar.extractfile(info)
                sample[name] = extracted.read() if extracted is not None else b""
            if sample:
                yield sample
    finally:
        if handle is not source:
            handle.close()


# --- Reading inside a job ------------------------------------------------------------------------------


class ShardHashMismatch(DatasetError):
    """A shard's bytes are not the ones its sha256 names: it is never used."""


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def download_checked(url: str, sha256: str, destination: Path) -> Path:
    """Download a shard from a signed URL to `destination`, whole and checked, or raise (nothing left there)."""
    try:
        fetch.download_checked(url, destination, sha256=sha256, what="shard")
    except fetch.DigestMismatch as exc:
        raise ShardHashMismatch(f"the shard downloaded for {sha256}: {exc} Not used.") from None
    except fetch.FetchError as exc:
        raise DatasetError(f"the shard {sha256} could not be fetched: {exc}") from None
    return destination


@dataclass(frozen=True)
class ShardEntry:
    sha256: str
    bytes: int
    path: str | None = None
    url: str | None = None


class JobDataset:
    """One version of a dataset, as a job reads it: ``.path`` (a folder of its shards), ``.shard_paths()``,
    and iteration over its samples with prefetch (``.samples(...)``, or iterate the object itself)."""

    def __init__(self, name: str, version: int, shards: list[ShardEntry], work_dir: Path, *, prefetch_shards: int = 2,
                 verify_local: bool = False):
        self.name = name
        self.version = version
        self.shards = shards
        self.work_dir = work_dir
        self.prefetch_shards = max(1, prefetch_shards)
        self.verify_local = verify_local
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"JobDataset({self.name!r}, version={self.version}, shards={len(self.shards)})"

    @property
    def bytes(self) -> int:
        return sum(shard.bytes for shard in self.shards)

    def _local(self, position: int) -> Path:
        """The shard at this position as a local file: its path in the node's cache, or downloaded (checked)."""
        shard = self.shards[position]
        if shard.path:
            path = Path(shard.path)
            if self.verify_local and file_sha256(path) != shard.sha256:
                raise ShardHashMismatch(f"{path} does not hash to {shard.sha256}; not used")
            return path
        if not shard.url:
            raise DatasetError(f"shard {position} of {self.name}:{self.version} has neither a path nor a URL")
        target = self.work_dir / "downloaded" / shard.sha256
        with self._lock:
            if target.exists():
                return target
        return download_checked(shard.url, shard.sha256, target)

    def shard_paths(self) -> list[Path]:
        """Every shard as a local file, in order (downloading those that are only a URL)."""
        return [self._local(position) for position in range(len(self.shards))]

    @property
    def path(self) -> Path:
        """A folder with the version's shards as shard-00000.tar, ... (links to the cache, or downloads)."""
        folder = self.work_dir / f"{self.name.replace('/', '--')}-v{self.version}"
        if not (folder / ".complete").exists():
            staging = folder.with_name(folder.name + f".tmp-{os.getpid()}")
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            for position, local in enumerate(self.shard_paths()):
                (staging / f"shard-{position:05d}.tar").symlink_to(local.resolve())
            (staging / ".complete").write_text("")
            try:
                os.replace(staging, folder)
            except OSError:  # another rank made it first
                shutil.rmtree(staging, ignore_errors=True)
        return folder

    def samples(self, *, rank: int = 0, world_size: int = 1, prefetch_samples: int = 256) -> Iterator[dict[str, Any]]:
        """The samples of this rank's shards (shard i goes to rank i % world_size), read by a background thread
        that keeps up to `prefetch_shards` shards fetched ahead and `prefetch_samples` samples decoded ahead."""
        positions = [position for position in range(len(self.shards)) if position % world_size == rank]
        return _Prefetcher(self, positions, self.prefetch_shards, prefetch_samples)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.samples()


class _Prefetcher:
    """Two background threads: one fetches the next shards to local files, one reads their samples."""

    _DONE = object()

    def __init__(self, dataset: JobDataset, positions: list[int], prefetch_shards: int, prefetch_samples: int):
        self.files: queue.Queue = queue.Queue(maxsize=prefetch_shards)
        self.samples: queue.Queue = queue.Queue(maxsize=max(1, prefetch_samples))
        self.stopped = threading.Event()
        self.dataset = dataset
        self.positions = positions
        threading.Thread(target=self._fetch, name="gpuportal-dataset-fetch", daemon=True).start()
        threading.Thread(target=self._read, name="gpuportal-dataset-read", daemon=True).start()

    def _put(self, target: queue.Queue, item) -> bool:
        while not self.stopped.is_set():
            try:
                target.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fetch(self) -> None:
        try:
            for position in self.positions:
                if not self._put(self.files, self.dataset._local(position)):
                    return
            self._put(self.files, self._DONE)
        except BaseException as exc:  # handed to the reader, raised in the script's thread
            self._put(self.files, exc)

    def _read(self) -> None:
        while not self.stopped.is_set():
            item = self.files.get()
            if item is self._DONE or isinstance(item, BaseException):
                self._put(self.samples, item)
                return
            try:
                for sample in iter_shard_samples(item):
                    if not self._put(self.samples, sample):
                        return
            except BaseException as exc:
                self._put(self.samples, exc)
                return

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, Any]:
        item = self.samples.get()
        if item is self._DONE:
            self.stopped.set()
            raise StopIteration
        if isinstance(item, BaseException):
            self.stopped.set()
            raise item
        return item

    def close(self) -> None:
        self.stopped.set()

    def __del__(self):
        self.stopped.set()


def read_manifest(text_or_path: str) -> dict:
    """The attempt's datasets manifest (PORTAL_DATASETS: a path to the JSON file, or the JSON itself)."""
    text = text_or_path.strip()
    if not text:
        return {}
    if not text.startswith("{"):
        try:
            text = Path(text).read_text()
        except OSError as exc:
            raise DatasetError(f"{protocol.ENV_DATASETS}={text_or_path}: cannot read it ({exc})") from None
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise DatasetError(f"{protocol.ENV_DATASETS}: not JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise DatasetError(f"{protocol.ENV_DATASETS}: not a JSON object of datasets by name")
    return manifest


def open_dataset(manifest: dict, name: str, *, work_dir: Path, prefetch_shards: int = 2,
                 verify_local: bool = False) -> JobDataset:
    """One dataset of the manifest, by the name the job's spec gave it."""
    entry = manifest.get(name)
    if entry is None:
        names = ", ".join(sorted(manifest)) or "none"
        raise DatasetError(f"the job's spec names no dataset {name!r} (it names: {names}); add it to the spec's "
                           "datasets")
    shards = [ShardEntry(sha256=shard["sha256"], bytes=int(shard.get("bytes", 0)), path=shard.get("path"),
                         url=shard.get("url")) for shard in entry.get("shards", [])]
    return JobDataset(name, int(entry["version"]), shards, work_dir, prefetch_shards=prefetch_shards,
                      verify_local=verify_local)


def record_read(job_dir: Path, *, name: str, version: int, attempt: int, rank: int) -> None:
    """Say which version the job read: a line of datasets.jsonl in the job folder and a tagged stdout line."""
    record = {"name": name, "version": version, "attempt": attempt, "rank": rank, "time": protocol.now_iso()}
    try:
        protocol.append_jsonl(Path(job_dir) / protocol.DATASETS_FILE, record)
    except OSError:
        pass  # the stdout line still says it (a read-only job folder is the backend's choice)
    print(protocol.tagged_line(protocol.DATASET_TAG, record), flush=True)


def dataset_for_context(context, name: str, **options) -> JobDataset:
    """What ``Context.dataset(name)`` answers: the dataset opened from the attempt's manifest, its read recorded."""
    manifest = read_manifest(context._datasets_manifest)
    work_dir = Path(options.pop("work_dir", None) or (Path(context.job_dir) / protocol.ATTEMPTS_DIR / str(context.attempt)
                                                      / "datasets"))
    dataset = open_dataset(manifest, name, work_dir=work_dir, **options)
    if context.is_main:
        record_read(context.job_dir, name=name, version=dataset.version, attempt=context.attempt, rank=context.rank)
    return dataset


__all__ = ["DEFAULT_SHARD_BYTES", "DatasetError", "JobDataset", "Member", "Shard", "ShardHashMismatch",
           "folder_members", "iter_shard_samples", "manifest_sha256", "pack", "pack_folder", "plan", "sample_key",
           "shard_index", "write_shard"]
