"""`portal data`: push a folder as a new version of a dataset, register one from a storage URL, list datasets,
show one, share one.

A push packs the folder into WebDataset shards on this machine (gpuportal.datasets: the same files always
make the same shards), opens a version for that shard list (the portal answers the open version of the
same list when an earlier push was cut, so a push resumes), declares the shards, uploads only those the
portal lacks, each from the byte it has of it, and seals the version. Until the seal nobody sees the
version; after it, it never changes.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from gpuportal import datasets as packing
from gpuportal.cli.shared import (
    JsonFlag,
    TenantOption,
    connect,
    err,
    handled,
    name_and_version,
    out,
    print_json,
    progress_bar,
    resolve_tenant,
)
from gpuportal.client import EXIT_BAD_INPUT, EXIT_JOB_FAILED, Client, PortalError

app = typer.Typer(name="data", no_args_is_help=True, help="Datasets: push a folder, register a URL, list, show, share.")

DECLARE_BATCH = 500


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{size} B"


def push(client: Client, tenant: str, folder: Path, name: str, *, shard_bytes: int = packing.DEFAULT_SHARD_BYTES,
         work_dir: Path | None = None, progress: Callable[[int, int], None] | None = None,
         say: Callable[[str], None] = lambda text: None) -> dict:
    """Pack `folder` and push it as a new version of `name` (created when the tenant has none): the sealed
    version. `progress(sent, total)` is told the bytes uploaded so far of what the portal lacked."""
    try:
        members = packing.folder_members(folder)
    except packing.DatasetError as exc:
        raise PortalError(str(exc), EXIT_BAD_INPUT) from None
    try:
        client.dataset(tenant, name)
    except PortalError as exc:
        if exc.status != 404:
            raise
        client.dataset_create(tenant, name)
        say(f"Created dataset {name} in {tenant}.")
    with tempfile.TemporaryDirectory(prefix="portal-data-", dir=work_dir) as work:
        try:
            shards = packing.pack(members, work, shard_bytes)
        except packing.DatasetError as exc:
            raise PortalError(str(exc), EXIT_BAD_INPUT) from None
        digest = packing.manifest_sha256((shard.sha256, shard.bytes) for shard in shards)
        version = client.dataset_version_open(tenant, name, digest)
        number, part_bytes = version["number"], int(version["part_bytes"])
        missing: list[dict] = []
        for start in range(0, len(shards), DECLARE_BATCH):
            batch = [{"position": position, "sha256": shard.sha256, "bytes": shard.bytes, "samples": shard.samples}
                     for position, shard in enumerate(shards[start:start + DECLARE_BATCH], start)]
            missing = client.dataset_shards_declare(tenant, name, number, batch)
        by_sha = {shard.sha256: shard for shard in shards}
        todo = {entry["sha256"]: int(entry["received_bytes"]) for entry in missing}
        total = sum(by_sha[sha].bytes for sha in todo)
        sent = sum(todo.values())
        say(f"{len(shards)} shards ({_human(sum(s.bytes for s in shards))}); the portal lacks {len(todo)}"
            + (f", {_human(sent)} of them already sent" if sent else "") + ".")
        if progress:
            progress(sent, total)
        for sha256, offset in todo.items():
            shard = by_sha[sha256]
            with open(shard.path, "rb") as handle:
                while offset < shard.bytes:
                    handle.seek(offset)
                    data = handle.read(part_bytes)
                    try:
                        answer = client.dataset_shard_part(tenant, name, number, sha256, offset, data)
                    except PortalError as exc:
                        if exc.status != 409:
                            raise
                        # The portal has another count of this shard (a part sent twice): go on from what it has.
                        again = {e["sha256"]: int(e["received_bytes"]) for e in client.dataset_shards_declare(
                            tenant, name, number, [])}
                        if sha256 not in again:
                            break
                        sent += again[sha256] - offset
                        offset = again[sha256]
                        continue
                    sent += int(answer["received_bytes"]) - offset
                    offset = int(answer["received_bytes"])
                    if progress:
                        progress(sent, total)
        return client.dataset_seal(tenant, name, number, len(shards))


@app.command("push")
@handled
def push_command(
    folder: Annotated[Path, typer.Argument(help="The folder whose files make the version.", show_default=False)],
    name: Annotated[str, typer.Argument(help="The dataset's name (made when the tenant has none).", show_default=False)],
    tenant: TenantOption = None,
    shard_mb: Annotated[int, typer.Option("--shard-mb", min=1, max=4096, help="Shards of at most this many MB.")] = 64,
    as_json: JsonFlag = False,
) -> None:
    """Push a folder as a new version of a dataset: only the shards the portal lacks are sent; run it again after a
    cut and it resumes."""
    with connect() as client:
        slug = resolve_tenant(client, tenant)
        with progress_bar() as bar:
            task = bar.add_task(f"pushing {name}", total=None)

            def progress(sent: int, total: int) -> None:
                bar.update(task, completed=sent, total=total)

            version = push(client, slug, folder, name, shard_bytes=shard_mb * 1000 * 1000, progress=progress,
                           say=err.print)
    if as_json:
        print_json(version)
        return
    err.print(f"Sealed {name}:{version['number']} ({version['shards']} shards, {version['files']} files, "
              f"{_human(version['bytes'])}).")


def register(client: Client, tenant: str, url: str, name: str, *, say: Callable[[str], None] = lambda text: None) -> dict:
    """Ask the portal to pack the files under `url` (s3://bucket/prefix/ or file:///folder/, one of the portal's
    DATASET_SOURCE_URLS) as a new version of `name` (created when the tenant has none): the version, still open
    (a worker packs it)."""
    try:
        client.dataset(tenant, name)
    except PortalError as exc:
        if exc.status != 404:
            raise
        client.dataset_create(tenant, name)
        say(f"Created dataset {name} in {tenant}.")
    return client.dataset_register(tenant, name, url)


def registered(client: Client, tenant: str, name: str, number: int, *, timeout_s: float, poll_s: float = 2.0) -> dict:
    """The version once it is sealed; PortalError (exit 1) saying why when it failed, or when it is still being packed
    after `timeout_s` (it goes on: `portal data show NAME:N` tells later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        version = client.dataset_version(tenant, name, number)
        if version["state"] == "sealed":
            return version
        if version["state"] == "failed":
            raise PortalError(f"{name}:{number} failed: {version.get('reason') or 'no reason given'}", EXIT_JOB_FAILED)
        if time.monotonic() >= deadline:
            raise PortalError(f"{name}:{number} is still being packed after {timeout_s:.0f} s; `portal data show "
                              f"{name}:{number}` tells when it is sealed.", EXIT_JOB_FAILED)
        time.sleep(poll_s)


@app.command("register")
@handled
def register_command(
    url: Annotated[str, typer.Argument(help="Where the files are: s3://bucket/prefix/ or file:///folder/ (one of the "
                                            "portal's DATASET_SOURCE_URLS).", show_default=False)],
    name: Annotated[str, typer.Argument(help="The dataset's name (made when the tenant has none).", show_default=False)],
    tenant: TenantOption = None,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="Wait until the version is sealed or failed.")] = True,
    timeout_s: Annotated[int, typer.Option("--timeout", min=0, help="Wait at most this many seconds.")] = 3600,
    as_json: JsonFlag = False,
) -> None:
    """Register the files under a storage URL as a new version of a dataset: the portal reads, packs and seals them
    (exit 1 when it cannot, with the reason)."""
    with connect() as client:
        slug = resolve_tenant(client, tenant)
        version = register(client, slug, url, name, say=err.print)
        err.print(f"{name}:{version['number']} is registered from {version['source']}; the portal packs it.")
        if wait:
            version = registered(client, slug, name, version["number"], timeout_s=timeout_s)
    if as_json:
        print_json(version)
        return
    if version["state"] == "sealed":
        err.print(f"Sealed {name}:{version['number']} ({version['shards']} shards, {version['files']} files, "
                  f"{_human(version['bytes'])}).")


