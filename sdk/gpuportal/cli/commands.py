"""The `portal` command (Typer): login, whoami, quota, run, ls, status, logs, cancel, checkpoints, download,
serve, usage, kubeconfig, and the groups data, models and storage (their own modules, on `shared`).

Reads print a table, or with `--json` the API's own JSON for scripts. Errors are one line on stderr
saying what to do, and the exit code says what kind (gpuportal.client's EXIT_* and docs/cli.md).
"""

from __future__ import annotations

import datetime
import email.message
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Annotated

import httpx
import typer
from rich.table import Table

from gpuportal.cli import config as config_file
from gpuportal.cli import jobfile
from gpuportal.cli.data import app as data_app
from gpuportal.cli.follow import LogFollower, exit_code, is_progress_line
from gpuportal.cli.models import app as models_app
from gpuportal.cli.shared import (
    JobArgument,
    JsonFlag,
    TenantOption,
    connect,
    err,
    handled,
    out,
    print_json,
    progress_bar,
    resolve_tenant,
    wait_while,
)
from gpuportal.cli.storage import app as storage_app
from gpuportal.cli.workspaces import app as workspace_app
from gpuportal.client import (
    EXIT_AUTH,
    EXIT_BAD_INPUT,
    EXIT_JOB_FAILED,
    EXIT_NOT_FOUND,
    Client,
    PortalError,
    package_version,
)

# How often a followed job (its state and its log) is read again.
POLL_INTERVAL_S = 1.0
ENDPOINT_WAIT_S = 300.0

