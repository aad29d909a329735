"""Jobs on the local backend: each attempt's replicas are real processes on this host.

One attempt lives in ``<jobs_dir>/<job id>/attempts/<n>/``: ``launch.json`` (what to run, and where
each rank was placed), ``supervisor.pid``, ``rank-<r>.log``, ``rank-<r>.exit``, ``rank-<r>.activity.json``
(how busy the rank keeps its simulated GPU: `runners.workloads.activity`) and ``scratch/`` (the
replicas' $HOME, $TMPDIR and caches). The job folder itself is the trainer's (``metrics.jsonl``,
``checkpoints/``), shared by every attempt, so a relaunch resumes from the newest checkpoint.
`runners.workloads.supervise` starts the replicas in a process group of their own and records
their exit codes; nothing here waits for a process, so a worker restart loses nothing and the
status is read from the outside.

GPU readings: a rank on one of this host's own GPUs (``real_gpu_nodes``) is read through NVML
(`nvml_readings`); a rank on a simulated node reports the activity it measured itself.

The shipped trainer (pytorch-ddp) runs unsandboxed, and only the job's spec steers it: its settings
are flags built from the spec; the variables a tenant set pass `runners.workloads.env_policy`
(checked by the portal, and again here); of the host's own variables a replica sees only
``HOST_VARIABLES``; its $HOME, $TMPDIR and caches are folders of the attempt; and its memory is
bounded by memory_mib_per_replica (RLIMIT_DATA, see `runners.workloads.supervise`).

A ``script`` job runs the tenant's own code: its ``command`` (an argument list, no shell) in its bundle,
unpacked once per (tenant, digest) into ``<var>/unpacked-bundles/<tenant>/<digest>/`` (read-only), with a Python
environment per requirements.txt (``<var>/envs/<hash>/``, built by the supervisor before the replicas
start: `runners.workloads.supervise`), in the sandbox (`runners.workloads.sandbox`) unless
LOCAL_SANDBOX says off. Pure Python, no Django.

Node caches: each simulated node's cache of blobs (`runners.storage.nodecache`) is a folder of its own,
``<pool's cache path or node_cache_dir>/<node>/``. A launch that names datasets (or a serving replica's
weights) records, per node it was placed on, what the supervisor fills there before the ranks start; each
rank gets PORTAL_DATASETS, the manifest in its attempt's view of its node's cache; ``forget`` releases the
attempt's pins. ``node_cache_snapshots`` reads the caches for the portal's rows of them (docs/storage.md).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import BinaryIO

from runners.backends.base import (
    PROGRESS_READ_MAX_BYTES,
    AttemptStatus,
    CheckpointFile,
    CheckpointGone,
    GpuReading,
    JobLaunch,
    NodeCacheSpec,
    NodeLostError,
    PermanentBackendError,
    ProgressRead,
    ReplicaPlacement,
    TransientBackendError,
)
from runners.nvidia import names
from runners.storage.nodecache import NodeCache, Snapshot
from runners.workloads import activity, env_policy, progress, sandbox, supervise

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
SUPERVISOR_MODULE = "runners.workloads.supervise"
TRAINER_MODULE = "runners.workloads.train"
SERVER_MODULE = "runners.workloads.serve"
# A workspace's server, run as a script: the sandbox shows this one file of the repository, not the rest.
WORKSPACE_SCRIPT = Path(__file__).resolve().parents[1] / "workloads" / "workspace.py"
# Workspaces' home folders, kept across their starts: <var>/workspace-homes/<tenant>/<workspace id>/.
WORKSPACE_HOMES_DIR = "workspace-homes"
# Where a workspace's JupyterLab listens: a Unix socket in a short folder of its own (a socket's path holds at
# most 107 bytes), shown at the same place inside the sandbox. Only the portal (root) can connect to it: no
# port, on the host or in the sandbox's network, answers for a workspace.
WORKSPACE_SOCKETS_DIR = Path("/run/portal-workspaces") if os.geteuid() == 0 else Path(tempfile.gettempdir()) / (
    f"portal-workspaces-{os.geteuid()}")
WORKSPACE_SOCKET = "jupyter.sock"
# An inference replica's own copy of the checkpoint it serves, in its job folder: the source job's
# trainer keeps only its newest few checkpoints, and the endpoint must not lose its model to that.
SERVED_MODEL_FILE = "served-model.pt"
# Where each endpoint's pinned checkpoints are kept: <jobs_dir>/endpoints/<endpoint id>/.
ENDPOINTS_DIR = "endpoints"
# How long a launch waits for the detached supervisor to say it is up.
SUPERVISOR_START_TIMEOUT_S = 20.0
# Variables of the portal host a replica inherits; everything else it gets is set below.
HOST_VARIABLES = ("PATH", "LANG", "LC_ALL", "VIRTUAL_ENV")
# Where a replica's home, temporary files and caches go: folders of the attempt's scratch folder,
# removed when the attempt is forgotten, never the host's.
SCRATCH_DIR = "scratch"
SCRATCH_VARIABLES = {
    "HOME": "home",
    "TMPDIR": "tmp",
    "XDG_CACHE_HOME": "cache",
    "TORCH_HOME": "cache/torch",
    "TORCHINDUCTOR_CACHE_DIR": "cache/torchinductor",
    "TRITON_CACHE_DIR": "cache/triton",
}
SCRIPT_TEMPLATE = "script"
# Where a script job's code and Python environments are cached, beside the jobs folder; unpacked bundles
# apart from the bundle store's archives (BUNDLE_STORAGE_URL defaults to <var>/bundles).
BUNDLES_DIR = "unpacked-bundles"
ENVS_DIR = "envs"
REQUIREMENTS_FILE = "requirements.txt"
# How many processes and threads the sandbox account may run at once, all sandboxed replicas of this host
# together (RLIMIT_NPROC counts per account): what stops a fork bomb.
SANDBOX_PROCESS_LIMIT = 4096
SANDBOX_MODES = ("auto", "on", "off")
# The attempt's file a sandbox shows as /etc/hosts.
SANDBOX_HOSTS_FILE = "sandbox-hosts"
# The attempt's folder a sandbox shows in place of the attempt's own (which the portal alone writes): what the
# replicas write there (the SDK's activity files) lands in it.
SANDBOX_ATTEMPT_DIR = "sandbox-attempt"
# The largest activity file read (one small JSON object).
ACTIVITY_MAX_BYTES = 64 * 1024
# Each node's cache (runners.storage.nodecache) when its pool sets none: <var>/node-cache/<node>/, this big.
NODE_CACHE_DIR = "node-cache"
NODE_CACHE_BYTES = 20 * 1024**3
# What a replica reads its datasets' manifest from (the SDK's ctx.dataset), and the manifest's name in the view.
DATASETS_VARIABLE = "PORTAL_DATASETS"
DATASETS_MANIFEST = "datasets.json"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _alive(pid: int) -> bool:
    """Whether this pid is a live supervisor of ours (not a zombie, not a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            state = stream.read().rsplit(")", 1)[1].split()[0]
        if state in ("Z", "X"):
            return False
        with open(f"/proc/{pid}/cmdline", "rb") as stream:
            return SUPERVISOR_MODULE.encode() in stream.read()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _attempt_processes(pgid: int, job_id: int, attempt: int, job_dir: Path, attempt_dir: Path) -> bool:
    """Whether process group `pgid` still holds a process of this attempt: its supervisor or one of its replicas.

    Checked by what each process is, not only by the number: a group whose processes all ended
    frees its id for reuse, and another attempt's group must never be signalled for this one.
    A replica is the trainer or the server on this job's folder, or a script job's command (or
    its sandbox) given this job's folder as TRAIN_JOB_DIR; each carries the attempt's marks.
    """
    marks = (f"PORTAL_JOB={job_id}\0".encode(), f"PORTAL_ATTEMPT={attempt}\0".encode())
    script_mark = f"\0TRAIN_JOB_DIR={job_dir}\0".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stream:
                fields = stream.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid or fields[0] in ("Z", "X"):
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as stream:
                args = stream.read().split(b"\0")
            if SUPERVISOR_MODULE.encode() in args and str(attempt_dir).encode() in args:
                return True
            inside = str(job_dir).encode()
            with open(f"/proc/{entry.name}/environ", "rb") as stream:
                environ = b"\0" + stream.read()
            if not all(b"\0" + mark in environ for mark in marks):
                continue
            if script_mark in environ + b"\0":
                return True
            if (TRAINER_MODULE.encode() in args or SERVER_MODULE.encode() in args) and any(
                arg == inside or arg.startswith(inside + b"/") for arg in args
            ):
                return True
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours to read
    return False


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class LocalJobs:
    """The job half of the local backend; `LocalBackend` hands it its state file."""

    def __init__(self, *, jobs_dir: Path, state, real_gpu_nodes, sandbox_mode: str = "auto",
                 bundle_storage_options: dict | None = None, sandbox_process_limit: int = SANDBOX_PROCESS_LIMIT,
                 data_storage_url: str = "", data_storage_options: dict | None = None,
                 node_cache_dir: Path | None = None, node_cache_bytes: int = NODE_CACHE_BYTES) -> None:
        if sandbox_mode not in SANDBOX_MODES:
            raise ValueError(f"sandbox_mode must be one of {', '.join(SANDBOX_MODES)}, not {sandbox_mode!r}")
        self.jobs_dir = Path(jobs_dir)
        self._state = state  # LocalBackend._state: the cluster state file, locked
        self._real_gpu_nodes = real_gpu_nodes  # () -> names of nodes whose GPUs are this host's
        self.sandbox_mode = sandbox_mode
        self.bundle_storage_options = dict(bundle_storage_options or {})
        self.sandbox_process_limit = sandbox_process_limit
        # The blob store the node caches are filled from (DATA_STORAGE_URL), and the caches' defaults.
        self.data_storage_url = data_storage_url or f"file://{self.jobs_dir.parent / 'store'}"
        self.data_storage_options = dict(data_storage_options or {})
        self.node_cache_dir = Path(node_cache_dir) if node_cache_dir else self.jobs_dir.parent / NODE_CACHE_DIR
        self.node_cache_bytes = int(node_cache_bytes)

    @property
    def bundles_dir(self) -> Path:
        return self.jobs_dir.parent / BUNDLES_DIR

    @property
    def envs_dir(self) -> Path:
        return self.jobs_dir.parent / ENVS_DIR

    def sandboxed(self) -> bool:
        """Whether script jobs run in the sandbox: LOCAL_SANDBOX, and for auto whether bwrap works here.

        PermanentBackendError when it is on and cannot run here: the job fails saying why."""
        if self.sandbox_mode == "off":
            return False
        why = sandbox.unavailable()
        if why is None:
            return True
        if self.sandbox_mode == "on":
            raise PermanentBackendError(f"LOCAL_SANDBOX is on, and the sandbox cannot run here: {why}.")
        _warn_unsandboxed(why)
        return False

    def job_dir(self, job_id: int) -> Path:
        return self.jobs_dir / str(job_id)

    def attempt_dir(self, job_id: int, attempt: int) -> Path:
        return self.job_dir(job_id) / activity.ATTEMPTS_DIR / str(attempt)

    def _supervisor(self, job_id: int, attempt: int) -> tuple[int, int] | None:
        try:
            pid, pgid = (self.attempt_dir(job_id, attempt) / supervise.PID_FILE).read_text().split()
        except (FileNotFoundError, ValueError):
            return None
        return int(pid), int(pgid)

    # --- launch ----------------------------------------------------------------

    def launch(self, launch: JobLaunch) -> int | None:
        if launch.serving is not None and launch.serving.image is not None:
            raise PermanentBackendError("Custom serving images run on the Kubernetes backend only.")
        if launch.serving is None and launch.workspace is None and launch.template not in ("pytorch-ddp",
                                                                                           SCRIPT_TEMPLATE):
            raise PermanentBackendError(
                f"Template {launch.template!r} runs on the Kubernetes backend only; locally pytorch-ddp and script run."
            )
        workspace = launch.workspace
        script = launch.serving is None and workspace is None and launch.template == SCRIPT_TEMPLATE
        if script and (launch.bundle is None or not launch.command):
            raise PermanentBackendError("A script job needs its bundle and its command.")
        attempt_dir = self.attempt_dir(launch.job_id, launch.attempt)
        if (attempt_dir / supervise.PID_FILE).exists():
            return json.loads((attempt_dir / supervise.LAUNCH_FILE).read_text()).get("resumed_from_step")
        with self._state(write=False) as state:
            down = set(state.get("down", []))
        lost = sorted({replica.node for replica in launch.replicas} & down)
        if lost:
            raise NodeLostError(f"Node {', '.join(lost)} is down.")
        refused = [f"{name}: {why}" for name, _ in launch.env if (why := env_policy.refusal(name))]
        if refused:
            raise PermanentBackendError(f"The job sets variables a tenant may not set: {'; '.join(refused)}.")
        job_dir = self.job_dir(launch.job_id)
        # A workspace runs whatever its member types: sandboxed as a script job is.
        sandboxed = (script or workspace is not None) and self.sandboxed()
        bundle_dir = self._bundle(launch) if script else None
        home = self._workspace_home(workspace.home) if workspace is not None else None
        attempt_dir.mkdir(parents=True, exist_ok=True)
        resumed = progress.latest_checkpoint_step(job_dir)
        restore = self._restore_plan(launch, job_dir)
        if restore is not None:
            # Restored before the ranks start; a newer checkpoint still in the folder is resumed from instead.
            resumed = max(restore["step"], resumed if resumed is not None else -1)
        port = free_port()
        real_nodes = self._real_gpu_nodes()
        host = {name: os.environ[name] for name in HOST_VARIABLES if name in os.environ}
        scratch = {}
        for name, folder in SCRATCH_VARIABLES.items():
            path = attempt_dir / SCRATCH_DIR / folder
            path.mkdir(parents=True, exist_ok=True)
            scratch[name] = str(path)
        # This host's cores shared out between the replicas running on it, and no more than each declared.
        per_host = max(1, (os.cpu_count() or 1) // max(1, len(launch.replicas)))
        threads = max(1, min(per_host, math.ceil(launch.cpu_milli_per_replica / 1000)))
        serving_port = None
        workspace_socket = None
        environment = None
        if workspace is not None:
            sockets = WORKSPACE_SOCKETS_DIR / hashlib.sha256(str(attempt_dir).encode()).hexdigest()[:16]
            sockets.mkdir(parents=True, exist_ok=True, mode=0o700)
            workspace_socket = sockets / WORKSPACE_SOCKET
            workspace_socket.unlink(missing_ok=True)
            argv = [sys.executable, str(WORKSPACE_SCRIPT), "--socket", str(workspace_socket), "--base-url",
                    workspace.base_url, "--home", str(home), "--grace-s", str(launch.grace_period_s)]
        elif script:
            environment = self._environment(bundle_dir)
            python = str(Path(environment["dir"]) / "bin" / "python") if environment else sys.executable
            argv = list(launch.command)
            if argv[0] in ("python", "python3"):
                argv[0] = python
        elif launch.serving is None:
            argv = [
                sys.executable, "-m", TRAINER_MODULE, "--job-dir", str(job_dir), "--steps", str(launch.steps),
                "--checkpoint-every", str(launch.checkpoint_every_steps), "--max-runtime-s", str(launch.max_runtime_s),
                *launch.trainer.flags(),
            ]
        elif launch.serving.weights is not None:
            # The model version's weights, as the supervisor fills them into this node's cache (below).
            model = self._cache_view(launch, launch.replicas[0].node) / launch.serving.weights.sha256
            serving_port = free_port()
            argv = [
                sys.executable, "-m", SERVER_MODULE, "--checkpoint", str(model), "--host", "127.0.0.1",
                "--port", str(serving_port), *launch.serving.flags(),
            ]
        else:
            model = job_dir / SERVED_MODEL_FILE
            if not model.exists():
                self._copy_atomically(self._pinned_checkpoint(launch.serving), model)
            serving_port = free_port()
            argv = [
                sys.executable, "-m", SERVER_MODULE, "--checkpoint", str(model), "--host", "127.0.0.1",
                "--port", str(serving_port), *launch.serving.flags(),
            ]
        caches = self._cache_plan(launch)
        replicas = []
        for replica in launch.replicas:
            # The trainer finds its activity file in this folder by itself (its command line is the spec's).
            replica_argv = argv if launch.serving is None else [
                *argv, "--activity-file", str(activity.activity_file(attempt_dir, replica.rank))]
            env = {
                **host,
                **dict(launch.env),
                **scratch,
                "OMP_NUM_THREADS": str(threads),
                # Threads waiting for work sleep instead of spinning: replicas share this host's cores
                # with each other and the portal. The shipped trainer on two threads, 100 steps beside a
                # busy suite: 42 CPU-s spinning (OpenMP's default), 5.8 passive, the same wall time.
                "OMP_WAIT_POLICY": "PASSIVE",
                "PORTAL_ATTEMPT": str(launch.attempt),
                "PORTAL_JOB": str(launch.job_id),
                "RANK": str(replica.rank),
                "WORLD_SIZE": str(len(launch.replicas)),
                "LOCAL_RANK": str(replica.rank),
                "LOCAL_WORLD_SIZE": str(len(launch.replicas)),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PYTHONUNBUFFERED": "1",
            }
            if script:
                env.update(_script_variables(launch, job_dir, environment, resumed))
            if workspace is not None:
                # The key reaches JupyterLab in its environment only (never on its command line, which any
                # account of the host may read); its home is the workspace's, kept across starts.
                env.update({"PORTAL_WORKSPACE_KEY": workspace.key, "HOME": str(home),
                            "JUPYTER_RUNTIME_DIR": str(Path(scratch["TMPDIR"]) / "jupyter-runtime")})
            if launch.datasets:
                env[DATASETS_VARIABLE] = str(self._cache_view(launch, replica.node) / DATASETS_MANIFEST)
            devices: list[str] = []
            if replica.node in real_nodes and replica.gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index) for index in replica.gpus)
                env["LOCAL_RANK"] = "0"  # each rank sees only its own GPUs
                devices = sorted(str(path) for path in Path("/dev").glob("nvidia*"))
            replicas.append({
                "rank": replica.rank, "argv": replica_argv, "env": env,
                "memory_limit_bytes": launch.memory_mib_per_replica * 1024 * 1024, "placement": asdict(replica),
                "devices": devices,
                "cache_view": str(self._cache_view(launch, replica.node)) if caches else None,
            })
        record = {
            "job_id": launch.job_id, "attempt": launch.attempt, "cwd": str(bundle_dir or home or REPO_ROOT),
            "replicas": replicas,
            "nodes": sorted({replica.node for replica in launch.replicas}), "resumed_from_step": resumed,
            "workload": launch.workload, "serving_port": serving_port, "gpu_resource": launch.gpu_resource,
            "workspace_socket": str(workspace_socket) if workspace_socket else None,
            "environment": environment,
            "sandbox": self._sandbox_record(job_dir, attempt_dir, bundle_dir or home, environment,
                                            writable=(home, workspace_socket.parent) if home else (),
                                            read_only=(WORKSPACE_SCRIPT,) if home else ())
            if sandboxed else None,
            "caches": caches,
            "restore": restore,
        }
        temp = attempt_dir / f".{supervise.LAUNCH_FILE}.tmp"
        temp.write_text(json.dumps(record, indent=2))
        os.replace(temp, attempt_dir / supervise.LAUNCH_FILE)
        with self._state(write=True) as state:
            for node in record["nodes"]:
                names = state["workloads"].setdefault(node, [])
                if launch.workload not in names:
                    names.append(launch.workload)
        # The store's URL and options (credentials, perhaps) reach the supervisor in its environment only,
        # never in launch.json, which the job's later attempts can read.
        storage = {supervise.STORAGE_VARIABLE: json.dumps(
            {"url": self.data_storage_url, "options": self.data_storage_options})} if caches or restore else {}
        try:
            subprocess.run(
                [sys.executable, "-m", SUPERVISOR_MODULE, str(attempt_dir)], cwd=REPO_ROOT, check=True, timeout=30,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                env={**os.environ, **storage},
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            raise TransientBackendError(f"Could not start the supervisor: {exc}") from None
        deadline = time.monotonic() + SUPERVISOR_START_TIMEOUT_S
        while self._supervisor(launch.job_id, launch.attempt) is None:
            if time.monotonic() > deadline:
                raise TransientBackendError(f"The supervisor of job {launch.job_id} did not start.")
            time.sleep(0.05)
        return resumed

    # --- resume from the store: what the supervisor restores before the ranks start ---------------

    def _restore_plan(self, launch: JobLaunch, job_dir: Path) -> dict | None:
        """What the supervisor restores from the store (`runners.workloads.checkpoint_restore`): the job's newest
        durable checkpoint, when the attempt's rank 0 lands on another node than the one that wrote it (this
        host's one job folder stands for that node's disk, which another node does not have), or when the
        folder's file is missing or of another size; "check" (hashed by the supervisor, restored when it is not
        the manifest's) otherwise. None without a durable checkpoint."""
        restore = launch.restore
        if restore is None or launch.serving is not None:
            return None
        relative = PurePosixPath(restore.path)
        if relative.is_absolute() or not relative.parts or ".." in relative.parts:
            return None
        if not relative.suffix:
            return None  # a folder checkpoint (the SDK names it without a suffix): stored as its .tar.gz, not unpacked
        manifest = json.loads(restore.manifest)
        landing = next((replica.node for replica in launch.replicas if replica.rank == 0), "")
        if restore.node and restore.node != landing:
            why = "elsewhere"
        else:
            with _job_file(job_dir.joinpath(*relative.parts)) as found:
                size = os.stat(found).st_size if found is not None else None
            why = "missing" if size is None else "damaged" if size != manifest.get("bytes") else "check"
        owner = None
        if launch.template == SCRIPT_TEMPLATE and self.sandboxed():
            who = sandbox.account()
            owner = [who.uid, who.gid]
        return {"step": restore.step, "path": str(relative), "job_dir": str(job_dir), "manifest": manifest,
                "why": why, "node": restore.node, "landing": landing, "owner": owner}

    # --- node caches: what the supervisor fills before the ranks start ----------------------------

    def node_cache(self, node: str, spec: NodeCacheSpec | None = None) -> tuple[Path, int]:
        """The node's cache folder and capacity: its pool's (``spec``) where set, else the defaults. Every
        simulated node of this host has a folder of its own, so a pool's path is the folder they lie in."""
        folder = Path(spec.path) if spec is not None and spec.path else self.node_cache_dir
        size = spec.capacity_bytes if spec is not None and spec.capacity_bytes else self.node_cache_bytes
        return folder / node, int(size)

    @staticmethod
    def cache_holder(job_id: int, attempt: int) -> str:
        """The name an attempt pins its blobs under, in every node cache it uses."""
        return f"job-{job_id}-attempt-{attempt}"

    def _cache_view(self, launch: JobLaunch, node: str) -> Path:
        specs = {spec.node: spec for spec in launch.node_caches}
        root, _size = self.node_cache(node, specs.get(node))
        return NodeCache.view_path(root, self.cache_holder(launch.job_id, launch.attempt))

    def _cache_plan(self, launch: JobLaunch) -> list[dict]:
        """What the supervisor fills on each node the attempt was placed on (one entry per node, whatever the
        number of its ranks there): the datasets' shards and a serving replica's weights, pinned for the
        attempt, and the manifest of the datasets (`DATASETS_MANIFEST`, in the attempt's view)."""
        blobs = [{"sha256": shard.sha256, "bytes": shard.bytes, "kind": "shards"}
                 for mount in launch.datasets for shard in mount.shards]
        if launch.serving is not None and launch.serving.weights is not None:
            weights = launch.serving.weights
            blobs.append({"sha256": weights.sha256, "bytes": weights.bytes, "kind": "models"})
        if not blobs and not launch.datasets:
            return []
        unique = list({blob["sha256"]: blob for blob in blobs}.values())
        datasets = [{"name": mount.name, "version": mount.version,
                     "shards": [[shard.sha256, shard.bytes] for shard in mount.shards]} for mount in launch.datasets]
        specs = {spec.node: spec for spec in launch.node_caches}
        plan = []
        for node in sorted({replica.node for replica in launch.replicas}):
            root, size = self.node_cache(node, specs.get(node))
            plan.append({"node": node, "root": str(root), "capacity_bytes": size,
                         "holder": self.cache_holder(launch.job_id, launch.attempt), "blobs": unique,
                         "datasets": datasets})
        return plan

    def node_cache_snapshots(self, specs: dict[str, NodeCacheSpec | None]) -> dict[str, Snapshot]:
        """What each of these nodes' caches holds now and its counters; a node whose cache was never filled
        is left out (nothing is made here)."""
        found = {}
        for node, spec in sorted(specs.items()):
            root, size = self.node_cache(node, spec)
            if (root / "index.json").is_file():
                found[node] = NodeCache(root, size).snapshot()
        return found

    def _release_caches(self, record: dict) -> None:
        for cache in record.get("caches") or []:
            try:
                NodeCache(cache["root"], cache["capacity_bytes"]).release(cache["holder"])
            except OSError as exc:  # a cache folder gone with its disk: nothing is pinned there any more
                logger.warning("Could not release %s in the cache %s: %s", cache["holder"], cache["root"], exc)

    # --- script jobs: the bundle, the environment, the sandbox --------------------------------

    def _bundle(self, launch: JobLaunch) -> Path:
        """The folder the job's bundle is unpacked in, read-only, unpacked now if it is not yet.

        Once per (tenant, digest): the archive is copied from its storage URL, its content digest checked,
        unpacked (gpuportal.bundle.extract refuses what may not be in a bundle) into a temporary folder
        beside, and renamed into place, so a folder of that name is always whole."""
        from gpuportal import bundle as bundles

        digest = launch.bundle.sha256
        if not (len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            raise PermanentBackendError(f"Not a bundle digest: {digest!r}.")
        folder = self.bundles_dir / launch.tenant_slug / digest
        if folder.is_dir():
            return folder
        folder.parent.mkdir(parents=True, exist_ok=True)
        import fsspec

        with tempfile.TemporaryFile() as archive:
            try:
                with fsspec.open(launch.bundle.url, "rb", **self.bundle_storage_options) as source:
                    shutil.copyfileobj(source, archive, 1024 * 1024)
            except FileNotFoundError:
                raise PermanentBackendError(f"The job's bundle is not in its storage ({launch.bundle.url}).") from None
            except OSError as exc:
                raise TransientBackendError(f"The job's bundle cannot be read from its storage: {exc}") from None
            try:
                archive.seek(0)
                temp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{digest}-"))
                try:
                    found = bundles.members_digest(bundles.extract(archive, temp))
                    if found != digest:
                        raise PermanentBackendError(f"The job's bundle is not the one it names: its digest is {found}.")
                    temp.chmod(0o555)
                    os.rename(temp, folder)
                except OSError:
                    if not folder.is_dir():
                        raise
                    # Another launch unpacked the same bundle meanwhile: theirs is as good.
                finally:
                    if temp.exists():
                        _remove_tree(temp)
            except bundles.BundleError as exc:
                raise PermanentBackendError(f"The job's bundle cannot be unpacked: {exc}") from None
        return folder

    def _environment(self, bundle_dir: Path) -> dict | None:
        """The Python environment the bundle's requirements.txt asks for (None: none, the runtime as it is).

        Keyed by the file's bytes and the runtime (its interpreter and its site-packages), so a new portal
        runtime builds anew; the supervisor builds it, once, before the replicas start."""
        requirements = bundle_dir / REQUIREMENTS_FILE
        if not requirements.is_file():
            return None
        runtime = sandbox.runtime_site_packages()
        key = hashlib.sha256(
            requirements.read_bytes() + b"\0" + sys.version.encode() + b"\0" + runtime.encode()
        ).hexdigest()
        return {"dir": str(self.envs_dir / key), "requirements": str(requirements), "runtime": runtime}

    def _sandbox_record(self, job_dir: Path, attempt_dir: Path, bundle_dir: Path, environment: dict | None, *,
                        writable: tuple[Path, ...] = (), read_only: tuple[Path, ...] = ()) -> dict:
        """What the supervisor needs to start each replica in the sandbox; the sandbox account gets the job
        folder and the attempt's scratch folder (the portal, root, reads them all the same). ``writable``:
        more folders the account gets and writes (a workspace's home, its socket's folder); then
        ``bundle_dir`` is the working directory and is writable too."""
        who = sandbox.account()
        for path in writable:
            os.chown(path, who.uid, who.gid)
        scratch = attempt_dir / SCRATCH_DIR
        for path in (job_dir, *[scratch / folder for folder in SCRATCH_VARIABLES.values()]):
            os.chown(path, who.uid, who.gid)
        for path in (scratch, scratch / "cache"):
            os.chown(path, who.uid, who.gid)
        read_only = [str(bundle_dir)] + ([environment["dir"]] if environment else []) + [str(p) for p in read_only]
        hosts = attempt_dir / SANDBOX_HOSTS_FILE
        hosts.write_text(sandbox.HOSTS)
        written = attempt_dir / SANDBOX_ATTEMPT_DIR
        written.mkdir(exist_ok=True)
        os.chown(written, who.uid, who.gid)
        return {
            "hosts": str(hosts),
            "uid": who.uid, "gid": who.gid, "process_limit": self.sandbox_process_limit,
            "read_only": [path for path in read_only if Path(path) not in writable],
            "writable": [str(job_dir), *[str(path) for path in writable]],
            "read_only_over": [str(job_dir / activity.ATTEMPTS_DIR)],
            "writable_over": [[str(written), str(attempt_dir)], [str(scratch), str(scratch)]],
            "cwd": str(bundle_dir),
        }

    def _pinned_checkpoint(self, serving) -> Path:
        """The endpoint's own copy of the checkpoint it serves, made by its first replica's launch: the source
        job's trainer keeps only its newest few files, and later replicas must still find this one."""
        relative = PurePosixPath(serving.checkpoint)
        if serving.source_job_id is None or relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise PermanentBackendError(f"Not a checkpoint within its job's folder: {serving.checkpoint!r}.")
        pinned = self.jobs_dir / ENDPOINTS_DIR / str(serving.endpoint_id) / (
            f"job-{serving.source_job_id}-" + "-".join(relative.parts))
        if not pinned.exists():
            pinned.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = _open_in_folder(self.job_dir(serving.source_job_id), relative.parts)
            except OSError as exc:
                raise PermanentBackendError(f"The checkpoint to serve cannot be read: {exc}.") from None
            with open(fd, "rb") as source:
                self._copy_atomically(source, pinned)
        return pinned

    @staticmethod
    def _copy_atomically(source: Path | BinaryIO, target: Path) -> None:
        temp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            if isinstance(source, Path):
                shutil.copyfile(source, temp)
            else:
                with open(temp, "wb") as copy:
                    shutil.copyfileobj(source, copy, 1024 * 1024)
        except OSError as exc:
            temp.unlink(missing_ok=True)
            raise PermanentBackendError(f"The checkpoint to serve cannot be read: {exc}.") from None
        os.replace(temp, target)

    def _workspace_home_path(self, home: str) -> Path:
        """Where a workspace's home folder (``<tenant>/<id>``) lies on this host."""
        relative = PurePosixPath(home)
        if relative.is_absolute() or ".." in relative.parts or len(relative.parts) != 2:
            raise PermanentBackendError(f"Not a workspace's home: {home!r}.")
        return self.jobs_dir.parent / WORKSPACE_HOMES_DIR / relative.parts[0] / relative.parts[1]

    def _workspace_home(self, home: str) -> Path:
        """A workspace's home folder, made on its first start and kept across the others."""
        folder = self._workspace_home_path(home)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def delete_workspace_home(self, home: str) -> None:
        shutil.rmtree(self._workspace_home_path(home), ignore_errors=True)

    def workspace_address(self, job_id: int, attempt: int) -> str | None:
        """``unix:<socket>`` of the attempt's JupyterLab once the socket is there."""
        try:
            record = json.loads((self.attempt_dir(job_id, attempt) / supervise.LAUNCH_FILE).read_text())
        except (FileNotFoundError, ValueError):
            return None
        socket_path = record.get("workspace_socket")
        if not socket_path or not stat.S_ISSOCK(_lstat_mode(socket_path)):
            return None
        return f"unix:{socket_path}"

    def serving_address(self, job_id: int, attempt: int) -> str | None:
        try:
            record = json.loads((self.attempt_dir(job_id, attempt) / supervise.LAUNCH_FILE).read_text())
        except (FileNotFoundError, ValueError):
            return None
        port = record.get("serving_port")
        return f"http://127.0.0.1:{port}" if port else None

    # --- status ----------------------------------------------------------------

    def status(self, job_id: int, attempt: int) -> AttemptStatus:
        attempt_dir = self.attempt_dir(job_id, attempt)
        try:
            record = json.loads((attempt_dir / supervise.LAUNCH_FILE).read_text())
        except FileNotFoundError:
            return AttemptStatus("lost", reason="The attempt was never launched on this host.")
        ranks = [replica["rank"] for replica in record["replicas"]]
        codes = {}
        for rank in ranks:
            try:
                codes[rank] = int(supervise.exit_path(attempt_dir, rank).read_text())
            except (FileNotFoundError, ValueError):
                pass
        with self._state(write=False) as state:
            down = sorted(set(record["nodes"]) & set(state.get("down", [])))
        supervisor = self._supervisor(job_id, attempt)
        if down:
            if supervisor:
                _signal_group(supervisor[1], signal.SIGKILL)
            return AttemptStatus("lost", codes, f"Node {', '.join(down)} was lost.", node_lost=True)
        if len(codes) == len(ranks):
            return AttemptStatus("exited", codes)
        try:
            # The supervisor could not prepare the replicas (a script job's environment): none started.
            return AttemptStatus("lost", codes, (attempt_dir / supervise.PREPARE_FAILED_FILE).read_text())
        except FileNotFoundError:
            pass
        if supervisor and _alive(supervisor[0]):
            return AttemptStatus("running", codes)
        if supervisor is None:
            return AttemptStatus("running", codes, "Starting.")
        # The supervisor is gone without every exit code written: killed (SIGKILL to the group).
        _signal_group(supervisor[1], signal.SIGKILL)
        return AttemptStatus("lost", codes, "The job's processes were killed or vanished.")

    def stop(self, job_id: int, attempt: int) -> None:
        supervisor = self._supervisor(job_id, attempt)
        if supervisor and _alive(supervisor[0]):
            _signal_group(supervisor[1], signal.SIGTERM)

    def kill(self, job_id: int, attempt: int) -> None:
        supervisor = self._supervisor(job_id, attempt)
        if supervisor:
            _signal_group(supervisor[1], signal.SIGKILL)

    def forget(self, job_id: int, attempt: int) -> None:
        """The attempt's outcome is recorded: kill whatever of it still runs, drop its scratch folder and its workload."""
        attempt_dir = self.attempt_dir(job_id, attempt)
        supervisor = self._supervisor(job_id, attempt)
        if supervisor and _attempt_processes(supervisor[1], job_id, attempt, self.job_dir(job_id), attempt_dir):
            _signal_group(supervisor[1], signal.SIGKILL)  # an ended attempt never keeps processes
        shutil.rmtree(attempt_dir / SCRATCH_DIR, ignore_errors=True)
        shutil.rmtree(attempt_dir / SANDBOX_ATTEMPT_DIR, ignore_errors=True)
        try:
            record = json.loads((attempt_dir / supervise.LAUNCH_FILE).read_text())
        except FileNotFoundError:
            return
        if record.get("workspace_socket"):
            shutil.rmtree(Path(record["workspace_socket"]).parent, ignore_errors=True)
        self._release_caches(record)  # the attempt reads no blob any more: the caches may evict them
        with self._state(write=True) as state:
            for node in record["nodes"]:
                names = state["workloads"].get(node, [])
                if record["workload"] in names:
                    names.remove(record["workload"])
                if not names:
                    state["workloads"].pop(node, None)

    def attempts_on(self, node: str, workload: str | None = None) -> list[tuple[int, int]]:
        """(job id, attempt) of the launched attempts with a replica on the node."""
        found = []
        for launch_file in self.jobs_dir.glob(f"*/attempts/*/{supervise.LAUNCH_FILE}"):
            try:
                record = json.loads(launch_file.read_text())
            except (OSError, ValueError):
                continue
            if node in record.get("nodes", []) and workload in (None, record.get("workload")):
                found.append((record["job_id"], record["attempt"]))
        return found

    # --- what it wrote -----------------------------------------------------------

    def logs(self, job_id: int, attempt: int, rank: int, *, tail: int) -> str:
        path = supervise.log_path(self.attempt_dir(job_id, attempt), rank)
        try:
            with open(path, "rb") as stream:
                stream.seek(0, os.SEEK_END)
                size = stream.tell()
                stream.seek(max(0, size - 256 * 1024))
                lines = stream.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-tail:]) + ("\n" if lines else "")

    def progress(self, job_id: int, attempt: int, cursor: dict) -> ProgressRead:
        """New records of the job folder's checkpoints.jsonl, stops.jsonl, datasets.jsonl, then metrics.jsonl, from
        the cursor's byte offsets.

        The cursor is {"checkpoints": offset, "stops": offset, "datasets": offset, "metrics": offset} (a missing
        or unusable key: 0). The files are the job's, shared by its attempts; the portal keeps one cursor per job
        and each record names its attempt, so nothing is filtered here. Checkpoints, stops and dataset reads
        first: they are few and what a resume (and an exit after a stop) needs; metrics take what is left of
        PROGRESS_READ_MAX_BYTES.
        Only whole lines are taken; ``bytes_read`` counts them (a torn last line read and left
        for the next call does not count, so a read that returns 0 means nothing new).
        """
        job_dir = self.job_dir(job_id)
        # A script's job folder is its own (the sandbox account's): a file there is read only if it is a
        # regular file, never through a link it left (another tenant's files) or from a FIFO (a hung read).
        left = PROGRESS_READ_MAX_BYTES
        found: dict[str, list[dict]] = {}
        new_cursor: dict[str, int] = {}
        keeps = {"stops": progress.is_stop, "datasets": progress.is_dataset_read}
        for key, name in (("checkpoints", progress.CHECKPOINTS_FILE), ("stops", progress.STOPS_FILE),
                          ("datasets", progress.DATASETS_FILE), ("metrics", progress.METRICS_FILE)):
            start = cursor.get(key) if isinstance(cursor, dict) else None
            start = start if isinstance(start, int) and not isinstance(start, bool) and start >= 0 else 0
            whole_budget = left == PROGRESS_READ_MAX_BYTES
            keep = keeps.get(key, progress.has_step)
            with _job_file(job_dir / name) as readable:
                if readable is None:
                    chunk = progress.Chunk([], start, 0)
                else:
                    chunk = progress.read_jsonl_chunk(readable, start, left, whole_budget=whole_budget, keep=keep)
            found[key] = chunk.records
            new_cursor[key] = chunk.offset
            left -= chunk.taken
        return ProgressRead(
            metrics=found["metrics"], checkpoints=found["checkpoints"], stops=found["stops"],
            datasets=found["datasets"], cursor=new_cursor,
            bytes_read=PROGRESS_READ_MAX_BYTES - left,
        )

    # --- Checkpoints -----------------------------------------------------------------

    def checkpoint(self, job_id: int, path: str) -> CheckpointFile:
        """A checkpoint of the job opened for reading: `path` (relative to the job folder, as its record says) is a
        regular file or a folder reached without following any link; a folder is read as a .tar.gz of its
        regular files and folders (links and anything else in it are left out). CheckpointGone otherwise.

        A script's job folder is the sandbox account's, so its records and files are the tenant's to write:
        a path out of the folder, a link to another tenant's files or a FIFO is never read."""
        relative = PurePosixPath(path)
        if not relative.parts or relative.is_absolute() or any(part in ("..", ".") for part in relative.parts):
            raise CheckpointGone(f"{path!r} is not a path within the job's folder")
        try:
            fd = _open_below(self.job_dir(job_id), relative.parts)
        except OSError as exc:
            raise CheckpointGone(f"{path} cannot be read: {exc.strerror or exc}") from None
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            return CheckpointFile(name=relative.name, size=os.fstat(fd).st_size, stream=open(fd, "rb"))
        if stat.S_ISDIR(mode):
            return CheckpointFile(name=relative.name, chunks=_FolderArchive(fd, relative.name))
        os.close(fd)
        raise CheckpointGone(f"{path} is neither a file nor a folder")

    # --- GPU readings ---------------------------------------------------------------

    def gpu_readings(self, attempts: set[tuple[int, int]]) -> dict[tuple[int, int], list[GpuReading]]:
        """One reading per device each rank of the attempts was placed on: NVML's for this host's own GPUs,
        the rank's measured activity for a simulated one (none once its file is stale: a hung or ended rank)."""
        real_nodes: set[str] | None = None  # asked of NVML once per call, and only when a rank is on a GPU
        found: dict[tuple[int, int], list[GpuReading]] = {}
        for job_id, attempt in sorted(attempts):
            attempt_dir = self.attempt_dir(job_id, attempt)
            try:
                record = json.loads((attempt_dir / supervise.LAUNCH_FILE).read_text())
            except (FileNotFoundError, ValueError):
                continue
            timeslice = record.get("gpu_resource") == names.TIMESLICE_RESOURCE
            # A sandboxed replica writes its activity in the folder it sees as its attempt's.
            written = attempt_dir / SANDBOX_ATTEMPT_DIR if record.get("sandbox") else attempt_dir
            readings: list[GpuReading] = []
            for replica in record["replicas"]:
                if not replica.get("placement", {}).get("gpus"):
                    continue  # launched before placements were recorded, or placed on no GPU
                placement = _placement(replica["placement"])
                if real_nodes is None:
                    real_nodes = self._real_gpu_nodes()
                if placement.node in real_nodes:
                    readings += _nvml_readings_logged(placement)
                else:
                    readings += _simulated_readings(written, placement, timeslice=timeslice)
            if readings:
                found[(job_id, attempt)] = readings
        return found


