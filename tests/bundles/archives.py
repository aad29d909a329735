"""Archives made in the tests: a .tar.gz of chosen members, hostile ones included, and a folder to pack."""

import gzip
import io
import tarfile
from pathlib import Path


def member(name: str, data: bytes = b"", *, kind: bytes = tarfile.REGTYPE, mode: int = 0o644,
           linkname: str = "", size: int | None = None) -> tuple[tarfile.TarInfo, io.RawIOBase | None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.linkname = linkname
    if kind in (tarfile.REGTYPE, tarfile.AREGTYPE):
        info.size = len(data) if size is None else size
        return info, io.BytesIO(data)
    return info, None


def targz(*members, compresslevel: int = 6) -> bytes:
    """The members (``member(...)`` or (TarInfo, file object) pairs) as a .tar.gz."""
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=compresslevel) as zipped, \
            tarfile.open(fileobj=zipped, mode="w|", format=tarfile.PAX_FORMAT) as archive:
        for info, data in members:
            archive.addfile(info, data)
    return out.getvalue()


class Zeros(io.RawIOBase):
    """`size` zero bytes, made as they are read (a large file without holding it in memory)."""

    def __init__(self, size: int):
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = min(len(buffer), self.left)
        buffer[:count] = bytes(count)
        self.left -= count
        return count


def zero_bomb(size: int) -> bytes:
    """One file of `size` zeros, compressed (about a thousandth of its size)."""
    info = tarfile.TarInfo("weights.bin")
    info.size = size
    return targz((info, Zeros(size)), compresslevel=1)


class OneWay(io.RawIOBase):
    """A stream that can be read once and never sought, counting what was read."""

    def __init__(self, data: bytes):
        self.data = io.BytesIO(data)
        self.read_bytes = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readinto(self, buffer) -> int:
        chunk = self.data.read(len(buffer))
        buffer[: len(chunk)] = chunk
        self.read_bytes += len(chunk)
        return len(chunk)


def project(root: Path) -> Path:
    """A small project folder: code, a script with its exec bit, data in a subfolder, requirements."""
    (root / "sub").mkdir(parents=True)
    (root / "train.py").write_text("print('training')\n")
    (root / "run.sh").write_text("#!/bin/sh\npython train.py\n")
    (root / "run.sh").chmod(0o755)
    (root / "sub" / "data.csv").write_text("a,b\n1,2\n")
    (root / "requirements.txt").write_text("numpy\n")
    return root


def stored_files(folder: Path) -> list[str]:
    """Every file under a storage folder (temporary ones included), relative to it."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.exists() else []
