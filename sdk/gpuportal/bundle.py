"""Code bundles: a project folder as a deterministic .tar.gz, its content digest, and reading one safely.

Standard library only: the `portal` CLI packs with it, the portal checks uploads with it, and the
cluster backends unpack with it.

- ``pack(folder)`` makes the same bytes from the same files every time: members sorted, regular files
  only (folders are implied by the paths), mtime 0, uid/gid 0 and no owner names, mode 0755 when the
  owner may execute the file and 0644 otherwise, gzip with mtime 0 and no file name. It skips ``.git/``
  and what the folder's ``.gitignore`` and ``.portalignore`` files say (those of subfolders too, for
  their own subfolder), and refuses links and special files.
- ``digest(archive)`` is the content digest: SHA-256 over the sorted files' paths, exec bits and bytes.
  Neither folders, times, owners nor compression count, so the folder packed by the CLI and by
  ``tar czf bundle.tar.gz -C folder .`` has the same digest.
- ``check(archive, ...)`` reads an archive once, as a stream, writing nothing, and refuses (a
  ``BundleError`` naming the member) ``..`` in a path, an absolute path, any link (symbolic or hard:
  a bundle holds no links at all), device files and FIFOs, more members than allowed, more bytes
  unpacked than allowed (``BundleTooLarge``, naming the largest files) and a compression ratio that
  says zip bomb.
- ``extract(archive, dest)`` checks, then unpacks into ``dest`` (tarfile's "data" filter as well), files
  read-only.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import shutil
import stat
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

IGNORE_FILES = (".gitignore", ".portalignore")  # read in this order: .portalignore has the last word
NEVER_PACKED = ".git"
CHUNK = 1024 * 1024
# gzip's own default: level 9 takes several times as long for a few per cent less.
COMPRESS_LEVEL = 6
# Below this many unpacked bytes no ratio is judged: small archives of repetitive text compress very well.
RATIO_FLOOR = 1024 * 1024
# What a tar stream may hold beyond its files' bytes: per member its header, its padding and a long-name
# (pax) header; and the end-of-archive blocks and record padding.
HEADER_ALLOWANCE = 4096
END_ALLOWANCE = 20 * 1024
NAME_MAX_BYTES = 255
PATH_MAX_CHARS = 1024
DEFAULT_MAX_BYTES = 100 * 1000 * 1000
DEFAULT_MAX_MEMBERS = 10000
DEFAULT_MAX_RATIO = 200


class BundleError(ValueError):
    """A member that may not be in a bundle (or the archive itself, named "archive"), and why."""

    def __init__(self, member: str, why: str):
        super().__init__(f"{member}: {why}")
        self.member = member
        self.why = why


class BundleTooLarge(BundleError):
    """The bundle unpacks to more than the limit: ``largest`` holds its largest files seen, (path, bytes)."""

    def __init__(self, member: str, why: str, *, limit: int, largest: list[tuple[str, int]]):
        super().__init__(member, why)
        self.limit = limit
        self.largest = largest


@dataclass(frozen=True)
class Member:
    """One file of a bundle: its path inside (POSIX, no leading ./), size, exec bit and SHA-256 (hex)."""

    path: str
    size: int
    executable: bool
    sha256: str


# --- Ignore patterns ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rule:
    base: str  # the folder of the ignore file, relative to the bundle ("" at its top)
    regex: re.Pattern
    negate: bool
    folders_only: bool


def _glob_to_regex(pattern: str) -> str:
    """A gitignore glob (already without its leading/trailing slash handling) as a regular expression body."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "*":
            if pattern.startswith("**", i):
                before_ok = i == 0 or pattern[i - 1] == "/"
                after = i + 2
                if before_ok and after == n:  # "a/**": everything inside
                    out.append(".*")
                    i = after
                    continue
                if before_ok and after < n and pattern[after] == "/":  # "**/" : zero or more folders
                    out.append("(?:.*/)?")
                    i = after + 1
                    continue
                while i < n and pattern[i] == "*":  # other runs of asterisks are one asterisk
                    i += 1
                out.append("[^/]*")
                continue
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[":
            end = i + 1
            if end < n and pattern[end] in "!^":
                end += 1
            if end < n and pattern[end] == "]":
                end += 1
            while end < n and pattern[end] != "]":
                end += 1
            if end >= n:  # no closing bracket: a literal "["
                out.append(re.escape(char))
            else:
                body = pattern[i + 1 : end]
                if body[:1] in ("!", "^"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = end
        elif char == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(char))
        i += 1
    return "".join(out)


def parse_ignore(text: str, base: str = "") -> list[_Rule]:
    """The rules of one ignore file (gitignore syntax), for paths relative to the bundle's top.

    Supported: comments (#), blank lines, ``!`` to take a path back, ``\\`` escapes, a trailing ``/``
    for folders only, a ``/`` at the start or in the middle anchoring the pattern to the file's folder
    (otherwise it matches at any depth), ``*``, ``?``, ``[...]`` and ``**`` (``**/x``, ``x/**``,
    ``x/**/y``). As in git, a file inside an ignored folder cannot be taken back.
    """
    rules = []
    for raw in text.splitlines():
        line = raw.rstrip("\r")
        # Trailing spaces are dropped unless the last one is escaped.
        stripped = line.rstrip(" ")
        if stripped.endswith("\\") and len(stripped) < len(line):
            stripped += " "
        line = stripped
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if negate:
            line = line[1:]
        elif line.startswith(("\\!", "\\#")):
            line = line[1:]
        folders_only = line.endswith("/") and not line.endswith("\\/")
        line = line.rstrip("/") if folders_only else line
        if not line:
            continue
        anchored = "/" in line
        line = line.lstrip("/") if anchored else line
        body = _glob_to_regex(line)
        regex = re.compile(("^" if anchored else "^(?:.*/)?") + body + "$", re.DOTALL)
        rules.append(_Rule(base=base, regex=regex, negate=negate, folders_only=folders_only))
    return rules


def ignored(rules: list[_Rule], path: str, is_folder: bool) -> bool:
    """Whether the rules (in the order read: the last that matches decides) ignore this path."""
    verdict = False
    for rule in rules:
        if rule.folders_only and not is_folder:
            continue
        if rule.base:
            if not path.startswith(rule.base + "/"):
                continue
            relative = path[len(rule.base) + 1 :]
        else:
            relative = path
        if rule.regex.match(relative):
            verdict = not rule.negate
    return verdict


# --- Packing -----------------------------------------------------------------------------------------


class _HashingReader(io.RawIOBase):
    """Reads a file for tarfile while hashing what was read."""

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self.hash = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.hash.update(data)
        return data


def _files(folder: Path, use_ignore: bool) -> list[tuple[str, Path, os.stat_result]]:
    """The folder's files to pack, (path inside, path on disk, stat), in no particular order."""
    found = []

    def walk(directory: Path, relative: str, rules: list[_Rule]) -> None:
        if use_ignore:
            rules = list(rules)
            for name in IGNORE_FILES:
                ignore_file = directory / name
                if ignore_file.is_file() and not ignore_file.is_symlink():
                    rules += parse_ignore(ignore_file.read_text(encoding="utf-8", errors="replace"), relative)
        with os.scandir(directory) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                path = f"{relative}/{entry.name}" if relative else entry.name
                if use_ignore and entry.name == NEVER_PACKED and entry.is_dir(follow_symlinks=False):
                    continue
                info = entry.stat(follow_symlinks=False)
                is_folder = stat.S_ISDIR(info.st_mode)
                if use_ignore and ignored(rules, path, is_folder):
                    continue
                if is_folder:
                    walk(Path(entry.path), path, rules)
                elif stat.S_ISLNK(info.st_mode):
                    raise BundleError(path, "is a symbolic link; a bundle holds no links: ignore it in "
                                            ".portalignore or put the file itself there")
                elif not stat.S_ISREG(info.st_mode):
                    raise BundleError(path, "is not a regular file (a device, FIFO or socket); ignore it in .portalignore")
                else:
                    found.append((path, Path(entry.path), info))

    walk(Path(folder), "", [])
    return found


def pack_to(folder: str | os.PathLike, out: BinaryIO, *, ignore: bool = True) -> list[Member]:
    """Write the folder's bundle (.tar.gz) to ``out``; the files it holds, sorted.

    ``ignore=True`` skips ``.git/`` and what ``.gitignore``/``.portalignore`` say; ``False`` packs every file.
    """
    files = sorted(_files(Path(folder), ignore), key=lambda item: item[0].encode("utf-8", "surrogateescape"))
    members = []
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=COMPRESS_LEVEL) as zipped, \
            tarfile.open(fileobj=zipped, mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8") as archive:
        for path, on_disk, info in files:
            _check_name(path, path)
            executable = bool(info.st_mode & stat.S_IXUSR)
            entry = tarfile.TarInfo(path)
            entry.size = info.st_size
            entry.mode = 0o755 if executable else 0o644
            entry.mtime = 0
            entry.uid = entry.gid = 0
            entry.uname = entry.gname = ""
            with open(on_disk, "rb") as handle:
                reader = _HashingReader(handle)
                archive.addfile(entry, reader)
            members.append(Member(path, info.st_size, executable, reader.hash.hexdigest()))
    return members


def pack(folder: str | os.PathLike, *, ignore: bool = True) -> bytes:
    """The folder's bundle as the bytes of a deterministic .tar.gz (see ``pack_to``)."""
    out = io.BytesIO()
    pack_to(folder, out, ignore=ignore)
    return out.getvalue()


# --- The digest --------------------------------------------------------------------------------------


def members_digest(members: list[Member]) -> str:
    """The content digest of a bundle's files: SHA-256 over, per file in the order of its path's UTF-8
    bytes, the path, a NUL, "755" or "644" (its exec bit), a NUL and the SHA-256 of its bytes."""
    total = hashlib.sha256()
    for member in sorted(members, key=lambda m: m.path.encode("utf-8")):
        total.update(member.path.encode("utf-8") + b"\0" + (b"755" if member.executable else b"644") + b"\0")
        total.update(bytes.fromhex(member.sha256))
    return total.hexdigest()


def digest(archive: bytes | BinaryIO) -> str:
    """The content digest of a .tar.gz (bytes or a binary file object), however it was packed.

    The archive is read as ``check`` reads it, without limits: a member no bundle may hold is a BundleError.
    """
    stream = io.BytesIO(archive) if isinstance(archive, (bytes, bytearray, memoryview)) else archive
    return members_digest(_scan(stream, max_bytes=None, max_members=None, max_ratio=None))


# --- Reading an archive safely -----------------------------------------------------------------------


class _Exceeded(Exception):
    """Raised from inside tarfile's reads; turned into a BundleError naming the member being read."""

    def __init__(self, why: str):
        self.why = why


class _Counting(io.RawIOBase):
    """The compressed bytes read so far."""

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.raw.read(len(buffer))
        buffer[: len(data)] = data
        self.count += len(data)
        return len(data)


class _Bounded(io.RawIOBase):
    """The unpacked tar stream, refused past ``limit`` bytes or past ``max_ratio`` to the compressed bytes."""

    def __init__(self, zipped: gzip.GzipFile, compressed: _Counting, limit: int | None, max_ratio: int | None):
        self.zipped, self.compressed, self.limit, self.max_ratio = zipped, compressed, limit, max_ratio
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.zipped.read(min(len(buffer), CHUNK))
        buffer[: len(data)] = data
        self.count += len(data)
        if self.limit is not None and self.count > self.limit:
            raise _Exceeded(f"the archive unpacks to more than {self.limit} bytes of tar headers and data")
        if (self.max_ratio is not None and self.count > RATIO_FLOOR
                and self.count > self.max_ratio * max(self.compressed.count, 1)):
            raise _Exceeded(f"compresses more than {self.max_ratio}:1, taken for a zip bomb")
        return len(data)


def _check_name(name: str, shown: str) -> str:
    """The member's path inside the bundle (no leading ./), or a BundleError saying what is wrong with it."""
    if name.startswith("/"):
        raise BundleError(shown, "is an absolute path; a bundle's paths are relative to its top")
    if re.search(r"[\x00-\x1f\x7f]", name):
        raise BundleError(shown, "has a control character in its name")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise BundleError(shown, "has a name that is not UTF-8") from None
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise BundleError(shown, "has '..' in its path, which could reach outside the bundle")
    if len(name) > PATH_MAX_CHARS or any(len(part.encode("utf-8")) > NAME_MAX_BYTES for part in parts):
        raise BundleError(shown, f"has a name too long (paths up to {PATH_MAX_CHARS} characters, names up to {NAME_MAX_BYTES} bytes)")
    return "/".join(parts)


def _largest(sizes: list[tuple[str, int]], count: int = 5) -> list[tuple[str, int]]:
    return sorted(sizes, key=lambda item: (-item[1], item[0]))[:count]


def stream_bound(max_bytes: int, max_members: int) -> int:
    """The most bytes a tar stream within these limits can hold: its files and, per member, its headers."""
    return max_bytes + max_members * HEADER_ALLOWANCE + END_ALLOWANCE


def archive_bound(max_bytes: int, max_members: int) -> int:
    """The largest .tar.gz within these limits can be: gzip adds at most a few bytes per 16 KiB stored."""
    return stream_bound(max_bytes, max_members) * 1001 // 1000 + 64 * 1024


def _scan(stream: BinaryIO, *, max_bytes: int | None, max_members: int | None, max_ratio: int | None) -> list[Member]:
    compressed = _Counting(stream)
    bound = None if max_bytes is None else stream_bound(max_bytes, max_members or DEFAULT_MAX_MEMBERS)
    unpacked = _Bounded(gzip.GzipFile(fileobj=io.BufferedReader(compressed), mode="rb"), compressed, bound, max_ratio)
    members: list[Member] = []
    files: dict[str, int] = {}
    folders: set[str] = set()
    total = 0
    current = "archive"
    try:
        with tarfile.open(fileobj=unpacked, mode="r|", encoding="utf-8") as archive:
            for count, info in enumerate(archive, start=1):
                current = info.name
                if max_members is not None and count > max_members:
                    raise BundleError(info.name, f"is past the limit of {max_members} members (files and folders)")
                path = _check_name(info.name, info.name)
                if info.issym() or info.islnk():
                    kind = "a symbolic link" if info.issym() else "a hard link"
                    raise BundleError(info.name, f"is {kind} (to {info.linkname}); a bundle holds no links")
                if info.ischr() or info.isblk():
                    raise BundleError(info.name, "is a device file; a bundle holds files and folders only")
                if info.isfifo():
                    raise BundleError(info.name, "is a FIFO; a bundle holds files and folders only")
                if not info.isdir() and not info.isreg():
                    raise BundleError(info.name, f"is not a regular file or folder (tar type {info.type!r})")
                if info.isreg() and not path:
                    raise BundleError(info.name, "is a file without a name")
                if path in files:
                    raise BundleError(info.name, "appears twice" if info.isreg() else "is both a file and a folder")
                if info.isreg() and path in folders:
                    raise BundleError(info.name, "is both a file and a folder")
                parents = path.split("/")[:-1]
                for depth in range(1, len(parents) + 1):
                    parent = "/".join(parents[:depth])
                    if parent in files:
                        raise BundleError(info.name, f"is inside {parent}, which is a file")
                    folders.add(parent)
                if info.isdir():
                    folders.add(path)
                    continue
                files[path] = info.size
                total += info.size
                if max_bytes is not None and total > max_bytes:
                    largest = _largest(list(files.items()))
                    named = ", ".join(f"{name} ({size} bytes)" for name, size in largest)
                    raise BundleTooLarge(info.name, f"unpacked, the bundle is over the limit of {max_bytes} bytes; "
                                                    f"its largest files: {named}", limit=max_bytes, largest=largest)
                hashed = hashlib.sha256()
                data = archive.extractfile(info)
                while chunk := data.read(CHUNK):
                    hashed.update(chunk)
                member = Member(path, info.size, bool(info.mode & stat.S_IXUSR), hashed.hexdigest())
                members.append(member)
    except _Exceeded as exc:
        raise BundleError(current, exc.why) from None
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise BundleError(current, f"the archive is not a readable .tar.gz ({exc})") from None
    return members


def check(fileobj: BinaryIO, *, max_bytes: int = DEFAULT_MAX_BYTES, max_members: int = DEFAULT_MAX_MEMBERS,
          max_ratio: int = DEFAULT_MAX_RATIO) -> list[Member]:
    """Read a .tar.gz once, as a stream, writing nothing: its files, or a BundleError naming the first
    member a bundle may not hold (BundleTooLarge past ``max_bytes`` unpacked)."""
    return _scan(fileobj, max_bytes=max_bytes, max_members=max_members, max_ratio=max_ratio)


def extract(fileobj: BinaryIO, dest: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_BYTES,
            max_members: int = DEFAULT_MAX_MEMBERS, max_ratio: int = DEFAULT_MAX_RATIO) -> list[Member]:
    """Check the archive, then unpack it into ``dest`` (made if missing; it must be empty), files read-only.

    Nothing is written unless the whole archive passes ``check``. A file object that cannot seek is
    copied to a temporary file first (it is read twice)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise ValueError(f"{dest} is not empty; a bundle is unpacked into an empty folder")
    spooled = None
    if not (fileobj.seekable() if hasattr(fileobj, "seekable") else False):
        spooled = tempfile.TemporaryFile()
        shutil.copyfileobj(fileobj, spooled, CHUNK)
        spooled.seek(0)
        fileobj = spooled
    try:
        start = fileobj.tell()
        members = check(fileobj, max_bytes=max_bytes, max_members=max_members, max_ratio=max_ratio)
        fileobj.seek(start)
        compressed = _Counting(fileobj)
        bound = stream_bound(max_bytes, max_members)
        unpacked = _Bounded(gzip.GzipFile(fileobj=io.BufferedReader(compressed), mode="rb"), compressed, bound, max_ratio)
        with tarfile.open(fileobj=unpacked, mode="r|", encoding="utf-8") as archive:
            expected = {member.path for member in members}
            for info in archive:
                path = _check_name(info.name, info.name)
                if info.isdir():
                    continue
                if path not in expected or not info.isreg():  # the archive changed between the two reads
                    raise BundleError(info.name, "changed while it was being unpacked")
                info.name = path
                if hasattr(tarfile, "data_filter"):
                    archive.extract(info, dest, filter="data")
                else:  # Python without extraction filters: the checks above already refused what it would
                    archive.extract(info, dest)
    except _Exceeded as exc:
        raise BundleError("archive", exc.why) from None
    finally:
        if spooled is not None:
            spooled.close()
    for member in members:
        (dest / member.path).chmod(0o555 if member.executable else 0o444)
    return members