app = typer.Typer(
    name="portal",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
def _version(value: bool) -> None:
    if value:
        typer.echo(f"portal (gpuportal {package_version()})")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """The GPU portal from a terminal: log in, run your code, follow it, fetch what it wrote.

    PORTAL_URL and PORTAL_TOKEN go over the saved login (`portal login URL`).

    Exit codes: 0 ok; 1 the job failed; 2 bad input; 3 not logged in, or not allowed; 4 not found; 5 the portal is unavailable.
    """


# --- Choosing a tenant and an environment ----------------------------------


def resolve_environment(client: Client, tenant: str, given: str | int | None) -> int:
    """An environment's id: the one given (an id or a name), or the tenant's only ready environment."""
    if isinstance(given, int) or (isinstance(given, str) and given.isdigit()):
        return int(given)
    environments = [env for env in client.environments(tenant=tenant) if env.get("state") != "deleted"]
    if given:
        for env in environments:
            if env["name"] == given:
                return env["id"]
        names = ", ".join(env["name"] for env in environments) or "none"
        raise PortalError(f"tenant {tenant} has no environment named {given!r} (its environments: {names})",
                          EXIT_NOT_FOUND)
    ready = [env for env in environments if env.get("state") == "ready"]
    if len(ready) == 1:
        return ready[0]["id"]
    if not ready:
        raise PortalError(f"--environment: tenant {tenant} has no ready environment; make one on the portal's "
                          "Environments page", EXIT_BAD_INPUT)
    names = ", ".join(env["name"] for env in ready)
    raise PortalError(f"--environment: tenant {tenant} has several ready environments ({names}); name one",
                      EXIT_BAD_INPUT)


# --- Who -------------------------------------------------------------------


@app.command()
@handled
def login(
    url: Annotated[str, typer.Argument(help="The portal's address, e.g. https://portal.example.com.",
                                       show_default=False)],
    username: Annotated[str | None, typer.Option("--username", "-u", help="Asked for when not given.")] = None,
    password_stdin: Annotated[bool, typer.Option("--password-stdin",
                                                 help="Read the password from stdin (for scripts).")] = False,
    token_stdin: Annotated[bool, typer.Option("--token-stdin", help="Save a token made on the API tokens page "
                                                                    "(read from stdin) instead of logging in.")] = False,
    tenant: Annotated[str | None, typer.Option("--tenant", "-t", help="The tenant commands use when none is "
                                                                      "given.")] = None,
) -> None:
    """Log in and save the token (mode 0600, in your config folder)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise PortalError(f"URL {url!r}: give the portal's address with http:// or https://", EXIT_BAD_INPUT)
    if password_stdin and token_stdin:
        raise PortalError("--password-stdin and --token-stdin: give one of them", EXIT_BAD_INPUT)
    if token_stdin:
        token = sys.stdin.readline().strip()
        if not token:
            raise PortalError("--token-stdin: stdin held no token", EXIT_BAD_INPUT)
        with Client(url, token) as client:
            username = client.current_token()["user"]
    else:
        if not username:
            username = typer.prompt("Username")
        password = sys.stdin.readline().rstrip("\n") if password_stdin else typer.prompt("Password", hide_input=True)
        with Client(url) as client:
            token = client.login(username, password)["token"]
    saved = config_file.load()
    if tenant or saved.url != url:  # a tenant saved for another portal means nothing here
        saved.tenant = tenant
    saved.url, saved.token, saved.username = url, token, username
    path = config_file.save(saved)
    err.print(f"Logged in to {url} as {username}; the token is saved in {path}.")


@app.command()
@handled
def logout() -> None:
    """Revoke the saved token and forget it."""
    saved = config_file.load()
    if not saved.token:
        raise PortalError("not logged in: nothing to log out of", EXIT_AUTH)
    try:
        with Client(saved.url, saved.token) as client:
            client.logout()
    except PortalError as exc:
        if exc.exit_code != EXIT_AUTH:  # a token the portal already refuses is forgotten all the same
            raise
    saved.token = None
    config_file.save(saved)
    err.print(f"Logged out of {saved.url}.")


@app.command()
@handled
def whoami(as_json: JsonFlag = False) -> None:
    """Who the token belongs to, its expiry, and your tenants and roles."""
    with connect() as client:
        token = client.current_token()
        tenants = client.tenants()
    if as_json:
        print_json({"url": client.url, "user": token["user"], "token": token, "tenants": tenants})
        return
    out.print(f"{token['user']} at {client.url} (token {token['name']!r}, expires {token.get('expiry') or 'never'})")
    for tenant in tenants:
        out.print(f"  {tenant['slug']}: {tenant.get('my_role')}")


@app.command()
@handled
def quota(tenant: TenantOption = None, as_json: JsonFlag = False) -> None:
    """Your tenants' GPU quotas per flavor: guaranteed, the most it may borrow up to, priorities."""
    with connect() as client:
        quotas = client.quotas(tenant=tenant)
    if as_json:
        print_json(quotas)
        return
    table = Table("tenant", "flavor", "guaranteed", "max", "max priority", "weight", box=None)
    for row in quotas:
        table.add_row(row["tenant"], row["flavor"], str(row["guaranteed"]), str(row["max"]),
                      str(row["max_priority"]), str(row["fair_share_weight"]))
    out.print(table)


# --- Jobs ------------------------------------------------------------------


def _gpus(job: dict) -> str:
    return f"{job['replicas']}x{job['gpus_per_replica']}"


@app.command("ls")
@handled
def list_jobs(
    tenant: TenantOption = None,
    state: Annotated[str | None, typer.Option("--state", "-s", help="Only jobs in this state (queued, running, "
                                                                    "succeeded, failed, ...).")] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="At most this many, newest first.")] = 20,
    as_json: JsonFlag = False,
) -> None:
    """Your jobs, newest first."""
    with connect() as client:
        jobs = client.jobs(tenant=tenant, state=state, limit=limit)
    if as_json:
        print_json(jobs)
        return
    table = Table("id", "name", "tenant", "state", "flavor", "gpus", "submitted", box=None)
    for job in jobs:
        table.add_row(str(job["id"]), job["name"], job["tenant"], job["state"], job["flavor"], _gpus(job),
                      (job.get("submitted_at") or "")[:19])
    out.print(table)


