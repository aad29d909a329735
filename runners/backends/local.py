"""The embedded backend: everything on this machine.

An environment is a workspace folder holding a record of its namespace,
members and quota; jobs (a later issue) run as real processes inside it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from runners.backends.base import EnvironmentSpec, PermanentBackendError, TransientBackendError

RECORD_NAME = "environment.json"


class LocalBackend:
    name = "local"

    def __init__(self, *, workspace_dir: Path, provision_delay_s: float = 0.0) -> None:
        self.workspace_dir = Path(workspace_dir)
        self.provision_delay_s = provision_delay_s

    def workspace(self, spec: EnvironmentSpec) -> Path:
        return self.workspace_dir / spec.namespace

    def read_record(self, spec: EnvironmentSpec) -> dict | None:
        path = self.workspace(spec) / RECORD_NAME
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None

    def ensure_environment(self, spec: EnvironmentSpec) -> None:
        workspace = self.workspace(spec)
        try:
            workspace.mkdir(parents=True, exist_ok=True)
            for sub in ("jobs", "checkpoints", "data"):
                (workspace / sub).mkdir(exist_ok=True)
        except PermissionError as exc:
            raise PermanentBackendError(f"Cannot create workspace {workspace}: {exc.strerror}.") from exc
        except OSError as exc:
            raise TransientBackendError(f"Cannot create workspace {workspace}: {exc.strerror}.") from exc
        if self.provision_delay_s:
            time.sleep(self.provision_delay_s)
        previous = self.read_record(spec)
        desired = {
            "environment_id": spec.environment_id,
            "tenant": spec.tenant_slug,
            "name": spec.name,
            "namespace": spec.namespace,
            "members": [asdict(member) for member in spec.members],
            "quota_hard": dict(sorted(spec.quota_hard.items())),
        }
        if previous is not None and {k: previous.get(k) for k in desired} == desired:
            return  # Already converged: leave the file (and its mtime) alone.
        record = {**desired, "created_at": (previous or {}).get("created_at") or datetime.now(UTC).isoformat()}
        record["updated_at"] = datetime.now(UTC).isoformat()
        # Write then rename, so a crash never leaves a half-written record.
        handle, temp_path = tempfile.mkstemp(dir=workspace, prefix=".environment-", suffix=".json")
        with os.fdopen(handle, "w") as stream:
            json.dump(record, stream, indent=2, sort_keys=True)
        os.replace(temp_path, workspace / RECORD_NAME)

    def delete_environment(self, spec: EnvironmentSpec) -> None:
        workspace = self.workspace(spec)
        if not workspace.exists():
            return
        # Rename first so a half-deleted tree is never mistaken for a live workspace.
        doomed = workspace.with_name(f".deleting-{workspace.name}-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.replace(workspace, doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=False)

    def environment_exists(self, spec: EnvironmentSpec) -> bool:
        return self.workspace(spec).exists()