@functools.cache
def _warn_unsandboxed(why: str) -> None:
    """Said once per process: LOCAL_SANDBOX is auto and the sandbox cannot run here."""
    logger.warning("Script jobs run WITHOUT the sandbox here (LOCAL_SANDBOX=auto): %s.", why)


def _script_variables(launch: JobLaunch, job_dir: Path, environment: dict | None, resumed: int | None) -> dict:
    """What a script job's replica gets besides the trainer's variables: its hyperparameters, its job folder
    (where the SDK writes checkpoints and progress), its time budget, and where it resumes from.

    With more than one rank, TORCHELASTIC_USE_AGENT_STORE=True, as torchrun gives its workers: the attempt's
    supervisor hosts the rendezvous store on MASTER_PORT (`supervise`), and torch's env:// rendezvous
    connects every rank to it as a client, so the ranks may exit in any order. torch 2.13 puts no prefix
    under it (a new store per attempt), so TORCHELASTIC_RESTART_COUNT is not needed."""
    env = {
        "PORTAL_HYPERPARAMETERS": launch.hyperparameters_json,
        "TRAIN_JOB_DIR": str(job_dir),
        "TRAIN_MAX_RUNTIME_S": str(launch.max_runtime_s),
    }
    if len(launch.replicas) > 1:
        env[supervise.AGENT_STORE_VARIABLE] = "True"
    resume = resumed if resumed is not None else launch.resume_from_step
    if resume is not None:
        env["PORTAL_RESUME_FROM_STEP"] = str(resume)
    bins = [str(Path(sys.prefix) / "bin"), "/usr/local/bin", "/usr/bin", "/bin"]
    if environment:
        bins.insert(0, str(Path(environment["dir"]) / "bin"))
        env["VIRTUAL_ENV"] = environment["dir"]
    else:
        env["VIRTUAL_ENV"] = sys.prefix
    env["PATH"] = ":".join(bins)
    return env


