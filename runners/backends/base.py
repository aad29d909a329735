"""The contract between the portal and whatever runs the work.

Backends receive plain, frozen specs built by the portal (never Django model
instances), so they can be tested without a database and can never be handed
anything a tenant typed in directly. Every method reconciles toward the desired
state: calling it twice has the same effect as calling it once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, Literal, Protocol, runtime_checkable

from runners.nvidia import names
from runners.workloads.serve_settings import Settings as ServerDefaults


class BackendError(Exception):
    """Base class for errors a backend reports to the portal."""


class TransientBackendError(BackendError):
    """The call may succeed if retried later (timeouts, 5xx, conflicts in flight)."""


class PermanentBackendError(BackendError):
    """Retrying will not help; the message says what an operator must fix."""


class NodeLostError(PermanentBackendError):
    """A node the attempt was placed on is gone: the attempt ends node_lost (requeued), not failed."""


class CheckpointGone(BackendError):
    """The checkpoint's file is not in its job's folder (deleted, or not a regular file or folder there)."""


class CheckpointElsewhere(BackendError):
    """This backend keeps checkpoints where the portal does not read them; the message says how to get one."""


@dataclass(frozen=True)
class MemberBinding:
    """One portal user's access to an environment."""

    username: str
    role: str  # the tenant role's name (viewer, member, admin, owner); tenants.models.Role owns them


@dataclass(frozen=True)
class EnvironmentSpec:
    """Everything a backend needs to build one tenant environment.

    ``quota_hard`` maps Kubernetes ResourceQuota keys (``requests.`` and an
    extended resource from ``runners.nvidia.names``) to whole counts; a
    resource that is absent is not granted at all.
    """

    environment_id: int
    tenant_slug: str
    name: str
    namespace: str
    members: tuple[MemberBinding, ...] = ()
    quota_hard: dict[str, int] = field(default_factory=dict)

    def __hash__(self) -> int:  # dict fields are not hashable by default
        return hash((self.environment_id, self.namespace))


