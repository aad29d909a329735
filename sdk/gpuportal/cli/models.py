"""`portal models`: the model registry. List a tenant's models, show a model or one version's lineage, and promote
a job's checkpoint to a new version (its weights copied into the portal's model store, kept when the job's
checkpoints are collected or the job is deleted)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from gpuportal.cli.shared import (
    JobArgument,
    JsonFlag,
    TenantOption,
    connect,
    err,
    handled,
    name_and_version,
    out,
    print_json,
    resolve_tenant,
)

app = typer.Typer(name="models", no_args_is_help=True, help="The model registry: list, show, promote a checkpoint.")


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{size} B"


def _from(version: dict) -> str:
    job = version["job"]
    return f"job {job['id']} {job['name']}{'' if job['exists'] else ' (deleted)'} step {version['step']}"


@app.command("ls")
@handled
def list_command(tenant: TenantOption = None, as_json: JsonFlag = False) -> None:
    """Your tenant's models: how many versions each has and the newest."""
    with connect() as client:
        models = client.models(resolve_tenant(client, tenant))
    if as_json:
        print_json(models)
        return
    table = Table("name", "versions", "newest", "updated", box=None)
    for model in models:
        table.add_row(model["name"], str(model["versions"]), f"v{model['newest']}", model["updated_at"])
    out.print(table)


@app.command("show")
@handled
def show_command(
    reference: Annotated[str, typer.Argument(help="NAME for a model's versions, NAME:VERSION for one version's "
                                                  "lineage.", show_default=False)],
    tenant: TenantOption = None,
    as_json: JsonFlag = False,
) -> None:
    """A model's versions, or one version: its weights and lineage (job, bundle, datasets, hyperparameters, metrics)."""
    name, number = name_and_version(reference)
    with connect() as client:
        slug = resolve_tenant(client, tenant)
        data = client.model_version(slug, name, number) if number is not None else client.model(slug, name)
    if as_json:
        print_json(data)
        return
    if number is None:
        table = Table("version", "from", "loss", "weights", "promoted", box=None)
        for version in data["versions"]:
            loss = version["lineage"].get("metrics", {}).get("loss")
            table.add_row(f"v{version['version']}", _from(version), "-" if loss is None else f"{loss:.4f}",
                          _human(version["weights"]["bytes"]), version["created_at"])
        out.print(table)
        return
    lineage = data["lineage"]
    datasets = ", ".join(f"{d['name']} v{d['version']}" for d in lineage.get("datasets") or []) or "none"
    metrics = lineage.get("metrics") or {}
    out.print(f"{data['name']} v{data['version']}: {_from(data)}")
    out.print(f"weights   {data['weights']['sha256']} ({_human(data['weights']['bytes'])}, {data['weights']['format']})")
    out.print(f"bundle    {lineage.get('bundle') or 'none'}")
    out.print(f"datasets  {datasets}")
    out.print(f"hyper     {lineage.get('hyperparameters') or {}}")
    out.print("metrics   " + (f"loss {metrics.get('loss')} at step {metrics.get('step')}" if metrics else "none"))


@app.command("promote")
@handled
def promote_command(
    job_id: JobArgument,
    step: Annotated[int, typer.Argument(help="The checkpoint's step (`portal checkpoints JOB` lists them).", min=0,
                                        show_default=False)],
    name: Annotated[str, typer.Argument(help="The model: a new one, or the next version of it.", show_default=False)],
    as_json: JsonFlag = False,
) -> None:
    """Promote a job's checkpoint to a new version of a model, in the job's tenant."""
    with connect() as client:
        job = client.job(job_id)
        version = client.model_promote(job["tenant"], name=name, job_id=job_id, step=step)
    if as_json:
        print_json(version)
        return
    err.print(f"{version['name']} v{version['version']}: {_from(version)}, "
              f"{_human(version['weights']['bytes'])} of weights kept in the model store")
    out.print(f"{version['name']}:{version['version']}")