@contextmanager
def _job_file(path: Path, *, max_bytes: int | None = None) -> Iterator[str | None]:
    """A path to read a job folder's file by (``/proc/self/fd/N``, the file opened here), or None where there is
    no regular file of at most `max_bytes`: missing, a link (never followed), a FIFO or device, too big.

    A script's job folder belongs to the sandbox account, so what lies there is the tenant's: a link to
    another tenant's files, or a FIFO that would hang the read. The path by descriptor reads the very file
    checked, whatever is put in its place meanwhile."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        yield None
        return
    try:
        info = os.fstat(fd)
        usable = stat.S_ISREG(info.st_mode) and (max_bytes is None or info.st_size <= max_bytes)
        yield f"/proc/self/fd/{fd}" if usable else None
    finally:
        os.close(fd)


def _open_in_folder(folder: Path, parts: tuple[str, ...]) -> int:
    """A read-only descriptor of the regular file at `parts` under `folder`, reached as `_open_below` does
    (OSError otherwise)."""
    found = _open_below(folder, parts)
    if not stat.S_ISREG(os.fstat(found).st_mode):
        os.close(found)
        raise OSError(f"{'/'.join(parts)} is not a regular file")
    return found


def _open_below(folder: Path, parts: tuple[str, ...]) -> int:
    """A read-only descriptor of whatever is at `parts` under `folder` (a file or a folder), reached without
    following any link below it and without blocking on a FIFO (OSError otherwise)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = inner
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


