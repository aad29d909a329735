"""Checkpoints stored as content-defined chunks: each chunk once in the store, whatever holds it.

A checkpoint file is cut by FastCDC (the ``fastcdc`` package): chunk boundaries fall where the bytes'
rolling hash says, not at fixed offsets, so bytes that did not change between two checkpoints give the same
chunks even when what precedes them grew or shrank. Each chunk is a blob of kind "chunks" in the
`runners.storage.blobs.BlobStore` (keyed by its sha256); a checkpoint is its ``Manifest``: the ordered list
of its chunks, with the whole file's sha256 and size.

Why this dedupes a fine-tune: ``torch.save`` writes a zip whose members are the pickled structure first and
then one uncompressed member per tensor storage, in the state dict's order. A frozen base's tensors are the
same bytes in every checkpoint, so all but the chunks that straddle a changed tensor are already stored.

What holds:

- ``split`` is deterministic: the same bytes give the same chunks;
- ``restore`` checks every chunk against its key and the joined file against the manifest's sha256, and
  leaves the destination whole or untouched (written under a temporary name, then renamed).

Pure: no Django, no portal app.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import struct
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fastcdc import fastcdc

from runners.storage.blobs import SHA256, BlobMissing, BlobStore, HashMismatch

KIND = "chunks"
# A checkpoint of a few GB is a few thousand chunks; the bounds keep a chunk between a quarter and eight
# times the average (FastCDC's normalized chunking keeps most near it).
AVERAGE_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = AVERAGE_CHUNK_BYTES // 4
MAX_CHUNK_BYTES = AVERAGE_CHUNK_BYTES * 8
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class ChunkRef:
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Manifest:
    """A stored checkpoint: its chunks in order, the whole file's sha256 and size."""

    sha256: str
    bytes: int
    chunks: tuple[ChunkRef, ...]

    def to_json(self) -> dict:
        return {"version": MANIFEST_VERSION, "sha256": self.sha256, "bytes": self.bytes,
                "chunks": [[chunk.sha256, chunk.bytes] for chunk in self.chunks]}

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        """The manifest a ``to_json`` wrote; ValueError when it is not one."""
        if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
            raise ValueError("not a checkpoint manifest (version 1)")
        chunks = []
        for entry in data.get("chunks") or []:
            if (not isinstance(entry, list | tuple) or len(entry) != 2 or not isinstance(entry[0], str)
                    or not SHA256.match(entry[0]) or not isinstance(entry[1], int) or entry[1] < 0):
                raise ValueError(f"not a chunk entry: {entry!r}")
            chunks.append(ChunkRef(entry[0], entry[1]))
        sha256, size = data.get("sha256"), data.get("bytes")
        if not isinstance(sha256, str) or not SHA256.match(sha256) or not isinstance(size, int):
            raise ValueError("a manifest names its file's sha256 and bytes")
        if sum(chunk.bytes for chunk in chunks) != size:
            raise ValueError("a manifest's chunks do not add up to its bytes")
        return cls(sha256, size, tuple(chunks))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))


def _zip_members(view) -> list[int]:
    """Where each member of a zip archive starts (its local header) and where its data starts, in order;
    [] when the buffer is not a zip."""
    if bytes(view[:4]) != b"PK\x03\x04":
        return []
    try:
        with zipfile.ZipFile(_ViewReader(view)) as archive:  # reads the central directory only
            infos = archive.infolist()
            central = archive.start_dir
    except (zipfile.BadZipFile, ValueError, OSError):
        return []
    bounds = {central}
    for info in infos:
        header = bytes(view[info.header_offset:info.header_offset + 30])
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            return []
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        bounds.update((info.header_offset, info.header_offset + 30 + name_length + extra_length))
    return sorted(bound for bound in bounds if 0 < bound < len(view))


class _ViewReader(io.RawIOBase):
    """A read-only, seekable file over a buffer, without copying it (zipfile reads the directory through it)."""

    def __init__(self, view):
        self.view, self.position = view, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.position

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: len(self.view)}[whence]
        self.position = max(0, base + offset)
        return self.position

    def read(self, size=-1):
        end = len(self.view) if size is None or size < 0 else min(len(self.view), self.position + size)
        data = bytes(self.view[self.position:end])
        self.position = max(self.position, end)
        return data

    def close(self):
        self.view = memoryview(b"")
        super().close()


def _regions(view) -> Iterator[tuple[int, int]]:
    """The (start, end) spans chunked on their own: a zip's members' headers and data (``torch.save`` writes one
    member per tensor storage, so a fine-tune's changed tensors sit between frozen ones, and each member's
    name holds the file's name, so every header differs between two checkpoints), else the whole buffer. Members smaller than the minimum chunk are grouped with their small neighbours,
    never with a large member, so a small changed tensor never changes a large frozen one's chunks."""
    bounds = [0, *_zip_members(view), len(view)]
    group_start = None
    for start, end in zip(bounds, bounds[1:]):
        if end - start >= MIN_CHUNK_BYTES:
            if group_start is not None:
                yield group_start, start
                group_start = None
            yield start, end
        else:
            group_start = start if group_start is None else group_start
            if end - group_start >= MIN_CHUNK_BYTES:
                yield group_start, end
                group_start = None
    if group_start is not None:
        yield group_start, len(view)