@app.command("ls")
@handled
def list_command(tenant: TenantOption = None, as_json: JsonFlag = False) -> None:
    """The datasets your tenant reads: its own and those shared with it."""
    with connect() as client:
        datasets = client.datasets(resolve_tenant(client, tenant))
    if as_json:
        print_json(datasets)
        return
    table = Table("name", "latest", "shards", "files", "size", "shared with", box=None)
    for dataset in datasets:
        latest = dataset.get("latest_version") or {}
        table.add_row(dataset["reference"], str(latest.get("number", "-")), str(latest.get("shards", "-")),
                      str(latest.get("files", "-")), _human(latest["bytes"]) if latest else "-",
                      ", ".join(dataset.get("shared_with") or []))
    out.print(table)


@app.command("show")
@handled
def show_command(
    reference: Annotated[str, typer.Argument(help="NAME, NAME:VERSION, or OWNER/NAME[:VERSION] for one shared with you.",
                                             show_default=False)],
    tenant: TenantOption = None,
    as_json: JsonFlag = False,
) -> None:
    """A dataset and its versions, or one version and the jobs that used it."""
    name, number = name_and_version(reference)
    with connect() as client:
        slug = resolve_tenant(client, tenant)
        data = client.dataset_version(slug, name, number) if number is not None else client.dataset(slug, name)
    if as_json:
        print_json(data)
        return
    if number is not None:
        out.print(f"{data['dataset']}:{data['number']}  {data['state']}  {data['shards']} shards, {data['files']} files, "
                  f"{data['samples']} samples, {_human(data['bytes'])}  from {data['source']}")
        for use in data.get("jobs") or []:
            read = f"read {use['read_at']}" if use.get("read_at") else "not read yet"
            out.print(f"  used by job {use['job_id']} {use['job_name']} ({read})")
        return
    out.print(f"{data['reference']} (owner {data['owner']})" + (f": {data['description']}" if data["description"] else ""))
    if data.get("shared_with"):
        out.print(f"shared with {', '.join(data['shared_with'])}")
    table = Table("version", "shards", "files", "samples", "size", "sealed", box=None)
    for version in data.get("versions") or []:
        table.add_row(str(version["number"]), str(version["shards"]), str(version["files"]), str(version["samples"]),
                      _human(version["bytes"]), (version.get("sealed_at") or "")[:19])
    out.print(table)


@app.command("share")
@handled
def share_command(
    name: Annotated[str, typer.Argument(help="Your tenant's dataset.", show_default=False)],
    other: Annotated[str, typer.Argument(metavar="TENANT", help="The tenant to share it with, read-only.",
                                         show_default=False)],
    tenant: TenantOption = None,
) -> None:
    """Share a dataset read-only with another tenant (admins)."""
    with connect() as client:
        client.dataset_share(resolve_tenant(client, tenant), name, other)
    err.print(f"{name} is shared with {other}, read-only.")
