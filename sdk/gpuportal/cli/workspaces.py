"""`portal workspace`: a JupyterLab of your own on a flavor, behind the portal's sign-in. Start one (it is
created the first time) and get its URL once it is ready; stop it; list yours."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from gpuportal.cli.shared import (
    JsonFlag,
    TenantOption,
    connect,
    err,
    handled,
    out,
    print_json,
    resolve_tenant,
    wait_while,
)
from gpuportal.client import EXIT_BAD_INPUT, EXIT_JOB_FAILED, EXIT_NOT_FOUND, PortalError

app = typer.Typer(name="workspace", no_args_is_help=True, help="Interactive workspaces: start, stop, list.")

POLL_INTERVAL_S = 1.0
READY_WAIT_S = 600.0
# Where a workspace is on its way: the command waits while it is in one of these.
ON_THE_WAY = ("queued", "starting")


def _environment_id(client, tenant: str, given: str) -> int:
    """An environment named by its id or its name, in the tenant."""
    environments = client.environments(tenant)
    for environment in environments:
        if str(environment["id"]) == given or environment["name"] == given:
            return environment["id"]
    names = ", ".join(sorted(e["name"] for e in environments)) or "none"
    raise PortalError(f"--environment {given}: no such environment in {tenant} (there: {names})", EXIT_NOT_FOUND)


@app.command("start")
@handled
def start_command(
    environment: Annotated[str | None, typer.Option("--environment", "-e", help="An environment's name or id (a "
                                                    "new workspace's; an existing one keeps its own).")] = None,
    flavor: Annotated[str | None, typer.Option("--flavor", help="A whole GPU, a MIG slice, a time-slice share, "
                                               "or a CPU-only flavor (a new workspace's).")] = None,
    name: Annotated[str, typer.Option("--name", help="The workspace; started again if it exists.")] = "notebook",
    gpus: Annotated[int, typer.Option("--gpus", min=0, help="Units of the flavor.")] = 1,
    shared: Annotated[bool, typer.Option("--shared", help="Members of the tenant may open it too.")] = False,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Return once started, not once ready.")] = False,
    tenant: TenantOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Start your workspace (made the first time) and print its URL once JupyterLab answers."""
    with connect() as client:
        slug = resolve_tenant(client, tenant)
        found = next((w for w in client.workspaces(slug) if w["name"] == name), None)
        if found is None:
            if not environment or not flavor:
                raise PortalError(f"workspace {name} does not exist yet: give --environment and --flavor to make it",
                                  EXIT_BAD_INPUT)
            workspace = client.workspace_create({
                "tenant": slug, "environment": _environment_id(client, slug, environment), "name": name,
                "flavor": flavor, "gpus": gpus, "shared": shared})
        elif found["state"] in ("stopped", "failed"):
            workspace = client.workspace_start(found["id"])
        else:
            workspace = found
        if not detach:
            workspace = wait_while(workspace, ON_THE_WAY, client.workspace, what=f"workspace {name}",
                                   seconds=READY_WAIT_S, every_s=POLL_INTERVAL_S)
    if as_json:
        print_json(workspace)
    else:
        err.print(f"workspace {workspace['id']} {workspace['name']} {workspace['state']}"
                  + (f": {workspace['reason']}" if workspace.get("reason") else ""))
        out.print(workspace["url"])
    if workspace["state"] not in ("ready", *ON_THE_WAY):
        raise typer.Exit(EXIT_JOB_FAILED)


@app.command("stop")
@handled
def stop_command(
    workspace_id: Annotated[int, typer.Argument(help="The workspace's id (`portal workspace ls`).", min=1,
                                                show_default=False)],
    as_json: JsonFlag = False,
) -> None:
    """Stop a workspace: its JupyterLab ends, its home folder stays for the next start."""
    with connect() as client:
        workspace = client.workspace_stop(workspace_id)
    if as_json:
        print_json(workspace)
        return
    out.print(f"workspace {workspace['id']} {workspace['name']} {workspace['state']}")


@app.command("ls")
@handled
def list_command(tenant: TenantOption = None, as_json: JsonFlag = False) -> None:
    """Your workspaces (and the tenant's shared ones): state, flavor, idle since."""
    with connect() as client:
        workspaces = client.workspaces(resolve_tenant(client, tenant))
    if as_json:
        print_json(workspaces)
        return
    table = Table("id", "name", "owner", "state", "flavor", "idle since", "url", box=None)
    for w in workspaces:
        table.add_row(str(w["id"]), w["name"], w["owner"], w["state"], w["flavor"], w["idle_since"] or "-", w["url"])
    out.print(table)