def _chunks_of(view) -> Iterator[tuple[int, int]]:
    """(offset, length) of each content-defined chunk of a buffer: cut within each region (see ``_regions``),
    so a region's chunks depend on its bytes only, not on its neighbours'."""
    for start, end in _regions(view):
        with view[start:end] as region:
            cuts = [(chunk.offset, chunk.length) for chunk in fastcdc(
                region, min_size=MIN_CHUNK_BYTES, avg_size=AVERAGE_CHUNK_BYTES, max_size=MAX_CHUNK_BYTES)]
        for offset, length in cuts:
            yield start + offset, length


# How much of a file ``split_open`` holds at once: at least twice the largest chunk, so every window cuts at
# least one chunk that ends where a cut of the whole file would.
WINDOW_BYTES = 4 * MAX_CHUNK_BYTES


class ChangedWhileRead(OSError):
    """The file shrank while it was being read (another process truncated it): read it again later."""


class _FileView:
    """Slices of an open file by offset (``os.pread``), as ``_zip_members`` and ``_regions`` read a buffer: the
    zip's directory and headers are read where they are, nothing else."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: slice) -> bytes:
        start, stop, _ = index.indices(self.size)
        return os.pread(self.fd, max(0, stop - start), start)


def _read_exactly(fd: int, buffer: memoryview, offset: int) -> None:
    done = 0
    while done < len(buffer):
        count = os.preadv(fd, [buffer[done:]], offset + done)
        if count == 0:
            raise ChangedWhileRead(f"the file ended at {offset + done} bytes while it was read")
        done += count


def split_open(handle: BinaryIO, put=None, *, window_bytes: int = WINDOW_BYTES) -> Manifest:
    """The manifest of an open regular file, read once, front to back, a window at a time (no mapping, no copy):
    each byte hashed once for its chunk and once for the whole file, in the same read. ``put(piece, sha256)``
    is called with each chunk as it is cut (to store it). The chunks are the ones ``split`` cuts from the same
    bytes (a cut depends on at most MAX_CHUNK_BYTES from the chunk's start, and a window's last chunks that
    could reach past it are cut again from the next window). A file another process changes meanwhile gives the
    manifest of the bytes read, or ChangedWhileRead if it shrank; it never crashes the reader, as a mapping of a
    truncated file would (SIGBUS)."""
    if window_bytes < 2 * MAX_CHUNK_BYTES:
        raise ValueError("a window holds at least two of the largest chunks")
    fd = handle.fileno()
    size = os.fstat(fd).st_size
    whole = hashlib.sha256()
    found = []
    buffer = memoryview(bytearray(min(window_bytes, max(size, 1))))
    for start, end in _regions(_FileView(fd, size)) if size else ():
        position = start
        while position < end:
            window = buffer[:min(len(buffer), end - position)]
            _read_exactly(fd, window, position)
            last = position + len(window) == end
            consumed = 0
            for cut in fastcdc(window, min_size=MIN_CHUNK_BYTES, avg_size=AVERAGE_CHUNK_BYTES,
                               max_size=MAX_CHUNK_BYTES):
                if not last and cut.offset + MAX_CHUNK_BYTES > len(window):
                    break  # its cut may depend on bytes past the window: cut it again from the next one
                with window[cut.offset:cut.offset + cut.length] as piece:
                    whole.update(piece)
                    sha256 = hashlib.sha256(piece).hexdigest()
                    if put is not None:
                        put(piece, sha256)
                found.append(ChunkRef(sha256, cut.length))
                consumed = cut.offset + cut.length
            window.release()
            position += consumed
    buffer.release()
    return Manifest(whole.hexdigest(), size, tuple(found))


def store_open(store: BlobStore, handle: BinaryIO) -> tuple[Manifest, int]:
    """Store the chunks of an open file that the store lacks, in the one read that cuts them (``split_open``);
    its manifest and the bytes newly written. Each chunk is stored under the hash just taken of its bytes."""
    written = [0]

    def put(piece: memoryview, sha256: str) -> None:
        if store.put_hashed(piece, sha256):
            written[0] += len(piece)

    return split_open(handle, put), written[0]


def split(path: str | os.PathLike, *, sha256: str | None = None) -> Manifest:
    """The manifest of a local file (its chunks hashed, nothing stored). ``sha256``: the whole file's, when the
    caller hashed it already as it wrote the file (then each byte is hashed once here, in its chunk)."""
    return _walk(path, None, whole_sha256=sha256)


def store_file(store: BlobStore, path: str | os.PathLike) -> tuple[Manifest, int]:
    """Store a local file's chunks (those the store lacks); its manifest and the bytes newly written."""
    written = [0]

    def put(data: memoryview, sha256: str) -> None:
        if not store.exists(sha256):
            store.put_bytes(bytes(data))
            written[0] += len(data)

    manifest = _walk(path, put)
    return manifest, written[0]