def _state(job: dict) -> str:
    """A job's state and, when it has one, why."""
    return job["state"] + (f": {job['reason']}" if job.get("reason") else "")


@app.command()
@handled
def status(job_id: JobArgument, as_json: JsonFlag = False) -> None:
    """One job: its state and why, its attempts and checkpoints."""
    with connect() as client:
        job = client.job(job_id)
    if as_json:
        print_json(job)
        return
    lines = [
        f"job {job['id']} {job['name']} ({job['tenant']}, environment {job['environment']})",
        f"state       {_state(job)}",
        f"flavor      {job['flavor']}, {job['replicas']} replica(s) x {job['gpus_per_replica']} GPU(s)",
    ]
    if job.get("queue_position") is not None:
        lines.append(f"queue       position {job['queue_position']}"
                     + (f", start expected {job['projected_start']}" if job.get("projected_start") else ""))
    for key in ("submitted_at", "started_at", "finished_at"):
        if job.get(key):
            lines.append(f"{key.split('_')[0]:<11} {job[key]}")
    for attempt in job.get("attempts") or []:
        lines.append(f"attempt {attempt['number']}   {attempt.get('outcome') or 'running'}"
                     + (f" (exit {attempt['exit_code']})" if attempt.get("exit_code") is not None else "")
                     + (f": {attempt['reason']}" if attempt.get("reason") else ""))
    steps = [str(checkpoint["step"]) for checkpoint in job.get("checkpoints") or []]
    lines.append(f"checkpoints {', '.join(steps) if steps else 'none yet'}")
    for line in lines:
        out.print(line)


def follow_job(client: Client, job_id: int, *, rank: int = 0, progress_lines: bool = False,
               log_to_stderr: bool = False, interval_s: float = POLL_INTERVAL_S) -> int:
    """Print a job's state changes (stderr) and one replica's new log lines (stdout) until it ends: its exit code."""
    follower = LogFollower(lambda tail: client.logs(job_id, rank=rank, tail=tail), progress_lines=progress_lines)
    seen_state = None
    try:
        while True:
            job = client.job(job_id)
            if job["state"] != seen_state:
                seen_state = job["state"]
                err.print(f"job {job_id} {_state(job)}")
            if any(attempt.get("started_at") for attempt in job.get("attempts") or []):
                for line in follower.poll():
                    typer.echo(line, err=log_to_stderr)
            code = exit_code(job["state"])
            if code is not None:
                return code
            time.sleep(interval_s)
    except KeyboardInterrupt:
        err.print(f"Stopped following; job {job_id} goes on (`portal logs -f {job_id}`, `portal cancel {job_id}`).")
        raise typer.Exit(130) from None


