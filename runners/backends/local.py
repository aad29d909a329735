"""The embedded backend: everything on this machine.

An environment is a workspace folder holding a record of its namespace,
members and quota; jobs (a later issue) run as real processes inside it.
The inventory is the cluster file (simulated capacity) plus any GPU that NVML
finds here; what the portal changes about it (cordons, partitions) lives in a
state file beside the workspaces, so the cluster file itself is never edited.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path

from runners.backends.base import (
    AttemptStatus,
    CheckpointFile,
    EnvironmentSpec,
    GpuInfo,
    GpuReading,
    JobLaunch,
    NodeInfo,
    PartitionSpec,
    PermanentBackendError,
    ProgressRead,
    TransientBackendError,
    resources_of,
)
from runners.backends.cluster_file import ClusterFileError, load_cluster_file
from runners.backends.local_jobs import LocalJobs
from runners.nvidia import mig

logger = logging.getLogger(__name__)

RECORD_NAME = "environment.json"


class LocalBackend:
    name = "local"

    def __init__(
        self,
        *,
        workspace_dir: Path,
        provision_delay_s: float = 0.0,
        cluster_file: Path | None = None,
        state_file: Path | None = None,
        use_nvml: bool = True,
        jobs_dir: Path | None = None,
        sandbox: str = "auto",
        bundle_storage_options: dict | None = None,
        node_caches: dict | None = None,
    ) -> None:
        self.workspace_dir = Path(workspace_dir)
        self.provision_delay_s = provision_delay_s
        self.cluster_file = Path(cluster_file) if cluster_file else None
        self.state_file = Path(state_file) if state_file else self.workspace_dir.parent / "cluster-state.json"
        self.use_nvml = use_nvml
        self.jobs = LocalJobs(
            jobs_dir=Path(jobs_dir) if jobs_dir else self.workspace_dir.parent / "jobs",
            state=self._state,
            real_gpu_nodes=lambda: {node.name for node in _nvml_nodes(self.use_nvml)},
            sandbox_mode=sandbox,  # LOCAL_SANDBOX: script jobs in the sandbox (runners.workloads.sandbox)
            bundle_storage_options=bundle_storage_options,  # BUNDLE_STORAGE_OPTIONS: how a bundle's URL is read
            # The blob store the node caches fill from and their defaults (runners.storage.nodecache).
            **(node_caches or {}),
        )

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
        if previous is not None and previous.get("environment_id") != spec.environment_id:
            raise PermanentBackendError(
                f"Workspace {workspace} belongs to environment {previous.get('environment_id')}; "
                "it is being deleted or was left behind, so try again after its teardown."
            )
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

    def delete_environment(self, spec: EnvironmentSpec) -> bool:
        workspace = self.workspace(spec)
        if not workspace.exists():
            return True
        record = self.read_record(spec)
        if record is not None and record.get("environment_id") != spec.environment_id:
            # A newer environment reuses the namespace; a late teardown of the old one must not touch it.
            return True
        # Rename first so a half-deleted tree is never mistaken for a live workspace.
        doomed = workspace.with_name(f".deleting-{workspace.name}-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.replace(workspace, doomed)
        except FileNotFoundError:
            return True
        shutil.rmtree(doomed, ignore_errors=False)
        return True

    def environment_exists(self, spec: EnvironmentSpec) -> bool:
        return self.workspace(spec).exists()

    def member_kubeconfig(self, spec: EnvironmentSpec, member, *, expiration_s: int, timeout_s: float):
        raise PermanentBackendError(
            f"Environment {spec.environment_id} runs on the local backend; it has no kubeconfig "
            f"(its workspace is {self.workspace(spec)})."
        )

    def revoke_member_access(self, spec: EnvironmentSpec, username: str) -> None:
        """Nothing to revoke: a workspace hands out no credentials (its member list is re-synced)."""

    # --- Inventory and partitions ------------------------------------------

    @contextmanager
    def _state(self, *, write: bool):
        """The state file's content, under an exclusive lock when it will be written."""
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.state_file.with_suffix(".lock")
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX if write else fcntl.LOCK_SH)
            try:
                state = json.loads(self.state_file.read_text())
            except FileNotFoundError:
                state = {}
            state.setdefault("nodes", {})
            state.setdefault("workloads", {})
            yield state
            if write:
                handle, temp_path = tempfile.mkstemp(dir=self.state_file.parent, prefix=".cluster-state-")
                with os.fdopen(handle, "w") as stream:
                    json.dump(state, stream, indent=2, sort_keys=True)
                os.replace(temp_path, self.state_file)

    def _file_nodes(self) -> list[NodeInfo]:
        if self.cluster_file is None:
            return []
        try:
            return load_cluster_file(self.cluster_file)
        except ClusterFileError as exc:
            raise PermanentBackendError(str(exc)) from None

    def discover_inventory(self) -> list[NodeInfo]:
        nodes = self._file_nodes() + _nvml_nodes(self.use_nvml)
        with self._state(write=False) as state:
            overrides = state["nodes"]
            down = set(state.get("down", []))
        return [_with_overrides(node, overrides.get(node.name, {})) for node in nodes if node.name not in down]

    def _node(self, node_name: str) -> NodeInfo:
        for node in self.discover_inventory():
            if node.name == node_name:
                return node
        raise PermanentBackendError(f"There is no node {node_name!r} in the local inventory.")

    def cordon(self, node_name: str) -> None:
        self._node(node_name)
        with self._state(write=True) as state:
            state["nodes"].setdefault(node_name, {})["unschedulable"] = True

    def uncordon(self, node_name: str) -> None:
        self._node(node_name)
        with self._state(write=True) as state:
            state["nodes"].setdefault(node_name, {})["unschedulable"] = False

    def node_workloads(self, node_name: str) -> list[str]:
        # Jobs launched by the local backend register themselves here while they run.
        with self._state(write=False) as state:
            return list(state["workloads"].get(node_name, []))

    def workload_job(self, workload: str) -> str:
        # A job of ours registers itself as `namespace/job-<id>` (JobLaunch.workload).
        return workload.rsplit("/", 1)[-1]

    def evict(self, node_name: str, workload: str, *, grace_period_s: int) -> None:
        attempts = self.jobs.attempts_on(node_name, workload)
        if attempts:
            # A job of ours: it checkpoints and exits; it leaves the list once its end is recorded.
            for job_id, attempt in attempts:
                self.jobs.stop(job_id, attempt)
            return
        with self._state(write=True) as state:
            running = state["workloads"].get(node_name, [])
            if workload in running:
                running.remove(workload)

    def apply_partition(self, node_name: str, partition: PartitionSpec) -> None:
        node = self._node(node_name)
        models = {gpu.model for gpu in node.gpus}
        if models and models != {partition.gpu_model}:
            raise PermanentBackendError(
                f"Node {node_name} has {', '.join(sorted(models))} GPUs; profile {partition.name} is for {partition.gpu_model}."
            )
        if partition.kind == "mig":
            try:
                mig.fit_layout(partition.gpu_model, list(partition.layout))
            except mig.MigError as exc:
                raise PermanentBackendError(f"Profile {partition.name}: {exc}") from None
        with self._state(write=True) as state:
            state["nodes"].setdefault(node_name, {})["partition"] = {
                "name": partition.name,
                "kind": partition.kind,
                "layout": list(partition.layout),
                "replicas": partition.replicas,
            }

    def partition_applied(self, node_name: str, partition: PartitionSpec) -> bool:
        node = self._node(node_name)
        return node.gpu_resources == partition.expected_resources(len(node.gpus))


    # --- Jobs (runners.backends.local_jobs) ---------------------------------------

    def launch_job(self, launch: JobLaunch) -> int | None:
        return self.jobs.launch(launch)

    def job_status(self, job_id: int, attempt: int) -> AttemptStatus:
        return self.jobs.status(job_id, attempt)

    def stop_job(self, job_id: int, attempt: int, *, grace_period_s: int) -> None:
        self.jobs.stop(job_id, attempt)  # the portal kills after the grace period

    def kill_job(self, job_id: int, attempt: int) -> None:
        self.jobs.kill(job_id, attempt)

    def forget_job(self, job_id: int, attempt: int) -> None:
        self.jobs.forget(job_id, attempt)

    def node_cache_snapshots(self, specs):
        """What each node's cache holds (runners.storage.nodecache snapshots), for the portal's rows of them."""
        return self.jobs.node_cache_snapshots(specs)

    def serving_address(self, job_id: int, attempt: int, *, namespace: str = "") -> str | None:
        return self.jobs.serving_address(job_id, attempt)  # one host: the attempt's own record says where

    def workspace_address(self, job_id: int, attempt: int, *, namespace: str = "") -> str | None:
        return self.jobs.workspace_address(job_id, attempt)

    def delete_workspace_home(self, home: str) -> None:
        self.jobs.delete_workspace_home(home)

    def job_logs(self, job_id: int, attempt: int, rank: int, *, tail: int) -> str:
        return self.jobs.logs(job_id, attempt, rank, tail=tail)

    def jobs_open(self, attempts: dict[tuple[int, int], str]) -> None:
        """Nothing to do here: a local attempt binds nothing, and its processes and scratch folder go with
        forget_job. Killing or dropping what is not in `attempts` would race a launch made after the
        portal took its list, so the local backend acts on an attempt only when told that attempt's end."""

    def job_progress(self, job_id: int, attempt: int, cursor: dict) -> ProgressRead:
        return self.jobs.progress(job_id, attempt, cursor)

    def job_checkpoint(self, job_id: int, namespace: str, path: str) -> CheckpointFile:
        return self.jobs.checkpoint(job_id, path)

    def gpu_readings(self, attempts: set[tuple[int, int]]) -> dict[tuple[int, int], list[GpuReading]]:
        return self.jobs.gpu_readings(attempts)

    def set_node_down(self, node_name: str, down: bool = True) -> None:
        """Simulate losing a node (or getting it back): it leaves the inventory and its jobs' processes die."""
        if down:
            self._node(node_name)
        with self._state(write=True) as state:
            nodes = set(state.get("down", []))
            nodes = nodes | {node_name} if down else nodes - {node_name}
            state["down"] = sorted(nodes)
        if down:
            for job_id, attempt in self.jobs.attempts_on(node_name):
                self.jobs.kill(job_id, attempt)