def store_chunks(store: BlobStore, path: str | os.PathLike, manifest: Manifest,
                 only: Iterable[str] | None = None, *, verify: bool = True) -> int:
    """Store the chunks of ``manifest`` cut from the local file ``path`` (``only`` those keys when given) that
    the store lacks; the bytes written. HashMismatch when the file is no longer the manifest's bytes.

    ``verify=False`` trusts that the file is the one the manifest was cut from (a private copy no one else
    writes): no chunk is hashed again, and each is stored under the manifest's key."""
    wanted = set(only) if only is not None else None
    written = 0
    with _mapped(path) as view:
        offset = 0
        for chunk in manifest.chunks:
            start, offset = offset, offset + chunk.bytes
            if wanted is not None and chunk.sha256 not in wanted:
                continue
            with view[start:offset] as piece:
                if verify and hashlib.sha256(piece).hexdigest() != chunk.sha256:
                    raise HashMismatch(f"{path} changed since its manifest was made (the chunk at {start})")
                # Its key is the hash just checked (or the manifest's, for a trusted copy): not hashed again.
                if store.put_hashed(piece, chunk.sha256):
                    written += chunk.bytes
    return written


class _Empty:
    def __enter__(self):
        return memoryview(b"")

    def __exit__(self, *exc):
        return False


class _Mapped:
    def __init__(self, path):
        self.handle = open(path, "rb")
        try:
            self.map = mmap.mmap(self.handle.fileno(), 0, access=mmap.ACCESS_READ)
        except BaseException:
            self.handle.close()
            raise
        self.view = memoryview(self.map)

    def __enter__(self):
        return self.view

    def __exit__(self, *exc):
        self.view.release()
        self.map.close()
        self.handle.close()
        return False


def _mapped(path):
    return _Empty() if os.path.getsize(path) == 0 else _Mapped(path)


def _walk(path, put, *, whole_sha256: str | None = None) -> Manifest:
    whole = hashlib.sha256() if whole_sha256 is None else None
    chunks = []
    with _mapped(path) as view:
        for offset, length in _chunks_of(view) if len(view) else ():
            with view[offset:offset + length] as piece:
                if whole is not None:
                    whole.update(piece)
                sha256 = hashlib.sha256(piece).hexdigest()
                if put is not None:
                    put(piece, sha256)
            chunks.append(ChunkRef(sha256, length))
        size = len(view)
    return Manifest(whole.hexdigest() if whole is not None else whole_sha256, size, tuple(chunks))


def missing(store: BlobStore, manifest: Manifest) -> list[str]:
    """The manifest's chunks the store does not hold (each key once)."""
    return [sha256 for sha256 in dict.fromkeys(chunk.sha256 for chunk in manifest.chunks)
            if not store.exists(sha256)]


def restore(store: BlobStore, manifest: Manifest, destination: str | os.PathLike) -> int:
    """Join the manifest's chunks into ``destination``, each checked: the file whole there, or nothing
    (HashMismatch, BlobMissing). Returns the bytes written."""
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=destination.parent, prefix=".restore-")
    whole, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as target:
            for chunk in manifest.chunks:
                data = store.read(chunk.sha256)  # checked against its key
                if len(data) != chunk.bytes:
                    raise HashMismatch(f"chunk {chunk.sha256} is {len(data)} bytes, the manifest says {chunk.bytes}")
                whole.update(data)
                size += len(data)
                target.write(data)
            target.flush()
            os.fsync(target.fileno())
        if whole.hexdigest() != manifest.sha256 or size != manifest.bytes:
            raise HashMismatch(f"the chunks joined do not hash to the checkpoint's sha256 {manifest.sha256}")
        os.replace(temporary, destination)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return size


def collect(store: BlobStore, referenced: set[str]) -> tuple[int, int]:
    """Delete every chunk no manifest names (``referenced``: the keys every kept manifest names); (count,
    bytes) deleted. The caller makes sure no manifest is being written meanwhile (see the jobs app's sweep)."""
    count = freed = 0
    for sha256 in list(store.keys()):
        if sha256 in referenced:
            continue
        try:
            size = store.size(sha256)
        except BlobMissing:
            continue
        store.delete(sha256)
        count += 1
        freed += size
    return count, freed


def distinct_bytes(manifests: Iterable[Manifest]) -> int:
    """What these manifests cost in the store: each chunk counted once."""
    seen: dict[str, int] = {}
    for manifest in manifests:
        for chunk in manifest.chunks:
            seen[chunk.sha256] = chunk.bytes
    return sum(seen.values())
