"""Fetch a model version's weights into a file, checked: what an inference replica's pod runs before its server
(its init container) where it does not read them from the node cache; the download is gpuportal.fetch's.

    python -m runners.workloads.fetch_weights URL DEST --sha256 HEX --bytes N

URL is the portal's signed URL for the replica's attempt (the pod holds no storage credentials). The download is
streamed into a temporary file beside DEST, hashed as it arrives and cut off past N bytes; only bytes whose size
is N and whose sha256 is HEX are moved to DEST (a rename: the server never sees a partial file). DEST already holding
them (a pod whose init container runs again) is kept without a download. Exit 0 once DEST holds the weights; 1
with one line on stderr saying why not. A URL that cannot be read is tried again a few times (the portal may be
restarting); an expired, forged or unknown one (a 4xx) is not.

Pure: the SDK (gpuportal.fetch) and runners.storage, which the workloads' image carries.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from gpuportal import fetch as fetch_tool

from runners.storage.blobs import sha256_file

TRIES = fetch_tool.TRIES
FIRST_WAIT_S = fetch_tool.FIRST_WAIT_S
SHA256 = re.compile(r"^[0-9a-f]{64}$")


# The weights' errors are the bundle fetch's: one download, retried, hashed and renamed into place.
FetchError = fetch_tool.FetchError


def fetch(url: str, dest: str | Path, *, sha256: str, size: int, tries: int = TRIES,
          first_wait_s: float = FIRST_WAIT_S) -> bool:
    """Make ``dest`` hold the weights (sha256, size) from ``url``; True when downloaded, False when already there."""
    if not SHA256.match(sha256):
        raise FetchError(f"{sha256!r} is not a sha256 (64 lowercase hex digits).")
    if not url.startswith(("https://", "http://")):
        raise FetchError(f"{url!r} is not an http(s) URL.")
    dest = Path(dest)
    if dest.is_file() and dest.stat().st_size == size and sha256_file(dest)[0] == sha256:
        return False
    fetch_tool.download_checked(url, dest, sha256=sha256, size=size, tries=tries, first_wait_s=first_wait_s,
                                what="weights file")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.workloads.fetch_weights",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("url", help="The portal's signed URL of the weights.")
    parser.add_argument("dest", help="The file to write them to.")
    parser.add_argument("--sha256", required=True, help="The weights' sha256; the bytes must match it.")
    parser.add_argument("--bytes", type=int, required=True, help="The weights' size; the bytes must match it.")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        fetched = fetch(args.url, args.dest, sha256=args.sha256, size=args.bytes)
    except FetchError as exc:
        print(f"fetch_weights: {exc}", file=sys.stderr)
        return 1
    what = "fetched" if fetched else "already there"
    print(f"fetch_weights: {args.bytes} bytes of weights {args.sha256} {what} in {args.dest} "
          f"({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
