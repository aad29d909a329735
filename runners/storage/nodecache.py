"""A node's cache of blobs: a bounded folder of content-addressed files, filled from a BlobStore.

One cache per node (local NVMe in production, ``<var>/node-cache/<node>/`` on the local backend), shared by
every attempt and every tenant on the node: a blob is keyed by its sha256, so a shard two datasets hold,
or the weights two endpoints serve, is cached once. Who may read a blob is decided above this module (the
portal hands an attempt only its own job's blobs, and the sandbox shows it only those).

The folder::

    <root>/.lock                 fcntl lock: one process at a time reads or writes index.json
    <root>/index.json            every blob held (or being filled), its pins and last use; the counters
    <root>/blobs/<sha[:2]>/<sha> the blobs, read-only (0444)
    <root>/views/<holder>/       one folder per holder (an attempt): hard links to the blobs it pinned
    <root>/tmp/                  fills in progress (a fill is renamed into blobs/ once checked)

What holds:

- the bytes held (blobs ready and blobs being filled, by their declared size) never pass the capacity: room
  is made before a fill starts, by evicting the least recently used blobs that no holder pins; when that
  is not enough, ``CacheFull`` and nothing is evicted;
- a blob pinned by a holder (an attempt that reads it) is never evicted; ``release`` drops a holder's
  pins (the attempt ended) and its view;
- a blob is served only once its bytes hashed to its key (``BlobStore.fetch`` checks, and writes to the
  destination only what matched); what lies under ``blobs/`` is always whole;
- several processes may fill the same cache at once: the index is read and written under the lock, and a
  fill's download runs outside it (its room reserved, its entry marked ``filling``), so one slow download
  does not hold the others; a second process wanting a blob being filled waits for that fill rather than
  pulling the bytes again, and takes it over when its filler died.

Pure: stdlib and ``runners.storage.blobs``; no Django.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runners.storage.blobs import SHA256, BlobStore

INDEX_FILE = "index.json"
LOCK_FILE = ".lock"
BLOBS_DIR = "blobs"
VIEWS_DIR = "views"
TMP_DIR = "tmp"
READY = "ready"
FILLING = "filling"
# How long a process waits for another's fill of the same blob before it gives up.
WAIT_FOR_FILL_S = 1800.0
WAIT_POLL_S = 0.05
# A holder's name becomes a folder name: letters, digits, dot, dash and underscore.
HOLDER = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
STAT_NAMES = ("hits", "misses", "bytes_pulled", "evictions", "bytes_evicted")


class CacheFull(Exception):
    """The blob does not fit: the capacity is smaller, or the rest of the cache is pinned."""


class FillFailed(Exception):
    """Another process's fill of the blob did not finish in time."""


@dataclass(frozen=True)
class BlobWanted:
    """A blob a holder needs in the cache: its key, its size and kind (as the store keeps it)."""

    sha256: str
    bytes: int
    kind: str = "shards"


@dataclass(frozen=True)
class Filled:
    """A blob now in the cache for its holder: where it lies, and whether it was there already."""

    sha256: str
    bytes: int
    path: str
    hit: bool
    pulled_bytes: int = 0


@dataclass(frozen=True)
class Entry:
    sha256: str
    kind: str
    bytes: int
    state: str
    filled_at: float
    last_used: float
    pins: tuple[str, ...] = ()


@dataclass(frozen=True)
class CacheStats:
    capacity_bytes: int
    bytes_held: int
    blobs: int
    pinned_bytes: int
    hits: int = 0
    misses: int = 0
    bytes_pulled: int = 0
    evictions: int = 0
    bytes_evicted: int = 0

    @property
    def hit_rate(self) -> float | None:
        asked = self.hits + self.misses
        return None if asked == 0 else self.hits / asked


@dataclass(frozen=True)
class Snapshot:
    """What the cache holds now and its counters: what the portal copies into its own rows."""

    stats: CacheStats
    entries: tuple[Entry, ...] = field(default_factory=tuple)


