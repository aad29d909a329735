"""What every `portal` subcommand module shares: the consoles, the common options, the error handling, the
client from the saved login and the tenant it acts for. The root app (`gpuportal.cli.commands`) and each group
of subcommands (`data`, `models`, `storage`) import it; it imports none of them.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from gpuportal.cli import config as config_file
from gpuportal.client import EXIT_AUTH, EXIT_BAD_INPUT, EXIT_JOB_FAILED, Client, PortalError

# Text from the portal (names, reasons, paths) is printed as it is: no markup, no highlighting.
out = Console(soft_wrap=True, markup=False, highlight=False)
err = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print the API's JSON (for scripts) instead of a table.")]
TenantOption = Annotated[str | None, typer.Option("--tenant", "-t", help="A tenant's slug; yours when you have one.")]
JobArgument = Annotated[int, typer.Argument(help="The job's id (`portal ls` lists them).", min=1, show_default=False)]


def handled(command):
    """Turn a PortalError into its one line on stderr and its exit code."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except PortalError as exc:
            typer.echo(f"portal: {exc.message}", err=True)
            raise typer.Exit(exc.exit_code) from None

    return run


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False))


def connect() -> Client:
    url, token = config_file.require_login(config_file.effective())
    return Client(url, token)


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    console=err, transient=True, disable=not err.is_terminal)


def resolve_tenant(client: Client, given: str | None) -> str:
    """The tenant named, the one saved at login, or the user's only tenant."""
    if given:
        return given
    saved = config_file.load().tenant
    if saved:
        return saved
    slugs = [tenant["slug"] for tenant in client.tenants()]
    if len(slugs) == 1:
        return slugs[0]
    if not slugs:
        raise PortalError("you belong to no tenant yet: ask a tenant's owner to add you", EXIT_AUTH)
    raise PortalError(f"--tenant: you belong to {', '.join(slugs)}; name one with --tenant "
                      "(or save one with `portal login URL --tenant SLUG`)", EXIT_BAD_INPUT)


def name_and_version(reference: str) -> tuple[str, int | None]:
    """NAME or NAME:VERSION (a dataset's or a model's): the name, and the version's number or None."""
    name, _, number = reference.partition(":")
    if number and not number.isdigit():
        raise PortalError(f"{reference}: a version is a number (NAME:3)", EXIT_BAD_INPUT)
    return name, int(number) if number else None


def wait_while(item: dict, states: tuple[str, ...], read, *, what: str, seconds: float, every_s: float = 1.0) -> dict:
    """Read ``item`` again (``read(id)``) while its state is one of ``states``; a PortalError (exit 1) naming
    ``what`` and its reason once ``seconds`` have passed. Returns it as last read."""
    deadline = time.monotonic() + seconds
    while item["state"] in states:
        if time.monotonic() > deadline:
            raise PortalError(f"{what} is still {item['state']} after {seconds:.0f} s: "
                              f"{item.get('reason') or 'no reason given'}", EXIT_JOB_FAILED)
        time.sleep(every_s)
        item = read(item["id"])
    return item
