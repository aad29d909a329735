"""The job spec a `portal run` submits: a YAML file's fields with the command line's flags over them.

The file holds the API's own field names (`tenant`, `environment`, `name`, `flavor`, `template`,
`replicas`, `gpus_per_replica`, `steps`, `env`, `hyperparameters`, `command`, ...: docs/jobs.md's job
spec), as SkyPilot's task file holds a task. `environment` may be an environment's name as well as
its id. The portal checks the fields; here only the file's shape is checked, so that a mistake in it
is named before anything is packed or sent.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from gpuportal.client import EXIT_BAD_INPUT, PortalError

NAME_MAX = 40
# A job a command is given for runs that command in the uploaded folder.
SCRIPT_TEMPLATE = "script"


def bad(message: str) -> PortalError:
    return PortalError(message, EXIT_BAD_INPUT)


def load(path: Path) -> dict[str, Any]:
    """The spec a job file holds: a mapping of the API's fields."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise bad(f"cannot read the job file {path}: {exc.strerror or exc}") from None
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise bad(f"the job file {path}{where} is not valid YAML: {problem}") from None
    if spec is None:
        return {}
    if not isinstance(spec, dict) or not all(isinstance(key, str) for key in spec):
        raise bad(f"the job file {path} must be a mapping of the job spec's fields (tenant: ..., flavor: ...)")
    return spec


def parse_assignments(values: list[str], option: str) -> dict[str, Any]:
    """`KEY=VALUE` pairs; the value read as YAML, so `lr=0.001` is a number and `name=run` a string."""
    parsed = {}
    for value in values:
        key, equals, raw = value.partition("=")
        if not equals or not key.strip():
            raise bad(f"{option} {value!r}: give KEY=VALUE")
        try:
            parsed[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            parsed[key.strip()] = raw
    return parsed


def parse_env(values: list[str]) -> dict[str, str]:
    """`--env KEY=VALUE` pairs: the replicas' variables, kept as text."""
    env = {}
    for value in values:
        key, equals, raw = value.partition("=")
        if not equals or not key.strip():
            raise bad(f"--env {value!r}: give KEY=VALUE")
        env[key.strip()] = raw
    return env


def parse_datasets(values: list[str]) -> list[dict[str, Any]]:
    """`--dataset NAME[:VERSION]` (NAME may be owner/name, one shared with you): the spec's `datasets`, a version
    a number or "latest" (the newest sealed one, pinned by the portal at submit) when left out."""
    datasets = []
    for value in values:
        name, colon, version = value.partition(":")
        if not name.strip() or (colon and not version):
            raise bad(f"--dataset {value!r}: give NAME or NAME:VERSION")
        entry: dict[str, Any] = {"name": name.strip()}
        if colon and version != "latest":
            if not version.isdigit() or int(version) < 1:
                raise bad(f"--dataset {value!r}: a version is a number from 1, or latest")
            entry["version"] = int(version)
        datasets.append(entry)
    return datasets


def job_name(folder: Path) -> str:
    """A job name made from a folder's name: lowercase letters, digits and '-', at most 40."""
    name = re.sub(r"[^a-z0-9]+", "-", folder.resolve().name.lower()).strip("-")[:NAME_MAX].strip("-")
    return name or "job"


def merge(file_spec: dict[str, Any], flags: dict[str, Any], *, command: list[str] | None = None,
          hyperparameters: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The file's spec with every flag that was given over it.

    `hyperparameters` and `env` are merged key by key into the file's; a command given on the command
    line replaces the file's. A job with a command and no template is a `script` job.
    """
    spec = dict(file_spec)
    spec.update({key: value for key, value in flags.items() if value is not None})
    for field, extra in (("hyperparameters", hyperparameters), ("env", env)):
        if not extra:
            continue
        current = spec.get(field) or {}
        if not isinstance(current, dict):
            raise bad(f"{field}: a mapping of names to values in the job file, not {type(current).__name__}")
        spec[field] = {**current, **extra}
    if command:
        spec["command"] = list(command)
    if "command" in spec and spec["command"] is not None:
        if isinstance(spec["command"], str):
            raise bad("command: a list of arguments (command: [python, train.py]), never a shell string")
        if not isinstance(spec["command"], list) or not spec["command"]:
            raise bad("command: a non-empty list of arguments (command: [python, train.py])")
        spec["command"] = [str(part) for part in spec["command"]]
        spec.setdefault("template", SCRIPT_TEMPLATE)
    return spec