def _check_holder(holder: str) -> str:
    if not HOLDER.match(holder or ""):
        raise ValueError(f"a holder is 1 to 128 letters, digits, dots, dashes or underscores, not {holder!r}")
    return holder


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NodeCache:
    """The cache in the folder ``root``, holding at most ``capacity_bytes``."""

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, *, clock=time.time):
        if capacity_bytes < 0:
            raise ValueError("a cache's capacity is 0 bytes or more")
        self.root = Path(root)
        self.capacity_bytes = int(capacity_bytes)
        self._clock = clock
        for folder in (self.root, self.root / BLOBS_DIR, self.root / VIEWS_DIR, self.root / TMP_DIR):
            folder.mkdir(parents=True, exist_ok=True)
            # The sandbox account reads blobs through its view's links: every folder on the way is 0755.
            os.chmod(folder, 0o755)

    # --- paths -----------------------------------------------------------------------------

    def blob_path(self, sha256: str) -> Path:
        if not SHA256.match(sha256 or ""):
            raise ValueError(f"not a sha256 key: {sha256!r}")
        return self.root / BLOBS_DIR / sha256[:2] / sha256

    def view_dir(self, holder: str) -> Path:
        return self.view_path(self.root, holder)

    @staticmethod
    def view_path(root: str | os.PathLike, holder: str) -> Path:
        """Where the cache at `root` links `holder`'s blobs (known before the cache is opened or filled)."""
        return Path(root) / VIEWS_DIR / _check_holder(holder)

    # --- the index, under the lock -------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[dict]:
        """The index, read under the exclusive lock and written back (atomically) when the block ends."""
        with open(self.root / LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            index = self._read_index()
            before = json.dumps(index, sort_keys=True)
            yield index
            if json.dumps(index, sort_keys=True) != before:
                self._write_index(index)

    def _read_index(self) -> dict:
        try:
            index = json.loads((self.root / INDEX_FILE).read_text())
        except FileNotFoundError:
            index = {}
        index.setdefault("entries", {})
        index.setdefault("stats", {})
        for name in STAT_NAMES:
            index["stats"].setdefault(name, 0)
        index.setdefault("tick", 0)
        return index

    def _write_index(self, index: dict) -> None:
        temp = self.root / f".{INDEX_FILE}.tmp-{os.getpid()}"
        with open(temp, "w") as stream:
            json.dump(index, stream, sort_keys=True)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temp, self.root / INDEX_FILE)

    @staticmethod
    def _held(index: dict) -> int:
        return sum(entry["bytes"] for entry in index["entries"].values())

    def _touch(self, index: dict, entry: dict) -> None:
        # A logical clock orders the uses (two in one clock tick still differ); the time is for people.
        index["tick"] += 1
        entry["order"] = index["tick"]
        entry["last_used"] = self._clock()

    def _make_room(self, index: dict, size: int) -> None:
        """Evict unpinned ready blobs, least recently used first, until `size` more bytes fit; CacheFull
        (and nothing evicted) when they cannot."""
        if size > self.capacity_bytes:
            raise CacheFull(f"a blob of {size} bytes does not fit in a cache of {self.capacity_bytes} bytes")
        need = self._held(index) + size - self.capacity_bytes
        if need <= 0:
            return
        candidates = sorted(
            (entry["order"], sha) for sha, entry in index["entries"].items()
            if entry["state"] == READY and not entry["pins"]
        )
        chosen, freed = [], 0
        for _order, sha in candidates:
            if freed >= need:
                break
            chosen.append(sha)
            freed += index["entries"][sha]["bytes"]
        if freed < need:
            pinned = sum(entry["bytes"] for entry in index["entries"].values() if entry["pins"] or entry["state"] != READY)
            raise CacheFull(
                f"{size} bytes do not fit: the cache holds {self._held(index)} of {self.capacity_bytes} bytes, "
                f"{pinned} of them pinned by running attempts or being filled"
            )
        for sha in chosen:
            entry = index["entries"].pop(sha)
            self.blob_path(sha).unlink(missing_ok=True)
            index["stats"]["evictions"] += 1
            index["stats"]["bytes_evicted"] += entry["bytes"]

    # --- filling ---------------------------------------------------------------------------------

    def fill(self, store: BlobStore, wanted: BlobWanted, *, holder: str) -> Filled:
        """The blob in the cache, pinned for `holder`: found (a hit) or pulled from `store` (a miss).

        CacheFull when it cannot fit; the store's HashMismatch or BlobMissing when its bytes are not the
        key's (nothing is then cached, and the room reserved is given back)."""
        _check_holder(holder)
        path = self.blob_path(wanted.sha256)
        deadline = time.monotonic() + WAIT_FOR_FILL_S
        while True:
            with self._locked() as index:
                entry = index["entries"].get(wanted.sha256)
                if entry is not None and entry["state"] == FILLING and not _pid_alive(entry.get("filler", 0)):
                    # Its filler died mid-download: the entry is ours to take over.
                    del index["entries"][wanted.sha256]
                    entry = None
                if entry is not None and entry["state"] == READY and path.is_file():
                    if holder not in entry["pins"]:
                        entry["pins"].append(holder)
                    self._touch(index, entry)
                    index["stats"]["hits"] += 1
                    return Filled(wanted.sha256, entry["bytes"], str(path), hit=True)
                if entry is not None and entry["state"] == READY:
                    del index["entries"][wanted.sha256]  # its file was removed by hand: fill it again
                    entry = None
                if entry is None:
                    self._make_room(index, wanted.bytes)
                    now = self._clock()
                    entry = {"kind": wanted.kind, "bytes": int(wanted.bytes), "state": FILLING, "filler": os.getpid(),
                             "filled_at": now, "last_used": now, "order": 0, "pins": [holder]}
                    index["entries"][wanted.sha256] = entry
                    self._touch(index, entry)
                    break
                # Another live process fills it: wait for that fill, holding a pin so it is not evicted.
                if holder not in entry["pins"]:
                    entry["pins"].append(holder)
            if time.monotonic() > deadline:
                raise FillFailed(f"another process's fill of {wanted.sha256} did not finish in {WAIT_FOR_FILL_S} s")
            time.sleep(WAIT_POLL_S)
        try:
            pulled = store.fetch(wanted.sha256, self.root / TMP_DIR / f"{wanted.sha256}.{os.getpid()}")
        except BaseException:
            with self._locked() as index:
                index["entries"].pop(wanted.sha256, None)
            for leftover in (self.root / TMP_DIR).glob(f"{wanted.sha256}.{os.getpid()}*"):
                leftover.unlink(missing_ok=True)
            raise
        fetched = self.root / TMP_DIR / f"{wanted.sha256}.{os.getpid()}"
        if pulled != wanted.bytes:
            # The room reserved was the declared size: a blob of another size would break the bound.
            fetched.unlink(missing_ok=True)
            with self._locked() as index:
                index["entries"].pop(wanted.sha256, None)
            raise ValueError(f"blob {wanted.sha256} holds {pulled} bytes, not the {wanted.bytes} declared")
        os.chmod(fetched, 0o444)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o755)
        with self._locked() as index:
            os.replace(fetched, path)
            entry = index["entries"].setdefault(wanted.sha256, {
                "kind": wanted.kind, "filled_at": self._clock(), "pins": [holder], "order": 0})
            entry.update(state=READY, bytes=pulled, filler=0)
            self._touch(index, entry)
            index["stats"]["misses"] += 1
            index["stats"]["bytes_pulled"] += pulled
        return Filled(wanted.sha256, pulled, str(path), hit=False, pulled_bytes=pulled)

    def fill_view(self, store: BlobStore, wanted: Iterable[BlobWanted], *, holder: str) -> list[Filled]:
        """Fill every blob for `holder` and link each into its view folder (``view_dir(holder)/<sha256>``),
        which is what a sandbox shows the holder's processes. The Filled paths are the view's."""
        view = self.view_dir(holder)
        view.mkdir(parents=True, exist_ok=True)
        os.chmod(view, 0o755)
        done = []
        for blob in wanted:
            filled = self.fill(store, blob, holder=holder)
            link = view / blob.sha256
            if not link.exists():
                temp = view / f".{blob.sha256}.tmp"
                temp.unlink(missing_ok=True)
                os.link(filled.path, temp)
                os.replace(temp, link)
            done.append(Filled(filled.sha256, filled.bytes, str(link), filled.hit, filled.pulled_bytes))
        return done

    def release(self, holder: str) -> int:
        """Drop every pin `holder` holds and its view folder; the number of blobs it had pinned."""
        _check_holder(holder)
        dropped = 0
        with self._locked() as index:
            for entry in index["entries"].values():
                if holder in entry["pins"]:
                    entry["pins"].remove(holder)
                    dropped += 1
        shutil.rmtree(self.view_dir(holder), ignore_errors=True)
        return dropped

    def holders(self) -> set[str]:
        """Every holder that pins a blob now."""
        with self._locked() as index:
            return {holder for entry in index["entries"].values() for holder in entry["pins"]}

    # --- reading what it holds ---------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        with self._locked() as index:
            entries = tuple(
                Entry(sha256=sha, kind=entry["kind"], bytes=entry["bytes"], state=entry["state"],
                      filled_at=entry["filled_at"], last_used=entry["last_used"], pins=tuple(entry["pins"]))
                for sha, entry in sorted(index["entries"].items())
            )
            stats = CacheStats(
                capacity_bytes=self.capacity_bytes, bytes_held=self._held(index),
                blobs=sum(1 for entry in entries if entry.state == READY),
                pinned_bytes=sum(entry.bytes for entry in entries if entry.pins),
                **{name: int(index["stats"][name]) for name in STAT_NAMES},
            )
        return Snapshot(stats=stats, entries=entries)

    def stats(self) -> CacheStats:
        return self.snapshot().stats


def snapshot_json(snapshot: Snapshot) -> dict:
    """A snapshot as plain JSON (what a cache agent reports)."""
    return {"stats": asdict(snapshot.stats), "entries": [asdict(entry) for entry in snapshot.entries]}