@app.command()
@handled
def logs(
    job_id: JobArgument,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the job ends; exit "
                                                                "with its status.")] = False,
    rank: Annotated[int, typer.Option("--rank", "-r", min=0, help="Which replica.")] = 0,
    attempt: Annotated[int | None, typer.Option("--attempt", "-a", min=1, help="Which attempt; the newest that "
                                                                               "started unless given.")] = None,
    tail: Annotated[int, typer.Option("--tail", "-n", min=1, max=5000, help="How many of the last lines.")] = 200,
    progress: Annotated[bool, typer.Option("--progress", help="Show the progress lines the portal reads "
                                                              "(PORTAL_METRIC, PORTAL_CHECKPOINT) too.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """One replica's log: its last lines, or with -f everything it writes until the job ends."""
    if follow and (as_json or attempt is not None):
        raise PortalError("--follow: follows the newest attempt as text; leave out --json and --attempt",
                          EXIT_BAD_INPUT)
    with connect() as client:
        if follow:
            raise typer.Exit(follow_job(client, job_id, rank=rank, progress_lines=progress))
        answer = client.logs(job_id, rank=rank, attempt=attempt, tail=tail)
    if as_json:
        print_json(answer)
        return
    for line in (answer.get("text") or "").splitlines():
        if progress or not is_progress_line(line):
            typer.echo(line)


@app.command()
@handled
def cancel(job_id: JobArgument, as_json: JsonFlag = False) -> None:
    """Cancel a job: it is stopped (with a checkpoint when it runs) and ends cancelled."""
    with connect() as client:
        job = client.cancel(job_id)
    if as_json:
        print_json(job)
        return
    err.print(f"job {job_id} {_state(job)}")


@app.command()
@handled
def checkpoints(job_id: JobArgument, as_json: JsonFlag = False) -> None:
    """The checkpoints a job wrote, oldest first."""
    with connect() as client:
        rows = client.job(job_id).get("checkpoints") or []
    if as_json:
        print_json(rows)
        return
    table = Table("step", "bytes", "written", "file", box=None)
    for row in rows:
        table.add_row(str(row["step"]), str(row["bytes"]), (row.get("created_at") or "")[:19], row.get("uri") or "")
    out.print(table)


def choose_checkpoint(job: dict, step: int | None) -> dict:
    """The job's checkpoint at `step`, or its newest: a PortalError (exit 4) naming the steps there are."""
    rows = job.get("checkpoints") or []
    if not rows:
        raise PortalError(f"job {job['id']} has no checkpoint yet (it is {job['state']})", EXIT_NOT_FOUND)
    if step is None:
        return max(rows, key=lambda row: row["step"])
    for row in rows:
        if row["step"] == step:
            return row
    steps = ", ".join(str(row["step"]) for row in rows)
    raise PortalError(f"--checkpoint {step}: job {job['id']} has checkpoints at steps {steps}", EXIT_NOT_FOUND)


def checkpoint_file_name(disposition: str | None) -> str | None:
    """The bare file name a Content-Disposition header gives (its filename*, else its filename), or None when it
    gives none to use: any folder part is dropped, and leading dots, so an answer names a file in the folder chosen
    and nowhere else."""
    if not disposition:
        return None
    header = email.message.Message()
    header["Content-Disposition"] = disposition
    name = header.get_filename() or ""
    name = name.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(character for character in name if character.isprintable()).strip().lstrip(".")
    return name if name and len(name.encode()) <= 255 else None


def save_checkpoint(client: Client, job: dict, row: dict, output: Path | None) -> tuple[Path, int]:
    """Download the checkpoint `row` of `job` to `output` (a file, or a folder to put it in; the working folder
    when None): where it was saved, and its size.

    Without a file named, the file takes the name the portal gives it (a folder checkpoint comes as a .tar.gz);
    the checkpoint's own suffix names it only if the portal gives none. It is written under a temporary name
    beside where it goes, and renamed once whole.
    """
    folder = None if output is not None and not output.is_dir() else (output or Path("."))
    partial_in = folder if folder is not None else output.parent
    disposition: list[str] = []

    def remember(response: httpx.Response) -> None:
        if response.is_success:
            disposition.append(response.headers.get("Content-Disposition", ""))

    # The download's answer is streamed into the file; its headers are seen here as they come.
    hooks = client.http.event_hooks
    client.http.event_hooks = {**hooks, "response": [*hooks.get("response", []), remember]}
    descriptor, partial = tempfile.mkstemp(prefix=".portal-download.", dir=partial_in)
    try:
        with os.fdopen(descriptor, "wb") as stream, progress_bar() as bar:
            task = bar.add_task(f"step {row['step']}", total=row.get("bytes") or None)
            size = client.checkpoint_download(job["id"], row["step"], stream,
                                              lambda done, total: bar.update(task, completed=done, total=total))
        if folder is None:
            target = output
        else:
            suffix = "".join(Path(row.get("uri") or "").suffixes) or ".pt"
            given = checkpoint_file_name(disposition[-1] if disposition else None)
            target = folder / (given or f"{job['name']}-{job['id']}-step-{row['step']}{suffix}")
        os.replace(partial, target)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    finally:
        client.http.event_hooks = hooks
    return target, size


@app.command()
@handled
def download(
    job_id: JobArgument,
    checkpoint: Annotated[int | None, typer.Option("--checkpoint", "-c", min=0, help="The checkpoint's step; the "
                                                                                     "newest unless given.")] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Where to save it: a file, or a folder to "
                                                                       "put it in under the name the portal gives "
                                                                       "(<job>-<id>-step-<step>.pt, .tar.gz for a "
                                                                       "folder checkpoint).")] = None,
) -> None:
    """Download one of a job's checkpoints."""
    with connect() as client:
        job = client.job(job_id)
        row = choose_checkpoint(job, checkpoint)
        target, size = save_checkpoint(client, job, row, output)
    err.print(f"Saved job {job_id}'s checkpoint at step {row['step']} ({size} bytes) in {target}.")


