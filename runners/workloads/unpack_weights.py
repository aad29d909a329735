"""Unpack a model version's folder (kept as a .tar.gz) for a foreign engine: what a replica's pod runs in an init
container after its weights were fetched (or found in the node cache), before vLLM, TGI or SGLang starts on them.

    python -m runners.workloads.unpack_weights ARCHIVE DEST

The archive was checked against its sha256 by whoever put it where it is (the fetch, or the node cache's agent).
Its members are extracted with tarfile's "data" filter (members' leading slashes stripped; a path or link leaving
the folder, or a device file, refused; set-uid bits and others' write bits dropped), into a folder beside DEST,
renamed to DEST once whole: the engine never sees a partial folder. DEST already there (an init container run again) is kept. Exit 0 once DEST
holds the folder; 1 with one line on stderr saying why not.

Pure: the standard library only.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tarfile
from pathlib import Path


class UnpackError(Exception):
    """The archive cannot be unpacked as a model's folder."""


def unpack(archive: str | Path, dest: str | Path) -> bool:
    """Make ``dest`` the archive's folder; True when unpacked, False when already there."""
    archive, dest = Path(archive), Path(dest)
    if dest.is_dir():
        return False
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        with tarfile.open(archive, "r:gz") as folder:
            folder.extractall(partial, filter="data")
    except (tarfile.TarError, OSError, EOFError) as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise UnpackError(f"{archive} does not unpack as a model's folder: {exc}") from None
    partial.rename(dest)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archive")
    parser.add_argument("dest")
    args = parser.parse_args(argv)
    try:
        unpacked = unpack(args.archive, args.dest)
    except UnpackError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{'Unpacked' if unpacked else 'Already unpacked'}: {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