ARCHIVE_READ_BYTES = 1024 * 1024


class _FolderArchive:
    """A folder (its open descriptor) read as a gzip-compressed tar, made as it is read: the chunks of bytes,
    in name order. Only regular files and folders go in, each opened without following links; a file that
    shrinks while it is read is padded with zeros to the size its header gave. ``close`` closes the folder."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self._chunks = self._archive(name)

    def __iter__(self) -> Iterator[bytes]:
        return self._chunks

    def close(self) -> None:
        self._chunks.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _archive(self, name: str) -> Iterator[bytes]:
        gzip = zlib.compressobj(6, zlib.DEFLATED, 31)  # wbits 31: the gzip format
        for data in self._members(os.dup(self.fd), name):
            compressed = gzip.compress(data)
            if compressed:
                yield compressed
        yield gzip.compress(b"\0" * (2 * tarfile.BLOCKSIZE)) + gzip.flush()

    def _members(self, fd: int, prefix: str) -> Iterator[bytes]:
        """The tar blocks of the folder `fd` (closed here) under the name `prefix`, and of all it holds."""
        try:
            info = os.fstat(fd)
            yield _tar_header(prefix, tarfile.DIRTYPE, info)
            for entry in sorted(os.listdir(fd)):
                try:
                    inner = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
                except OSError:
                    continue  # a link, or gone meanwhile
                mode = os.fstat(inner).st_mode
                if stat.S_ISDIR(mode):
                    yield from self._members(inner, f"{prefix}/{entry}")
                elif stat.S_ISREG(mode):
                    yield from _file_blocks(inner, f"{prefix}/{entry}")
                else:
                    os.close(inner)
        finally:
            os.close(fd)


def _tar_header(name: str, kind: bytes, info: os.stat_result, size: int = 0) -> bytes:
    member = tarfile.TarInfo(name)
    member.type = kind
    member.size = size
    member.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    member.mtime = int(info.st_mtime)
    return member.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")


def _file_blocks(fd: int, name: str) -> Iterator[bytes]:
    """One regular file's tar member (`fd` is closed here): its header, then its bytes, padded to whole blocks."""
    try:
        info = os.fstat(fd)
        size = info.st_size
        yield _tar_header(name, tarfile.REGTYPE, info, size)
        left = size
        while left:
            data = os.read(fd, min(ARCHIVE_READ_BYTES, left)) or b"\0" * min(ARCHIVE_READ_BYTES, left)
            left -= len(data)
            yield data
        yield b"\0" * (-size % tarfile.BLOCKSIZE)
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> None:
    """Remove a folder whose files may be read-only."""
    for root, folders, _files in os.walk(path):
        for name in folders:
            os.chmod(os.path.join(root, name), 0o755)
    os.chmod(path, 0o755)
    shutil.rmtree(path, ignore_errors=True)


