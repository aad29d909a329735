"""`portal storage`: a tenant's checkpoint storage. Show what the store holds after deduplication against the
quota and the retention policy; preview what a proposed policy would delete and free; then save it."""

from __future__ import annotations

from typing import Annotated

import typer

from gpuportal.cli.shared import JsonFlag, TenantOption, connect, err, handled, out, print_json, resolve_tenant

app = typer.Typer(name="storage", no_args_is_help=True,
                  help="Checkpoint storage: usage after deduplication, quota, retention policy and its preview.")

Count = Annotated[int | None, typer.Option(min=0, help="Empty: this rule is off.", show_default=False)]
JobOption = Annotated[int | None, typer.Option("--job", min=1, help="Preview the policy as this job's own.",
                                               show_default=False)]


def _size(size: int | None) -> str:
    if size is None:
        return "no limit"
    value = float(size)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{size} B"


def _policy_text(policy: dict | None) -> str:
    if not policy:
        return "keep everything"
    rules = [f"{name.removeprefix('keep_')} {policy[name]}" for name in ("keep_newest", "keep_best", "keep_every")
             if policy.get(name) is not None]
    return "keep " + ", ".join(rules) if rules else "keep everything"


def _policy(keep_newest, keep_best, keep_every) -> dict | None:
    chosen = {"keep_newest": keep_newest, "keep_best": keep_best, "keep_every": keep_every}
    return None if all(value is None for value in chosen.values()) else chosen


@app.command("show")
@handled
def show_command(tenant: TenantOption = None, as_json: JsonFlag = False) -> None:
    """What the checkpoint store holds of your tenant (after deduplication), its quota and retention policy."""
    with connect() as client:
        data = client.storage(resolve_tenant(client, tenant))
    if as_json:
        print_json(data)
        return
    out.print(f"stored     {_size(data['used_bytes'])} after deduplication "
              f"({data['durable_checkpoints']} checkpoints, {_size(data['durable_file_bytes'])} as files)")
    out.print(f"quota      {_size(data['quota_bytes'])}")
    out.print(f"retention  {_policy_text(data['retention'])}")


@app.command("preview")
@handled
def preview_command(keep_newest: Count = None, keep_best: Count = None, keep_every: Count = None,
                    job: JobOption = None, tenant: TenantOption = None, as_json: JsonFlag = False) -> None:
    """What a retention policy would delete and free now, before it is saved."""
    with connect() as client:
        data = client.retention_preview(resolve_tenant(client, tenant), _policy(keep_newest, keep_best, keep_every),
                                        job_id=job)
    if as_json:
        print_json(data)
        return
    for item in data["jobs"]:
        out.print(f"job {item['job']} {item['name']}: steps {', '.join(map(str, item['steps']))}")
    out.print(f"{data['checkpoints']} checkpoints: {_size(data['bytes_freed'])} freed after deduplication "
              f"({_size(data['file_bytes'])} as files) of {_size(data['stored_bytes'])} stored")


@app.command("set-retention")
@handled
def set_retention_command(keep_newest: Count = None, keep_best: Count = None, keep_every: Count = None,
                          tenant: TenantOption = None, as_json: JsonFlag = False) -> None:
    """Save your tenant's retention policy (admins and owners); no rule given keeps everything."""
    with connect() as client:
        data = client.storage_set(resolve_tenant(client, tenant),
                                  retention=_policy(keep_newest, keep_best, keep_every))
    if as_json:
        print_json(data)
        return
    err.print(f"retention of {data['tenant']}: {_policy_text(data['retention'])}")
