"""Fetch a bundle's archive and unpack it: what a script job's pod runs before its command (its init container).

    python -m gpuportal.fetch URL DEST [--sha256 HEX]

URL is on Kubernetes the portal's signed https URL for the attempt (the pod holds no storage credentials),
read with the standard library; any other fsspec URL (file://, s3://) is read with fsspec when it is installed. The archive is copied to a temporary file (at most
--max-bytes), its content digest is checked against --sha256 when given (gpuportal.bundle.digest: the
same files give the same digest however they were packed), then gpuportal.bundle.extract unpacks it into
DEST, refusing any member that would land outside it. Exit 0 once DEST holds the bundle; 1 with one line
on stderr saying why not. A URL that cannot be read is tried again a few times (the portal may be
restarting), an expired or unknown one is not.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from gpuportal import bundle

HTTP_TIMEOUT_S = 60
# Far above any bundle the portal keeps (BUNDLE_MAX_BYTES): only a guard against a runaway download.
DEFAULT_MAX_BYTES = 2 * 1024**3
TRIES = 5
FIRST_WAIT_S = 1.0
CHUNK = 1024 * 1024


class FetchError(Exception):
    """The bundle could not be fetched or is not the one asked for; the message says why."""


class DigestMismatch(FetchError):
    """The bytes fetched are not the ones asked for (their sha256 differs): they are never used."""


def _final(exc: BaseException) -> bool:
    """Whether trying again cannot help: the URL is unknown, expired or refused (a 4xx), or names no file."""
    if isinstance(exc, urllib.error.HTTPError):
        return 400 <= exc.code < 500
    return isinstance(exc, (FileNotFoundError, PermissionError, ImportError, ValueError))


def _open(url: str):
    """The archive at `url` as a binary stream: http(s) through the standard library, anything else through fsspec."""
    if url.startswith(("https://", "http://")):
        return urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S)  # noqa: S310 (the scheme is checked above)
    import fsspec  # only for storage URLs: an https URL needs nothing beyond the standard library

    return fsspec.open(url, "rb").open()


def download(url: str, into, *, max_bytes: int = DEFAULT_MAX_BYTES, tries: int = TRIES,
             first_wait_s: float = FIRST_WAIT_S, what: str = "bundle") -> int:
    """Copy the `what` at `url` (a bundle's archive by default) into the binary file `into` (from its start);
    returns its size."""
    wait = first_wait_s
    for attempt in range(1, tries + 1):
        into.seek(0)
        into.truncate()
        size = 0
        try:
            with _open(url) as source:
                while chunk := source.read(CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise FetchError(f"The {'archive' if what == 'bundle' else what} is larger than "
                                         f"{max_bytes} bytes.")
                    into.write(chunk)
            into.flush()
            return size
        except FetchError:
            raise
        except Exception as exc:  # urllib's and fsspec's filesystems' own kinds: OSError, HTTPError, botocore's
            if _final(exc) or attempt == tries:
                raise FetchError(f"Could not read the {what} ({type(exc).__name__}: {exc}).") from exc
            time.sleep(wait)
            wait *= 2
    raise AssertionError("unreachable")


class _Hashed:
    """A binary file that hashes what is written to it, from its start again whenever download() starts over."""

    def __init__(self, target):
        self.target, self.digest = target, hashlib.sha256()

    def seek(self, offset: int) -> None:
        self.target.seek(offset)
        self.digest = hashlib.sha256()

    def truncate(self) -> None:
        self.target.truncate()

    def write(self, chunk: bytes) -> None:
        self.digest.update(chunk)
        self.target.write(chunk)

    def flush(self) -> None:
        self.target.flush()


def download_checked(url: str, dest: str | Path, *, sha256: str, size: int | None = None,
                     max_bytes: int = DEFAULT_MAX_BYTES, tries: int = TRIES, first_wait_s: float = FIRST_WAIT_S,
                     what: str = "file") -> int:
    """Make `dest` hold the bytes at `url` whose sha256 is `sha256` (and whose size is `size`, when given):
    downloaded with download()'s retries into a temporary file beside `dest`, hashed as they arrive, and renamed
    into place only when they match, so nothing partial or wrong is ever at `dest` (FetchError otherwise).
    Returns the size."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        with os.fdopen(fd, "wb") as target:
            hashed = _Hashed(target)
            got = download(url, hashed, max_bytes=max_bytes if size is None else size, tries=tries,
                           first_wait_s=first_wait_s, what=what)
            os.fsync(target.fileno())
        if size is not None and got != size:
            raise FetchError(f"Got {got} bytes, not the {what}'s {size}.")
        if hashed.digest.hexdigest() != sha256:
            raise DigestMismatch(f"The bytes' sha256 is {hashed.digest.hexdigest()}, not the {what}'s {sha256}.")
        os.replace(temporary, dest)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return got


def fetch(url: str, dest: str | Path, *, sha256: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
          tries: int = TRIES, first_wait_s: float = FIRST_WAIT_S) -> Path:
    """Download the archive at `url`, check its digest against `sha256` (when given) and unpack it into `dest`."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as archive:
        download(url, archive, max_bytes=max_bytes, tries=tries, first_wait_s=first_wait_s)
        if sha256 is not None:
            archive.seek(0)
            found = bundle.digest(archive)
            if found != sha256:
                raise FetchError(f"The archive's digest is {found}, not the bundle's {sha256}.")
        archive.seek(0)
        try:
            bundle.extract(archive, dest)
        except bundle.BundleError as exc:
            raise FetchError(f"The archive was refused: {exc}") from exc
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuportal.fetch", description=__doc__.splitlines()[0])
    parser.add_argument("url", help="Where the archive is (an fsspec URL: https://, file://, s3://).")
    parser.add_argument("dest", help="The folder to unpack it into.")
    parser.add_argument("--sha256", help="The bundle's content digest; the archive must match it.")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="Refuse a larger archive.")
    args = parser.parse_args(argv)
    try:
        fetch(args.url, args.dest, sha256=args.sha256, max_bytes=args.max_bytes)
    except FetchError as exc:
        print(f"gpuportal.fetch: {exc}", file=sys.stderr)
        return 1
    files = sum(1 for path in Path(args.dest).rglob("*") if path.is_file())
    print(f"gpuportal.fetch: {files} files of bundle {args.sha256 or '(digest not checked)'} in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