def _placement(data: dict) -> ReplicaPlacement:
    return ReplicaPlacement(
        rank=data["rank"], node=data["node"], gpus=tuple(data["gpus"]), mig_profile=data.get("mig_profile"),
        mig_start=data.get("mig_start"),
    )


def simulated_device(placement: ReplicaPlacement, index: int, *, timeslice: bool) -> str:
    """A simulated GPU's name: ``<node>/gpu<index>``, then ``/mig-<profile>@<start>`` for a MIG instance or
    ``/ts`` for a time-slice share of the GPU."""
    name = f"{placement.node}/gpu{index}"
    if placement.mig_profile is not None:
        return f"{name}/mig-{placement.mig_profile}@{placement.mig_start}"
    return f"{name}/ts" if timeslice else name


def _simulated_readings(attempt_dir: Path, placement: ReplicaPlacement, *, timeslice: bool) -> list[GpuReading]:
    """The rank's own measured activity, on each device it was placed on.

    Its memory is shared out evenly over those devices, so that their sum is the rank's (a simulated GPU
    holds nothing of its own to count).
    """
    with _job_file(activity.activity_file(attempt_dir, placement.rank), max_bytes=ACTIVITY_MAX_BYTES) as readable:
        found = None if readable is None else activity.read_activity(Path(readable), now=time.time())
    if found is None:
        return []
    memory = found["memory_used_mib"]
    return [
        GpuReading(
            rank=placement.rank, device=simulated_device(placement, index, timeslice=timeslice), at=found["at"],
            source="simulated", gpu_util_pct=round(found["busy_fraction"] * 100, 1),
            memory_used_mib=None if memory is None else round(memory / len(placement.gpus), 1),
        )
        for index in placement.gpus
    ]


