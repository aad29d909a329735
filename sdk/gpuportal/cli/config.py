"""Where `portal` keeps the portal's URL and the token: one JSON file in the user's config folder.

The file is `$XDG_CONFIG_HOME/gpuportal/config.json` (`~/.config/gpuportal/config.json` without it; the
platform's own folder elsewhere), written with mode 0600 in a folder of mode 0700 since it holds a
secret. PORTAL_URL and PORTAL_TOKEN, when set, go over what the file says.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from pathlib import Path

import typer

from gpuportal.client import EXIT_AUTH, EXIT_BAD_INPUT, PortalError

APP_NAME = "gpuportal"
FILE_NAME = "config.json"


def config_path() -> Path:
    return Path(typer.get_app_dir(APP_NAME)) / FILE_NAME


@dataclasses.dataclass
class Config:
    url: str | None = None
    token: str | None = None
    username: str | None = None
    # The tenant a command uses when none is given and the user belongs to several.
    tenant: str | None = None


def load(path: Path | None = None) -> Config:
    """The saved settings (empty when there are none), without the environment's overrides."""
    path = path or config_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return Config()
    except (OSError, ValueError) as exc:
        raise PortalError(f"cannot read {path}: {exc} (remove it and run `portal login URL` again)",
                          EXIT_BAD_INPUT) from None
    if not isinstance(data, dict):
        raise PortalError(f"{path} is not a JSON object (remove it and run `portal login URL` again)", EXIT_BAD_INPUT)
    known = {field.name for field in dataclasses.fields(Config)}
    return Config(**{key: value for key, value in data.items() if key in known and isinstance(value, str)})


def save(config: Config, path: Path | None = None) -> Path:
    """Write the settings readable by their owner only (0600), replacing the file in one step."""
    path = path or config_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = {key: value for key, value in dataclasses.asdict(config).items() if value is not None}
    descriptor, temporary = tempfile.mkstemp(prefix=".config-", dir=path.parent)  # mkstemp makes it 0600
    try:
        with os.fdopen(descriptor, "w") as out:
            json.dump(data, out, indent=2)
            out.write("\n")
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return path


def effective(environ: dict[str, str] | None = None, path: Path | None = None) -> Config:
    """The saved settings with PORTAL_URL and PORTAL_TOKEN over them."""
    environ = os.environ if environ is None else environ
    config = load(path)
    if environ.get("PORTAL_URL"):
        config.url = environ["PORTAL_URL"]
    if environ.get("PORTAL_TOKEN"):
        config.token = environ["PORTAL_TOKEN"]
    return config


def require_login(config: Config) -> tuple[str, str]:
    """The URL and token to send, or a PortalError (exit 3) saying how to get them."""
    if not config.url:
        raise PortalError("no portal to talk to: run `portal login URL`, or set PORTAL_URL and PORTAL_TOKEN", EXIT_AUTH)
    if not config.token:
        raise PortalError(f"not logged in to {config.url}: run `portal login {config.url}`, or set PORTAL_TOKEN",
                          EXIT_AUTH)
    return config.url, config.token
