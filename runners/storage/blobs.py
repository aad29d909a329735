"""A content-addressed blob store on fsspec: a blob's key is the sha256 of its bytes.

One store holds dataset shards, checkpoint chunks and model weights, each kind under its own prefix
(``<root>/<kind>/<sha[:2]>/<sha>``). The same bytes are stored once whoever writes them, so a shard two
tenants' datasets share, or a frozen base model under every checkpoint of a fine-tune, costs its bytes
once; who may read a blob is decided above this module, by the rows that name it.

What holds:

- a blob is either whole under its key or absent: in a folder it is written to a temporary name and
  renamed; in a bucket one put is atomic;
- a blob is never served unchecked: ``fetch`` hashes what it reads and raises ``HashMismatch`` (and
  leaves nothing at the destination) when the bytes are not the key's.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

CHUNK = 1 << 20
SHA256 = re.compile(r"^[0-9a-f]{64}$")


class HashMismatch(Exception):
    """The bytes read for a key are not the bytes the key names."""


class BlobMissing(Exception):
    """No blob under that key."""


def sha256_file(path: str | os.PathLike) -> tuple[str, int]:
    """(sha256 hex, size) of a file."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def _check_key(sha256: str) -> str:
    if not SHA256.match(sha256 or ""):
        raise ValueError(f"not a sha256 key: {sha256!r}")
    return sha256


class BlobStore:
    """Blobs of one kind (``kind``: "shards", "chunks", "models", ...) in the store at ``url``."""

    def __init__(self, url: str, kind: str, options: dict | None = None):
        self.fs, root = fsspec.core.url_to_fs(url, **(options or {}))
        self.root = f"{root.rstrip('/')}/{kind}"
        self.url = url
        self.kind = kind

    def path(self, sha256: str) -> str:
        _check_key(sha256)
        return f"{self.root}/{sha256[:2]}/{sha256}"

    def exists(self, sha256: str) -> bool:
        return self.fs.exists(self.path(sha256))

    def size(self, sha256: str) -> int:
        try:
            return int(self.fs.size(self.path(sha256)))
        except FileNotFoundError:
            raise BlobMissing(sha256) from None

    def put_bytes(self, data: bytes) -> tuple[str, int]:
        """Store these bytes; (sha256, size). Storing bytes already there writes nothing."""
        sha256 = hashlib.sha256(data).hexdigest()
        self.put_hashed(data, sha256)
        return sha256, len(data)

    def put_file(self, source: str | os.PathLike, sha256: str | None = None) -> tuple[str, int]:
        """Store a local file; (sha256, size). ``sha256``, when the caller has it already, is checked."""
        actual, size = sha256_file(source)
        if sha256 is not None and sha256 != actual:
            raise HashMismatch(f"{source} hashes to {actual}, not {sha256}")
        self.put_file_hashed(source, actual)
        return actual, size

    def put_hashed(self, data: bytes | memoryview, sha256: str) -> bool:
        """Store bytes under the sha256 the caller took of these very bytes (it hashed them as it cut or received
        them), without hashing them again; whether anything was written (False: the store had them)."""
        if self.exists(sha256):
            return False
        self._put(sha256, lambda target: target.write(data))
        return True

    def put_file_hashed(self, source: str | os.PathLike, sha256: str) -> bool:
        """Store a local file under the sha256 the caller took of its bytes as it wrote them, without reading it
        twice for the hash; whether anything was written."""
        if self.exists(sha256):
            return False

        def copy(target: BinaryIO) -> None:
            with open(source, "rb") as handle:
                for block in iter(lambda: handle.read(CHUNK), b""):
                    target.write(block)

        self._put(_check_key(sha256), copy)
        return True

    def _put(self, sha256: str, write) -> None:
        final = self.path(sha256)
        if isinstance(self.fs, LocalFileSystem):
            folder = Path(final).parent
            folder.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=folder, prefix=".part-")
            try:
                with os.fdopen(fd, "wb") as target:
                    write(target)
                    target.flush()
                    os.fsync(target.fileno())
                os.replace(temporary, final)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        else:
            # One put of a bucket's object is atomic: readers see the old state or the whole blob.
            spool = Path(tempfile.gettempdir()) / f"blob-{uuid.uuid4().hex}"
            try:
                with open(spool, "wb") as target:
                    write(target)
                self.fs.put_file(str(spool), final)
            finally:
                spool.unlink(missing_ok=True)

    def open(self, sha256: str) -> BinaryIO:
        """The blob for reading, unchecked (``fetch`` checks); BlobMissing when absent."""
        try:
            return self.fs.open(self.path(sha256), "rb")
        except FileNotFoundError:
            raise BlobMissing(sha256) from None

    def read(self, sha256: str) -> bytes:
        """The blob's bytes, checked against the key."""
        with self.open(sha256) as handle:
            data = handle.read()
        if hashlib.sha256(data).hexdigest() != sha256:
            raise HashMismatch(f"{self.kind} blob {sha256} does not hash to its key")
        return data

    def fetch(self, sha256: str, destination: str | os.PathLike) -> int:
        """Copy the blob to a local file, checked on the way: whole at ``destination`` or nothing there
        (HashMismatch, BlobMissing). Returns the bytes copied."""
        destination = Path(destination)
        destination.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=destination.parent, prefix=".fetch-")
        digest, size = hashlib.sha256(), 0
        try:
            with os.fdopen(fd, "wb") as target, self.open(sha256) as source:
                for block in iter(lambda: source.read(CHUNK), b""):
                    digest.update(block)
                    size += len(block)
                    target.write(block)
            if digest.hexdigest() != sha256:
                raise HashMismatch(f"{self.kind} blob {sha256} does not hash to its key")
            os.replace(temporary, destination)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        return size

    def delete(self, sha256: str) -> None:
        try:
            self.fs.rm_file(self.path(sha256))
        except FileNotFoundError:
            pass

    def keys(self) -> Iterator[str]:
        """Every key stored (for sweeps that collect blobs no row names any more)."""
        try:
            found = self.fs.find(self.root)
        except FileNotFoundError:
            return
        for path in found:
            name = path.rsplit("/", 1)[-1]
            if SHA256.match(name):
                yield name