@functools.cache
def _nvml() -> ModuleType:
    """pynvml, initialised once for this process and left so (NVML counts its inits: the inventory's own
    init and shutdown pairs do not undo this one). Raises where there is no library or driver; a failure
    is not cached, so the next call tries again."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def _nvml_readings_logged(placement: ReplicaPlacement) -> list[GpuReading]:
    try:
        return nvml_readings(_nvml(), placement)
    except Exception as exc:  # no driver or library (pynvml raises NVMLError, or ImportError without the package)
        logger.warning("No NVML readings for rank %s on %s: %s", placement.rank, placement.node, exc)
        return []


def nvml_readings(nvml: ModuleType, placement: ReplicaPlacement) -> list[GpuReading]:
    """NVML's readings of each GPU (or the MIG instance) the rank was placed on; `nvml` is the pynvml module.

    A whole or time-sliced GPU: utilization, memory and power, named by the GPU's UUID. A MIG instance: its
    memory only (NVML reports no utilization for one), named by the MIG device's UUID; it is found by its
    GPU instance's placement start, which NVML lets privileged users read (nvmlDeviceGetGpuInstanceById).
    A device NVML fails on gives no reading (logged); a GPU that reports no power gets None.
    """
    readings = []
    for index in placement.gpus:
        try:
            gpu = nvml.nvmlDeviceGetHandleByIndex(index)
            if placement.mig_start is not None:
                device = _mig_device(nvml, gpu, placement.mig_start)
                if device is None:
                    logger.warning("No MIG instance at start %s on GPU %s", placement.mig_start, index)
                    continue
                readings.append(GpuReading(
                    rank=placement.rank, device=_text(nvml.nvmlDeviceGetUUID(device)), at=time.time(), source="nvml",
                    memory_used_mib=nvml.nvmlDeviceGetMemoryInfo(device).used / 2**20,
                ))
                continue
            try:
                power_w = nvml.nvmlDeviceGetPowerUsage(gpu) / 1000
            except nvml.NVMLError:
                power_w = None
            readings.append(GpuReading(
                rank=placement.rank, device=_text(nvml.nvmlDeviceGetUUID(gpu)), at=time.time(), source="nvml",
                gpu_util_pct=float(nvml.nvmlDeviceGetUtilizationRates(gpu).gpu),
                memory_used_mib=nvml.nvmlDeviceGetMemoryInfo(gpu).used / 2**20, power_w=power_w,
            ))
        except nvml.NVMLError as exc:
            logger.warning("NVML could not read GPU %s for rank %s: %s", index, placement.rank, exc)
    return readings


def _mig_device(nvml: ModuleType, gpu, start: int):
    """The MIG device of `gpu` whose GPU instance begins at memory slice `start`, or None."""
    for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu)):
        try:
            device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot)
        except nvml.NVMLError_NotFound:
            continue  # an empty slot
        instance = nvml.nvmlDeviceGetGpuInstanceById(gpu, nvml.nvmlDeviceGetGpuInstanceId(device))
        if nvml.nvmlGpuInstanceGetInfo(instance).placement.start == start:
            return device
    return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _lstat_mode(path: str) -> int:
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0