# Time-sliced GPUs are advertised as names.TIMESLICE_RESOURCE: the device plugin's
# time-slicing config renames shared replicas (renameByDefault: true) so they can
# never be mistaken for, or requested as, a whole GPU.


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as the backend sees it, with how it is partitioned now."""

    index: int
    model: str
    memory_mib: int
    uuid: str = ""
    partition_kind: str = "whole"  # whole | mig | timeslice
    mig_layout: tuple[tuple[str, int], ...] = ()  # (profile, start) per GPU instance
    timeslice_replicas: int = 1


@dataclass(frozen=True)
class NodeInfo:
    """One node of the inventory: capacity, topology and GPUs."""

    name: str
    cpu_milli: int
    memory_mib: int
    pool: str = ""
    rack: str = ""
    block: str = ""
    nvlink_domain: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    schedulable: bool = True
    gpus: tuple[GpuInfo, ...] = ()
    # Allocatable extended resources; backends that cannot report them derive them from gpus.
    gpu_resources: dict[str, int] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash(self.name)


@dataclass(frozen=True)
class PartitionSpec:
    """How every GPU of a node should be cut, as a backend applies it."""

    name: str
    gpu_model: str
    kind: str  # whole | mig | timeslice
    layout: tuple[str, ...] = ()
    replicas: int = 1

    def expected_resources(self, gpu_count: int) -> dict[str, int]:
        """The extended resources a node with gpu_count such GPUs reports once this is applied."""
        if gpu_count == 0:
            return {}
        if self.kind == "mig":
            resources: dict[str, int] = {}
            for profile in self.layout:
                key = names.mig_resource(profile)
                resources[key] = resources.get(key, 0) + gpu_count
            return resources
        if self.kind == "timeslice":
            return {names.TIMESLICE_RESOURCE: gpu_count * self.replicas}
        return {names.GPU_RESOURCE: gpu_count}


def resources_of(gpus: tuple[GpuInfo, ...]) -> dict[str, int]:
    """Extended resources a set of GPUs provides, as the device plugin would advertise them."""
    resources: dict[str, int] = {}
    for gpu in gpus:
        if gpu.partition_kind == "mig":
            for profile, _start in gpu.mig_layout:
                key = names.mig_resource(profile)
                resources[key] = resources.get(key, 0) + 1
        elif gpu.partition_kind == "timeslice":
            resources[names.TIMESLICE_RESOURCE] = resources.get(names.TIMESLICE_RESOURCE, 0) + gpu.timeslice_replicas
        else:
            resources[names.GPU_RESOURCE] = resources.get(names.GPU_RESOURCE, 0) + 1
    return resources


@dataclass(frozen=True)
class ReplicaPlacement:
    """Where the portal placed one replica: a node and GPU indices on it (a MIG slice names its instance)."""

    rank: int
    node: str
    gpus: tuple[int, ...] = ()
    mig_profile: str | None = None
    mig_start: int | None = None


@dataclass(frozen=True)
class TrainerSettings:
    """The shipped trainer's settings, all from the job's spec: the launcher passes each as a flag.

    Flags win over the trainer's TRAIN_* variables, and tenants may not set those anyway
    (``runners.workloads.env_policy``), so nothing but the spec steers the trainer.
    """

    lr: float = 0.003
    batch_size: int = 32
    seq_len: int = 64
    seed: int = 0
    keep_checkpoints: int = 3

    def flags(self) -> list[str]:
        return [
            "--lr", repr(float(self.lr)), "--batch-size", str(self.batch_size), "--seq-len", str(self.seq_len),
            "--seed", str(self.seed), "--keep-checkpoints", str(self.keep_checkpoints),
        ]


@dataclass(frozen=True)
class ShardRef:
    """One blob of the portal's content-addressed store (runners.storage.blobs): its sha256 and size. A dataset's
    shard (kind "shards") or a model version's weights (kind "models"); whoever reads it checks the hash.
    ``fetch_url``: a short-lived signed portal URL it can be read from where the node's cache cannot be (a pod
    without the cache); empty where none was signed."""

    sha256: str
    bytes: int
    fetch_url: str = ""


@dataclass(frozen=True)
class CheckpointRestore:
    """The job's newest durable checkpoint (runners.jobs.checkpoint_store), for a launch whose job folder on the
    node it lands on lacks it: restored from the store's chunks (each checked, the file whole or not at all)
    into the job folder before the ranks start, where the script's resume_from finds it. ``path`` is relative
    to the job folder, as its record has it; ``node``: where rank 0 of the attempt that wrote it ran ("" when
    not known); ``manifest``: its runners.storage.chunks manifest (JSON). Never the store's credentials: the
    backend has them (locally the supervisor gets them in its environment, PORTAL_DATA_STORAGE)."""

    step: int
    path: str
    node: str
    manifest: str


@dataclass(frozen=True)
class ServingSettings:
    """What an inference replica runs: the shipped server (runners.workloads.serve) over one checkpoint.

    ``checkpoint`` is where the checkpoint lies for the backend (a file on this host locally; a path on
    the source job's volume on Kubernetes, ``source_job_id`` naming that job). Every other field is a
    flag of the server, from the endpoint's validated spec.
    """

    endpoint_id: int
    checkpoint: str
    source_job_id: int | None = None
    # The shipped server's own defaults (runners/workloads/serve_settings.py): one place for both.
    queue_limit: int = ServerDefaults.queue_limit
    batch_token_budget: int = ServerDefaults.batch_token_budget
    max_batch_wait_ms: float = ServerDefaults.max_batch_wait_ms
    default_deadline_ms: float = ServerDefaults.default_deadline_ms
    max_deadline_ms: float = 25_000.0
    image: str | None = None  # a custom image (Kubernetes only); None runs the shipped server
    # The model version's weights (a blob of kind "models"): served from the node cache's copy where the node
    # has one, else fetched from the store; None for an endpoint deployed before the registry (``checkpoint``).
    weights: ShardRef | None = None
    # The engine the replica runs (runners.backends.engines): "shipped" (the server above) or a foreign one
    # ("vllm", "tgi", "sglang"; Kubernetes only), whose ``image`` is the endpoint's and which serves ``model``
    # (a folder in the image, or a name the engine resolves) as ``served_name`` with the settings below.
    engine: str = "shipped"
    model: str = ""
    served_name: str = ""
    max_model_len: int | None = None
    dtype: str = "auto"

    def __post_init__(self) -> None:
        # The replica job's spec is JSON: its weights arrive as {"sha256": ..., "bytes": ...}.
        if isinstance(self.weights, dict):
            object.__setattr__(self, "weights", ShardRef(**self.weights))

    def flags(self) -> list[str]:
        return [
            "--queue-limit", str(self.queue_limit), "--batch-token-budget", str(self.batch_token_budget),
            "--max-batch-wait-ms", repr(float(self.max_batch_wait_ms)),
            "--default-deadline-ms", repr(float(self.default_deadline_ms)),
            "--max-deadline-ms", repr(float(self.max_deadline_ms)),
        ]


# The headers a workspace's server trusts (the portal's edge and its probes send them, nothing else reaches the
# server). runners/workloads/workspace.py, which runs in the sandbox with no other file of the repository,
# spells them again; tests/workspaces/test_workspace_api.py holds the two spellings equal.
WORKSPACE_KEY_HEADER = "X-Portal-Workspace-Key"
WORKSPACE_USER_HEADER = "X-Portal-User"


@dataclass(frozen=True)
class WorkspaceSettings:
    """What a workspace (a job of kind "workspace", runners.workspaces) runs: JupyterLab
    (runners.workloads.workspace) under ``base_url``, its home folder kept across its starts, answering only
    requests that carry ``key`` (the portal's edge adds it after its own sign-in check)."""

    workspace_id: int
    base_url: str  # /workspaces/<id>/
    key: str
    # The folder kept across stops and starts (locally under WORKSPACE_HOMES_DIR; on Kubernetes a claim).
    home: str
    # The image on Kubernetes (an environment's setting, from ALLOWED_IMAGE_REGISTRIES); None: the portal's own.
    image: str | None = None


@dataclass(frozen=True)
class BundleRef:
    """The tenant's code bundle a `script` job runs in: its content digest (SHA-256) and where its archive lies,
    an fsspec URL (a folder under var/ or an S3 bucket) the backend reads."""

    sha256: str
    url: str
    # A short-lived signed portal URL the archive is fetched from where the storage URL cannot be read
    # (a Kubernetes pod: it holds no storage credentials); empty where the backend reads `url` itself.
    fetch_url: str = ""


@dataclass(frozen=True)
class DatasetMount:
    """One dataset version a job reads (its spec names it; the version is pinned at submit), shard by shard."""

    name: str
    version: int
    shards: tuple[ShardRef, ...] = ()


@dataclass(frozen=True)
class NodeCacheSpec:
    """One node's cache (runners.storage.nodecache) as its pool sets it: where it lies on the node ("" for the
    backend's default) and the most it may hold (0 for the backend's default)."""

    node: str
    path: str = ""
    capacity_bytes: int = 0


@dataclass(frozen=True)
class JobLaunch:
    """One attempt of a job, as the portal built it: nothing in here comes from a tenant unchecked."""

    job_id: int
    attempt: int
    tenant_slug: str
    namespace: str
    name: str
    # "pytorch-ddp" (the shipped trainer), "script" (`command` run in the tenant's `bundle`, either backend) or
    # "custom" (image and command; Kubernetes only).
    template: str
    replicas: tuple[ReplicaPlacement, ...]
    gpu_resource: str  # the extended resource each GPU unit is, from runners.nvidia.names
    gpus_per_replica: int
    cpu_milli_per_replica: int
    memory_mib_per_replica: int
    steps: int
    checkpoint_every_steps: int
    max_runtime_s: int
    env: tuple[tuple[str, str], ...] = ()
    image: str | None = None
    command: tuple[str, ...] | None = None
    # How long a stop gives the replicas to checkpoint (a pod's terminationGracePeriodSeconds).
    grace_period_s: int = 30
    # The newest checkpoint the portal has recorded: where a backend that cannot look at the
    # checkpoint files itself (Kubernetes: they are on a volume in the cluster) says it resumes.
    resume_from_step: int | None = None
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    # Set for an inference replica (a job of kind "serving"): it runs the server instead of the trainer.
    serving: ServingSettings | None = None
    # Set for a workspace (a job of kind "workspace"): it runs JupyterLab instead of the trainer.
    workspace: WorkspaceSettings | None = None
    # For a "script" job: its code, and the hyperparameters of its spec (JSON) that gpuportal.init() hands it.
    bundle: BundleRef | None = None
    hyperparameters_json: str = "{}"
    # The caches of the nodes the replicas were placed on, where their pools set a path or a size.
    node_caches: tuple[NodeCacheSpec, ...] = ()
    # The dataset versions the spec names, as the node's cache fills them and the script reads them.
    datasets: tuple[DatasetMount, ...] = ()
    # The newest durable checkpoint, restored from the store where the job folder lacks it (None: none durable).
    restore: CheckpointRestore | None = None
    # Kubernetes: where the pods' checkpoint uploader sends the job's checkpoints (a URL the portal signed for
    # the attempt, runners.jobs.checkpoint_upload); empty: no uploader.
    checkpoint_upload_url: str = ""

    @property
    def workload(self) -> str:
        """How the job shows in a node's workload list (what a partition change drains)."""
        return f"{self.namespace}/job-{self.job_id}"


# How an attempt stands, seen from outside: still starting or running; every replica ended
# (exit codes by rank); or gone without a word (killed, its node lost, its processes vanished);
# or stopped by the cluster, not by its own failure (a replica evicted, or refused by its node's
# kubelet): the reason says which, and the job is requeued.
AttemptPhase = Literal["running", "exited", "lost", "preempted"]


@dataclass(frozen=True)
class AttemptStatus:
    phase: AttemptPhase
    exit_codes: dict[int, int] = field(default_factory=dict)
    reason: str = ""
    node_lost: bool = False
    # Why a running attempt still waits for some of its replicas (the cluster refuses to create
    # their pods: a quota, an admission policy); "" when it does not, and on backends that cannot tell.
    waiting: str = ""


# How many bytes of a job's progress (metrics and checkpoint records) one read returns at most;
# the reconcile reads again on its next pass, from the cursor it was handed back.
PROGRESS_READ_MAX_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class ProgressRead:
    """What an attempt's rank 0 wrote since the cursor the portal handed in.

    ``cursor`` is the backend's own (JSON-serialisable); the portal stores it and hands it
    back on the next read, so each record is read once. ``bytes_read`` is what this read cost.
    """

    metrics: list[dict] = field(default_factory=list)
    checkpoints: list[dict] = field(default_factory=list)
    cursor: dict = field(default_factory=dict)
    bytes_read: int = 0
    # Stop records (the SDK's, each naming its attempt): the script saw should_stop() and checkpointed,
    # so its ranks exiting 0 count as stopped on request, not finished.
    stops: list[dict] = field(default_factory=list)
    # The datasets the script opened ({"name", "version", "attempt", ...}: gpuportal.datasets.record_read).
    datasets: list[dict] = field(default_factory=list)


@dataclass
class CheckpointFile:
    """A checkpoint opened for reading: a file (``stream``, ``size`` bytes) or a folder (``chunks``, a .tar.gz
    of it made as it is read, size unknown). Close it once read (``close`` ends the folder's walk too)."""

    name: str
    size: int | None = None
    stream: BinaryIO | None = None
    chunks: Iterator[bytes] | None = None

    @property
    def is_folder(self) -> bool:
        return self.chunks is not None

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        close = getattr(self.chunks, "close", None)
        if close is not None:
            close()


# Where a GPU reading came from: NVML on this host, the DCGM exporter read through Prometheus, or the
# workload's own measured activity on a simulated GPU (shown as simulated wherever it is shown).
READING_SOURCES = ("nvml", "dcgm", "simulated")


@dataclass(frozen=True)
class GpuReading:
    """One device's utilization as one replica of an attempt saw it at one moment.

    ``device`` names what was read: a GPU's UUID (or index), a MIG instance (``<gpu uuid>/<gi id>``
    or the MIG device's own UUID) or a time-slice share of a GPU. A figure the source does not
    report is None (NVML gives no utilization for a MIG instance; a simulated GPU has no power).
    """

    rank: int
    device: str
    at: float  # seconds since the epoch
    source: str  # one of READING_SOURCES
    gpu_util_pct: float | None = None
    memory_used_mib: float | None = None
    power_w: float | None = None


@runtime_checkable
class ClusterBackend(Protocol):
    """What the portal asks of a cluster: environments, inventory and partitions, and jobs."""

    name: str

    def ensure_environment(self, spec: EnvironmentSpec) -> None:
        """Create or converge the environment; a no-op when it already matches."""

    def delete_environment(self, spec: EnvironmentSpec) -> bool:
        """Start deleting the environment without waiting for it to go.

        True once nothing of it remains; False while it is still going away (a namespace
        Terminating): the caller asks again later, it never waits here.
        """

    def environment_exists(self, spec: EnvironmentSpec) -> bool:
        """Whether any part of the environment still exists."""

    def member_kubeconfig(self, spec: EnvironmentSpec, member: MemberBinding, *, expiration_s: int, timeout_s: float):
        """A kubeconfig for this member, for this environment's namespace only, with a token that lives
        `expiration_s` (a `k8s_access.MemberKubeconfig`). PermanentBackendError where there is no API
        server to connect to (the local backend)."""

    def revoke_member_access(self, spec: EnvironmentSpec, username: str) -> None:
        """Remove what `member_kubeconfig` made for this user here, so their tokens stop working; idempotent."""

    def discover_inventory(self) -> list[NodeInfo]:
        """Every node with GPUs or capacity the portal may schedule onto."""

    def cordon(self, node_name: str) -> None:
        """Stop new work landing on the node."""

    def uncordon(self, node_name: str) -> None:
        """Let work land on the node again."""

    def node_workloads(self, node_name: str) -> list[str]:
        """Tenant work running on the node now, as readable names (namespace/pod)."""

    def evict(self, node_name: str, workload: str, *, grace_period_s: int) -> None:
        """Ask one workload to checkpoint and stop within the grace period."""

    def workload_job(self, workload: str) -> str:
        """The portal job (`job-<id>`) a workload of node_workloads belongs to, else the workload's own name."""

    def apply_partition(self, node_name: str, partition: PartitionSpec) -> None:
        """Start re-partitioning the node's GPUs; returns before it has taken effect."""

    def partition_applied(self, node_name: str, partition: PartitionSpec) -> bool:
        """Whether the node reports the partition as done and its new resources."""

    # --- Jobs ------------------------------------------------------------------

    def launch_job(self, launch: JobLaunch) -> int | None:
        """Start every replica of the attempt where it was placed; a no-op if this attempt already started.

        Returns the step the job resumes from (its newest checkpoint), or None when it starts afresh.
        """

    def job_status(self, job_id: int, attempt: int) -> AttemptStatus:
        """How the attempt stands now."""

    def stop_job(self, job_id: int, attempt: int, *, grace_period_s: int) -> None:
        """Ask the attempt to checkpoint and stop (SIGTERM, or pod deletion with the grace period)."""

    def kill_job(self, job_id: int, attempt: int) -> None:
        """Stop the attempt at once; what it did not checkpoint is lost."""

    def forget_job(self, job_id: int, attempt: int) -> None:
        """The attempt has ended and its outcome is recorded: release what tracks it."""

    def jobs_open(self, attempts: dict[tuple[int, int], str]) -> None:
        """The (job id, attempt) pairs the portal holds open now, each with the namespace it runs in, told once
        per reconcile pass (a cluster's backend counts a pod as an attempt's only in that namespace).

        Only their replicas may be started or bound; anything else of the portal's found
        running is left unbound (and logged), and what the backend tracks of other attempts
        is dropped, so its memory stays bounded by the open attempts.
        """

    def job_logs(self, job_id: int, attempt: int, rank: int, *, tail: int) -> str:
        """The last `tail` lines one replica wrote."""

    def serving_address(self, job_id: int, attempt: int, *, namespace: str = "") -> str | None:
        """The base URL an inference replica's server answers on (``http://host:port``), None until it is known.
        ``namespace``: the one the attempt runs in (its environment's), where a cluster looks for its pod."""

    def workspace_address(self, job_id: int, attempt: int, *, namespace: str = "") -> str | None:
        """Where a workspace's JupyterLab answers (``unix:/path`` locally, ``http://host:port`` on a cluster),
        None until it is known. ``namespace``: as for serving_address."""

    def delete_workspace_home(self, home: str) -> None:
        """Remove a deleted workspace's home folder (``<tenant>/<workspace id>``)."""

    def job_progress(self, job_id: int, attempt: int, cursor: dict) -> ProgressRead:
        """Metric and checkpoint records the attempt wrote since `cursor` ({} for the first read).

        At most PROGRESS_READ_MAX_BYTES a call, and only whole records: the rest comes on the
        next call. Records keep the shapes of runners.workloads.progress.
        """

    def job_checkpoint(self, job_id: int, namespace: str, path: str) -> CheckpointFile:
        """One of the job's checkpoints opened for reading: `path` as its record has it (relative to the job's
        folder, e.g. ``checkpoints/step-40.pt``). CheckpointGone when it is not there; CheckpointElsewhere on a
        backend whose checkpoints the portal cannot read (Kubernetes: on the environment's volume in the cluster).
        """

    def gpu_readings(self, attempts: set[tuple[int, int]]) -> dict[tuple[int, int], list[GpuReading]]:
        """The newest utilization readings of the given (job id, attempt) pairs' devices, one per device.

        One call for every open attempt, so a backend that reads a metrics store asks it once per
        metric, not once per attempt. Attempts with nothing to read are left out.
        """