# --- Running code ----------------------------------------------------------


def _upload_bundle(client: Client, tenant: str, folder: Path) -> str:
    """Pack the folder and upload it unless the portal has it already: its digest."""
    try:
        from gpuportal import bundle
    except ImportError:
        raise PortalError("this gpuportal cannot pack a folder yet (gpuportal.bundle is missing); update it",
                          EXIT_JOB_FAILED) from None
    if not folder.is_dir():
        raise PortalError(f"--workdir {folder}: not a folder", EXIT_BAD_INPUT)
    archive = bundle.pack(folder)
    digest = bundle.digest(archive)
    if client.bundle_exists(tenant, digest):
        err.print(f"The portal has this code already ({digest[:12]}).")
        return digest
    with progress_bar() as bar:
        task = bar.add_task(f"uploading {digest[:12]}", total=len(archive))
        client.bundle_upload(tenant, archive, lambda sent: bar.update(task, completed=sent))
    err.print(f"Uploaded {folder.resolve().name} ({len(archive)} bytes, {digest[:12]}).")
    return digest


@app.command(context_settings={"allow_interspersed_args": False})
@handled
def run(
    command: Annotated[list[str] | None, typer.Argument(help="What to run, after --: python train.py --epochs 3.",
                                                        show_default=False)] = None,
    job_file: Annotated[Path | None, typer.Option("--file", "-f", help="A YAML job spec (the API's field names); "
                                                                       "flags go over it.")] = None,
    tenant: TenantOption = None,
    environment: Annotated[str | None, typer.Option("--environment", "-e", help="An environment's name or id; the "
                                                                                "tenant's only ready one unless "
                                                                                "given.")] = None,
    name: Annotated[str | None, typer.Option("--name", help="The job's name; the folder's unless given.")] = None,
    flavor: Annotated[str | None, typer.Option("--flavor", help="A flavor your tenant has a quota for.")] = None,
    replicas: Annotated[int | None, typer.Option("--replicas", min=1, help="Processes (pods), started together.")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", min=1, help="GPUs per replica (gpus_per_replica).")] = None,
    template: Annotated[str | None, typer.Option("--template", help="script (with a command), pytorch-ddp (the "
                                                                    "shipped trainer) or custom.")] = None,
    steps: Annotated[int | None, typer.Option("--steps", min=1, help="Training steps.")] = None,
    priority: Annotated[int | None, typer.Option("--priority", min=0)] = None,
    max_runtime_s: Annotated[int | None, typer.Option("--max-runtime", min=1, help="Seconds, all attempts.")] = None,
    hyperparameter: Annotated[list[str] | None, typer.Option("--hp", help="KEY=VALUE, a hyperparameter (again for "
                                                                          "more).")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", help="KEY=VALUE, a variable for the replicas.")] = None,
    dataset: Annotated[list[str] | None, typer.Option("--dataset", help="NAME[:VERSION], a dataset the job reads as "
                                                                         "ctx.dataset(NAME) (again for more).")] = None,
    workdir: Annotated[Path, typer.Option("--workdir", "-C", help="The folder to upload (its .gitignore and "
                                                                  ".portalignore honoured).")] = Path("."),
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Return once submitted.")] = False,
    rank: Annotated[int, typer.Option("--rank", "-r", min=0, help="Whose log to follow.")] = 0,
    idempotency_key: Annotated[str | None, typer.Option("--idempotency-key", help="Submitting again with the same "
                                                                                  "key answers the first job.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Upload this folder and run a command on the portal's GPUs; follow its log until it ends.

    Exits with the job's status: 0 succeeded, 1 failed or cancelled. With --json, stdout holds only the
    job's JSON (once submitted with -d, once ended without) and the log goes to stderr.
    """
    spec = jobfile.merge(
        jobfile.load(job_file) if job_file else {},
        {"tenant": tenant, "name": name, "flavor": flavor, "replicas": replicas, "gpus_per_replica": gpus,
         "template": template, "steps": steps, "priority": priority, "max_runtime_s": max_runtime_s},
        command=command, hyperparameters=jobfile.parse_assignments(hyperparameter or [], "--hp"),
        env=jobfile.parse_env(env or []),
    )
    if environment is not None:
        spec["environment"] = environment
    if dataset:
        spec["datasets"] = [*(spec.get("datasets") or []), *jobfile.parse_datasets(dataset)]
    spec.setdefault("name", jobfile.job_name(workdir))
    if not spec.get("flavor"):
        raise PortalError("--flavor: which GPUs to run on (`portal quota` lists your tenant's flavors)", EXIT_BAD_INPUT)
    with connect() as client:
        spec["tenant"] = resolve_tenant(client, spec.get("tenant"))
        spec["environment"] = resolve_environment(client, spec["tenant"], spec.get("environment"))
        if spec.get("template") == jobfile.SCRIPT_TEMPLATE and not spec.get("bundle"):
            spec["bundle"] = _upload_bundle(client, spec["tenant"], workdir)
        job = client.submit(spec, idempotency_key or str(uuid.uuid4()))
        err.print(f"Submitted job {job['id']} ({job['name']}): `portal logs -f {job['id']}` follows it.")
        if detach:
            if as_json:
                print_json(job)
            return
        # With --json, stdout holds the ended job's JSON only; its log goes to stderr.
        code = follow_job(client, job["id"], rank=rank, log_to_stderr=as_json)
        if as_json:
            print_json(client.job(job["id"]))
        raise typer.Exit(code)


@app.command()
@handled
def serve(
    job_id: JobArgument,
    name: Annotated[str, typer.Option("--name", help="The endpoint's name (its URL's last part).",
                                      show_default=False)],
    step: Annotated[int | None, typer.Option("--step", min=0, help="The checkpoint; the newest unless "
                                                                   "given.")] = None,
    flavor: Annotated[str | None, typer.Option("--flavor", help="The job's flavor unless given.")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", min=1, help="GPUs per replica.")] = None,
    min_replicas: Annotated[int | None, typer.Option("--min-replicas", min=0)] = None,
    max_replicas: Annotated[int | None, typer.Option("--max-replicas", min=1)] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Return once deployed, not once ready.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Serve a job's checkpoint as an inference endpoint, in the job's tenant and environment."""
    with connect() as client:
        job = client.job(job_id)
        source = {"job": job_id} if step is None else {"job": job_id, "step": step}
        spec = {"tenant": job["tenant"], "environment": job["environment"], "name": name, "source": source,
                "flavor": flavor or job["flavor"]}
        extra = {"gpus_per_replica": gpus, "min_replicas": min_replicas, "max_replicas": max_replicas}
        spec.update({key: value for key, value in extra.items() if value is not None})
        endpoint = client.endpoint_create(spec)
        if not detach:
            endpoint = wait_while(endpoint, ("deploying", "scaling"), client.endpoint, what=f"endpoint {name}",
                                  seconds=ENDPOINT_WAIT_S, every_s=POLL_INTERVAL_S)
    if as_json:
        print_json(endpoint)
    else:
        err.print(f"endpoint {endpoint['id']} {endpoint['name']} {endpoint['state']}"
                  + (f": {endpoint['reason']}" if endpoint.get("reason") else ""))
        out.print(f"POST {endpoint['url']}/v1/generate")
    if endpoint["state"] == "failed":
        raise typer.Exit(EXIT_JOB_FAILED)


# --- Usage, connecting -----------------------------------------------------


def month_range(month: str | None, today: datetime.date | None = None) -> tuple[str, str]:
    """The first and last day of a month given as YYYY-MM (this month unless given)."""
    today = today or datetime.datetime.now(datetime.timezone.utc).date()
    if month is None:
        first = today.replace(day=1)
    else:
        try:
            first = datetime.datetime.strptime(month, "%Y-%m").date()
        except ValueError:
            raise PortalError(f"--month {month!r}: give a month as YYYY-MM, e.g. {today:%Y-%m}", EXIT_BAD_INPUT) from None
    following = (first.replace(day=28) + datetime.timedelta(days=4)).replace(day=1)
    return first.isoformat(), (following - datetime.timedelta(days=1)).isoformat()


@app.command()
@handled
def usage(
    month: Annotated[str | None, typer.Option("--month", "-m", help="YYYY-MM; this month unless given.")] = None,
    tenant: TenantOption = None,
    group_by: Annotated[str, typer.Option("--group-by", "-g", help="Any of tenant, flavor, job, day, kind, "
                                                                   "comma-separated.")] = "tenant,flavor",
    as_json: JsonFlag = False,
) -> None:
    """GPU-hours and cost in a month."""
    start, end = month_range(month)
    with connect() as client:
        rows = client.usage(start=start, end=end, group_by=group_by, tenant=tenant)
    if as_json:
        print_json(rows)
        return
    groups = [column for column in ("tenant", "flavor", "job", "endpoint", "day", "kind")
              if any(row.get(column) is not None for row in rows)]
    table = Table(*groups, "gpu hours", "storage GB-months", "cost", "cloud cost", box=None)
    for row in rows:
        table.add_row(*[str(row.get(column)) for column in groups], str(row["gpu_hours"]),
                      str(row["storage_gb_months"]), f"{row['cost']} {row['currency']}",
                      str(row.get("cloud_cost") if row.get("cloud_cost") is not None else "-"))
    out.print(table)


@app.command()
@handled
def kubeconfig(
    environment: Annotated[str, typer.Argument(help="The environment's name or id.", show_default=False)],
    tenant: TenantOption = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Save it here (mode 0600) instead of "
                                                                       "printing it.")] = None,
) -> None:
    """A kubeconfig for one environment's namespace (Kubernetes clusters only)."""
    with connect() as client:
        environment_id = resolve_environment(
            client, "" if environment.isdigit() else resolve_tenant(client, tenant), environment)
        text, expires = client.kubeconfig(environment_id)
    if output is None:
        typer.echo(text, nl=not text.endswith("\n"))
        return
    descriptor = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)
    with os.fdopen(descriptor, "w") as stream:
        stream.write(text)
    err.print(f"Saved in {output}" + (f"; its token works until {expires}." if expires else "."))


def main(args: list[str] | None = None) -> None:
    """The `portal` command: every error, the command line's own too, is one line on stderr and its exit code."""
    args = sys.argv[1:] if args is None else list(args)
    try:
        code = app(args=args or ["--help"], prog_name="portal", standalone_mode=False)
    except typer.TyperException as exc:  # the command line's mistakes (exit 2), and a file it cannot open
        ctx = getattr(exc, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        typer.echo(f"portal: {exc.format_message()}{hint}", err=True)
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("portal: stopped", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


# The groups of subcommands, each in a module of its own.
app.add_typer(data_app, name="data")
app.add_typer(models_app, name="models")
app.add_typer(storage_app, name="storage")
app.add_typer(workspace_app, name="workspace")