def _with_overrides(node: NodeInfo, override: dict) -> NodeInfo:
    """A file node with what the portal changed since: cordon and partition."""
    gpus = node.gpus
    partition = override.get("partition")
    if partition and gpus:
        gpus = tuple(_repartition(gpu, partition) for gpu in gpus)
    labels = dict(node.labels)
    if partition:
        labels["portal.gpu/partition-profile"] = partition.get("name", "")
    return replace(
        node,
        gpus=gpus,
        labels=labels,
        gpu_resources=resources_of(gpus),
        schedulable=not override.get("unschedulable", False),
    )


def _repartition(gpu: GpuInfo, partition: dict) -> GpuInfo:
    kind = partition["kind"]
    if kind == "mig":
        placed = tuple(mig.fit_layout(gpu.model, list(partition["layout"])))
        return replace(gpu, partition_kind="mig", mig_layout=placed, timeslice_replicas=1)
    if kind == "timeslice":
        return replace(gpu, partition_kind="timeslice", mig_layout=(), timeslice_replicas=int(partition["replicas"]))
    return replace(gpu, partition_kind="whole", mig_layout=(), timeslice_replicas=1)


def _nvml_nodes(enabled: bool) -> list[NodeInfo]:
    """This machine as a node, when NVML finds GPUs on it; nothing otherwise."""
    if not enabled:
        return []
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # No driver, no library, or no GPU: the common case on a laptop.
        logger.debug("NVML not available: %s", exc)
        return []
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            memory_mib = pynvml.nvmlDeviceGetMemoryInfo(handle).total // (1024 * 1024)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            gpus.append(
                GpuInfo(
                    index=index,
                    model=_catalog_model(name, memory_mib),
                    memory_mib=int(memory_mib),
                    uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                )
            )
    finally:
        pynvml.nvmlShutdown()
    if not gpus:
        return []
    gpus_tuple = tuple(gpus)
    return [
        NodeInfo(
            name=socket.gethostname(),
            cpu_milli=(os.cpu_count() or 1) * 1000,
            memory_mib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024),
            pool="local-gpus",
            labels={"portal.gpu/source": "nvml"},
            gpus=gpus_tuple,
            gpu_resources=resources_of(gpus_tuple),
        )
    ]


def _catalog_model(nvml_name: str, memory_mib: int) -> str:
    """The catalog's name for an NVML device name ("NVIDIA H100 80GB HBM3" -> "H100-80GB")."""
    label = nvml_name.replace(" ", "-")
    for model in mig.GPU_MODELS.values():
        if label in model.product_labels:
            return model.name
    return label
