"""The Kubernetes objects one inference replica is made of, as pure functions of its JobLaunch.

The Kubernetes backend applies them (server-side apply); the tests check every one with
kubernetes-validate, strictly, for 1.30 and the newest schema.

- a Deployment per attempt, one pod (`serving_deployment_manifest`). Like a training pod, the
  pod names the portal's scheduler and carries its placement (rank 0 -> node), so the backend
  binds it to the node the portal chose through pods/binding, with the same resources
  (requests equal limits, the GPU units of its flavor) and security context. The Deployment
  recreates its pod should it vanish, but the backend never binds a replacement: a replica that
  lost its pod ends its attempt, and the portal relaunches it with a new one (as for training).
  `Recreate`: an update must never start a second pod on the GPUs the portal gave to one.
- a Service per endpoint (`endpoint_service_manifest`), over the endpoint's ready pods, for
  clients inside the cluster (the portal's router talks to each replica's pod IP itself);
- a PodDisruptionBudget per endpoint (`endpoint_pdb_manifest`): `maxUnavailable: 1`, since a
  launch knows one replica, not how many the endpoint keeps (a minAvailable would have to be
  that count, and would block every drain of a one-replica endpoint). A node drain then takes
  the endpoint's replicas one at a time, whatever their number; `unhealthyPodEvictionPolicy:
  AlwaysAllow` lets a replica that is not ready (still loading, or broken) go at once, so it
  never holds a drain up.

What the pod runs is the portal's choice alone: the shipped server (the trainer's image, as
pytorch-ddp jobs run) with its flags from the endpoint's validated settings, over a model version's
weights or the source job's checkpoint folder, mounted read-only; or the endpoint's image from the allow-list, with
the same settings as the server's SERVE_* variables and no command of the tenant's; or a foreign engine (vLLM, TGI,
SGLang: `engine_container`) from the endpoint's image, started as its engine documents (runners.backends.engines),
its probes on the engine's own health route, with a memory-backed /dev/shm. Nothing else
of the launch (variables, command) reaches the pod spec. The pod is ready while `/readyz`
answers 200 (false while the server loads and once it drains); it is restarted if `/healthz`
stops answering; a deleted pod first sleeps in preStop, so Services and proxies stop sending it
requests before the server gets SIGTERM, then drains within terminationGracePeriodSeconds (the
launch's grace period, preStop included).

A model version's weights (`ServingSettings.weights`, a blob of kind "models") reach the pod one of two ways,
chosen when the manifest is built (`weights_source`):

- from the node cache, where the cluster runs the cache agents (the portal holds their token, so it can sign a
  grant): the CSI ephemeral volume of `cache_manifests.dataset_volume`, its grant naming the weights, mounted
  read-only; the server reads `<mount>/<sha256>`. The agent fills the cache from the store, checked, once per
  node, and the next replica on that node finds them there.
- else through the portal: an init container (`python -m runners.workloads.fetch_weights`, the trainer's image)
  downloads them from the URL the portal signed for the attempt (`ShardRef.fetch_url`), checks their sha256 and
  size and moves them into an emptyDir (sized to them) that the server mounts read-only. The pod holds no
  storage credentials and needs to reach only the portal.

Both keep the namespace's Pod Security "restricted": a `csi` volume and an `emptyDir` are allowed, no host path.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from runners.backends import engines
from runners.backends.base import JobLaunch, PermanentBackendError, ServingSettings
from runners.backends.cache_manifests import DATASETS_MOUNT, dataset_volume
from runners.backends.job_manifests import (
    CHECKPOINT_CLAIM,
    CONTAINER_SECURITY_CONTEXT,
    FETCH_CPU_MILLI,
    FETCH_MEMORY_MIB,
    POD_SECURITY_CONTEXT,
    SCRATCH_MOUNT,
    SCRATCH_VARIABLES,
    SCRATCH_VOLUME,
    attempt_labels,
    job_name,
    placement_annotation,
    replica_resources,
)
from runners.backends.manifests import (
    ENDPOINT_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    SERVER_PORT,
    TENANT_LABEL,
    WORKLOAD_SERVICE_ACCOUNT,
)

# A serving pod's rank, where a training pod has its completion index (a Deployment gives none).
RANK_ANNOTATION = "portal.gpu/rank"
SERVER_CONTAINER = "server"
SERVER_COMMAND = ["python", "-m", "runners.workloads.serve"]
# The source job's folder of the checkpoint volume, read-only: the replica sees no other job's files.
MODEL_VOLUME = "model"
MODEL_MOUNT = "/model"
# How long a deleted pod waits before SIGTERM, so endpoints and proxies stop routing to it first.
PRESTOP_SLEEP_S = 5
# A model version's weights fetched through the portal: into this emptyDir, read-only in the server.
WEIGHTS_VOLUME = "weights"
WEIGHTS_MOUNT = "/weights"
FETCH_WEIGHTS_CONTAINER = "fetch-weights"
FETCH_WEIGHTS_COMMAND = ["python", "-m", "runners.workloads.fetch_weights"]
# The emptyDir's size limit over the weights' own bytes (the partial file is renamed, never copied).
WEIGHTS_VOLUME_SLACK_MIB = 64
# A foreign engine's shared memory (its tensor-parallel workers talk through /dev/shm, which a container
# otherwise gets 64 MiB of): a memory-backed emptyDir, counted in the container's memory limit.
SHM_VOLUME = "shm"
SHM_MOUNT = "/dev/shm"
SHM_SIZE_MIB = 4096
# A foreign engine may take a long while to load a big model before its health route answers: the kubelet
# leaves it STARTUP_PERIOD_S x STARTUP_FAILURES (30 minutes) before liveness counts.
ENGINE_STARTUP_PERIOD_S = 10
ENGINE_STARTUP_FAILURES = 180
# A model version's folder (a .tar.gz) for a foreign engine: unpacked by an init container into this emptyDir,
# read-only in the engine, which serves ENGINE_MODEL_PATH.
ENGINE_MODEL_VOLUME = "model-files"
ENGINE_MODEL_MOUNT = "/model-files"
ENGINE_MODEL_PATH = f"{ENGINE_MODEL_MOUNT}/model"
UNPACK_WEIGHTS_CONTAINER = "unpack-weights"
UNPACK_WEIGHTS_COMMAND = ["python", "-m", "runners.workloads.unpack_weights"]


def endpoint_name(endpoint_id: int) -> str:
    return f"endpoint-{endpoint_id}"


def endpoint_labels(*, tenant_slug: str, endpoint_id: int) -> dict[str, str]:
    return {MANAGED_BY_LABEL: MANAGED_BY, TENANT_LABEL: tenant_slug, ENDPOINT_LABEL: str(endpoint_id)}


def model_path(serving: ServingSettings) -> str:
    """Where the checkpoint is in the container: its path in the source job's folder, under MODEL_MOUNT.

    The portal hands the path a checkpoint record gave (`checkpoints/step-N.pt`, relative to
    the job's folder); empty means the folder itself (the server takes its newest checkpoint).
    Anything that would leave the folder is refused.
    """
    path = PurePosixPath(serving.checkpoint)
    if path.is_absolute() or ".." in path.parts:
        raise PermanentBackendError(f"The checkpoint {serving.checkpoint!r} is not a path inside the source job's folder.")
    return str(PurePosixPath(MODEL_MOUNT) / path)


def weights_source(launch: JobLaunch, cache_grant_key: bytes) -> str:
    """Where a model version's weights come from: "cache" (the node cache's CSI volume; the cluster runs the cache
    agents, whose token the portal holds), "fetch" (the init container, through the signed URL), or "" (no
    version: a job's checkpoint or an image)."""
    serving = launch.serving
    if serving is None or serving.weights is None or (serving.image is not None and serving.engine == engines.SHIPPED):
        return ""
    return "cache" if cache_grant_key else "fetch"


def weights_path(launch: JobLaunch, source: str) -> str:
    """The weights' file in the server's container."""
    root = DATASETS_MOUNT if source == "cache" else WEIGHTS_MOUNT
    return f"{root}/{launch.serving.weights.sha256}"


def fetch_weights_container(launch: JobLaunch, image: str) -> dict:
    """The init container of a replica serving a model version without the node cache: downloads the weights from
    the portal's signed URL, checks their sha256 and size, and moves them into the weights volume."""
    weights = launch.serving.weights
    if not weights.fetch_url.startswith(("https://", "http://")):
        raise PermanentBackendError(
            "A replica's pod fetches its model version's weights from the portal, and the launch has no URL to fetch "
            "them from (set PORTAL_PUBLIC_URL to the address the cluster reaches the portal at, or run the cache "
            "agents and set CACHE_AGENT_TOKEN so the pod reads them from its node's cache)."
        )
    share = {
        "cpu": f"{min(FETCH_CPU_MILLI, launch.cpu_milli_per_replica)}m",
        "memory": f"{min(FETCH_MEMORY_MIB, launch.memory_mib_per_replica)}Mi",
    }
    return {
        "name": FETCH_WEIGHTS_CONTAINER,
        "image": image,
        "command": [*FETCH_WEIGHTS_COMMAND, weights.fetch_url, weights_path(launch, "fetch"),
                    "--sha256", weights.sha256, "--bytes", str(weights.bytes)],
        "env": [{"name": key, "value": value} for key, value in SCRATCH_VARIABLES.items()],
        "resources": {"requests": dict(share), "limits": dict(share)},
        "volumeMounts": [
            {"name": WEIGHTS_VOLUME, "mountPath": WEIGHTS_MOUNT},
            {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_MOUNT},
        ],
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
    }


def _weights_volume_limit(size: int) -> str:
    return f"{-(-size // (1 << 20)) + WEIGHTS_VOLUME_SLACK_MIB}Mi"


def _settings_variables(serving: ServingSettings) -> list[dict]:
    """The server's flags as the SERVE_* variables it reads too (`--queue-limit` is SERVE_QUEUE_LIMIT)."""
    flags = serving.flags()
    return [
        {"name": "SERVE_" + flag.removeprefix("--").replace("-", "_").upper(), "value": value}
        for flag, value in zip(flags[::2], flags[1::2])
    ]


def _probe(path: str, *, period_s: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period_s, "failureThreshold": failures,
            "timeoutSeconds": 2}


def server_container(launch: JobLaunch, *, server_image: str, weights: str = "") -> dict:
    """The replica's one container: the shipped server over the model version's weights (``weights``: where they
    come from, see `weights_source`) or the source job's folder, or the endpoint's image."""
    serving = launch.serving
    fixed = [
        {"name": "PORTAL_ATTEMPT", "value": str(launch.attempt)},
        {"name": "PORTAL_JOB", "value": str(launch.job_id)},
        *({"name": key, "value": value} for key, value in SCRATCH_VARIABLES.items()),
    ]
    mounts = [{"name": SCRATCH_VOLUME, "mountPath": SCRATCH_MOUNT}]
    if serving.engine != engines.SHIPPED:
        if weights:  # the model version's folder, unpacked by the init container
            mounts.insert(0, {"name": ENGINE_MODEL_VOLUME, "mountPath": ENGINE_MODEL_MOUNT, "readOnly": True})
        return engine_container(launch, fixed=fixed, mounts=mounts, model=ENGINE_MODEL_PATH if weights else "")
    if serving.source_job_id is not None:
        mounts.insert(0, {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True,
                          "subPath": f"job-{serving.source_job_id}"})
    if weights == "fetch":
        mounts.insert(0, {"name": WEIGHTS_VOLUME, "mountPath": WEIGHTS_MOUNT, "readOnly": True})
    if serving.image is None:
        if weights:
            checkpoint = weights_path(launch, weights)
        elif serving.source_job_id is None:
            raise PermanentBackendError("The shipped server serves a model version or a job's checkpoint: the replica "
                                        "names no source job and no model version.")
        else:
            checkpoint = model_path(serving)
        run = {
            "image": server_image,
            "command": list(SERVER_COMMAND),
            "args": ["--checkpoint", checkpoint, "--host", "0.0.0.0", "--port", str(SERVER_PORT),
                     *serving.flags()],
            "env": fixed,
        }
    else:
        # The image's own entrypoint, told what the shipped server would be by its variables.
        run = {
            "image": serving.image,
            "env": [{"name": "SERVE_HOST", "value": "0.0.0.0"}, {"name": "SERVE_PORT", "value": str(SERVER_PORT)},
                    *_settings_variables(serving), *fixed],
        }
    resources = replica_resources(launch)
    return {
        "name": SERVER_CONTAINER,
        **run,
        "ports": [{"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"}],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": mounts,
        # Loading the model may take a while: liveness counts only once the server answers at all.
        "startupProbe": _probe("/healthz", period_s=2, failures=90),
        "livenessProbe": _probe("/healthz", period_s=10, failures=3),
        "readinessProbe": _probe("/readyz", period_s=2, failures=1),
        "lifecycle": {"preStop": {"sleep": {"seconds": prestop_sleep_s(launch.grace_period_s)}}},
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
    }


def engine_container(launch: JobLaunch, *, fixed: list[dict], mounts: list[dict], model: str = "") -> dict:
    """A foreign engine's container (vLLM, TGI, SGLang): the endpoint's image, started with the command and flags
    its engine documents (runners.backends.engines) from the endpoint's named settings, on the replica's port.

    Readiness is the engine's own health route (it answers once the model is loaded), liveness the same route
    after a long start-up allowance. Deleted, the pod first sleeps in preStop while the reconcile has already
    taken it out of the edge's rotation and the Service's endpoints drop it; then SIGTERM: each engine's HTTP
    server stops taking connections and finishes the requests it has, within the grace period."""
    serving = launch.serving
    model = model or serving.model
    if serving.image is None:
        raise PermanentBackendError(f"Engine {serving.engine} runs the endpoint's image, and the launch names none.")
    if not model:
        raise PermanentBackendError(f"Engine {serving.engine} serves a model, and the launch names none.")
    try:
        command, args = engines.engine_command(
            serving.engine, model=model, port=SERVER_PORT, gpus=launch.gpus_per_replica,
            served_name=serving.served_name or launch.name,
            settings=engines.EngineSettings(max_model_len=serving.max_model_len, dtype=serving.dtype))
    except ValueError as exc:
        raise PermanentBackendError(str(exc)) from None
    resources = replica_resources(launch)
    ready, live = engines.health_path(serving.engine), engines.liveness_path(serving.engine)
    return {
        "name": SERVER_CONTAINER,
        "image": serving.image,
        "command": command,
        "args": args,
        "env": fixed,
        "ports": [{"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"}],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": [{"name": SHM_VOLUME, "mountPath": SHM_MOUNT}, *mounts],
        "startupProbe": _probe(live, period_s=ENGINE_STARTUP_PERIOD_S, failures=ENGINE_STARTUP_FAILURES),
        "livenessProbe": _probe(live, period_s=10, failures=3),
        "readinessProbe": _probe(ready, period_s=2, failures=1),
        "lifecycle": {"preStop": {"sleep": {"seconds": prestop_sleep_s(launch.grace_period_s)}}},
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
    }


def unpack_weights_container(launch: JobLaunch, image: str, source: str, source_mount: dict) -> dict:
    """The init container that unpacks a model version's folder (its .tar.gz, from the node cache's view or the
    fetched copy, read-only) into the engine's model volume (runners.workloads.unpack_weights)."""
    share = {
        "cpu": f"{min(FETCH_CPU_MILLI, launch.cpu_milli_per_replica)}m",
        "memory": f"{min(FETCH_MEMORY_MIB, launch.memory_mib_per_replica)}Mi",
    }
    return {
        "name": UNPACK_WEIGHTS_CONTAINER,
        "image": image,
        "command": [*UNPACK_WEIGHTS_COMMAND, weights_path(launch, source), ENGINE_MODEL_PATH],
        "env": [{"name": key, "value": value} for key, value in SCRATCH_VARIABLES.items()],
        "resources": {"requests": dict(share), "limits": dict(share)},
        "volumeMounts": [
            {**source_mount, "readOnly": True},
            {"name": ENGINE_MODEL_VOLUME, "mountPath": ENGINE_MODEL_MOUNT},
            {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_MOUNT},
        ],
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
    }


def _engine_weights(launch: JobLaunch, weights: str, server_image: str, cache_grant_key: bytes,
                    volumes: list[dict]) -> list[dict]:
    """A foreign engine's model version: the volumes its folder passes through (added to ``volumes``) and the init
    containers that fetch (without the node cache) and unpack it."""
    size = launch.serving.weights.bytes
    # The unpacked folder: about the archive's size (weights barely compress), with the slack.
    volumes.insert(0, {"name": ENGINE_MODEL_VOLUME, "emptyDir": {"sizeLimit": _weights_volume_limit(size)}})
    if weights == "cache":
        volume, mount, _variable = dataset_volume(launch, cache_grant_key)
        volumes.insert(0, volume)
        return [unpack_weights_container(launch, server_image, "cache", mount)]
    volumes.insert(0, {"name": WEIGHTS_VOLUME, "emptyDir": {"sizeLimit": _weights_volume_limit(size)}})
    return [fetch_weights_container(launch, server_image),
            unpack_weights_container(launch, server_image, "fetch", {"name": WEIGHTS_VOLUME,
                                                                     "mountPath": WEIGHTS_MOUNT})]


def prestop_sleep_s(grace_period_s: int) -> int:
    """PRESTOP_SLEEP_S, but at most a third of the grace period: the drain needs the rest."""
    return max(1, min(PRESTOP_SLEEP_S, grace_period_s // 3))


def serving_deployment_manifest(launch: JobLaunch, *, server_image: str, scheduler_name: str,
                                cache_grant_key: bytes = b"") -> dict:
    """The Deployment of one replica's attempt: one pod, bound where the portal placed it. ``cache_grant_key``: the
    key of the cache agents' grants (empty where the cluster runs none), which decides where a model version's
    weights come from (`weights_source`)."""
    if launch.serving is None:
        raise PermanentBackendError(f"Job {launch.job_id} is not an inference replica.")
    if len(launch.replicas) != 1 or launch.replicas[0].rank != 0:
        raise PermanentBackendError(f"An inference replica is one pod; job {launch.job_id} was placed as "
                                    f"{len(launch.replicas)}.")
    name = job_name(launch)
    labels = attempt_labels(launch)
    pod_labels = {**labels, ENDPOINT_LABEL: str(launch.serving.endpoint_id)}
    volumes = [{"name": SCRATCH_VOLUME, "emptyDir": {}}]
    if launch.serving.source_job_id is not None:
        volumes.insert(0, {
            "name": MODEL_VOLUME,
            "persistentVolumeClaim": {"claimName": CHECKPOINT_CLAIM, "readOnly": True},
        })
    weights = weights_source(launch, cache_grant_key)
    container = server_container(launch, server_image=server_image, weights=weights)
    init_containers = []
    if launch.serving.engine != engines.SHIPPED:
        volumes.insert(0, {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": f"{SHM_SIZE_MIB}Mi"}})
        if weights:
            init_containers = _engine_weights(launch, weights, server_image, cache_grant_key, volumes)
    elif weights == "cache":
        # The grant names the weights alone (a serving launch reads no dataset); the server reads the view's copy.
        volume, mount, _variable = dataset_volume(launch, cache_grant_key)
        volumes.insert(0, volume)
        container["volumeMounts"].insert(0, mount)
    elif weights == "fetch":
        volumes.insert(0, {"name": WEIGHTS_VOLUME,
                           "emptyDir": {"sizeLimit": _weights_volume_limit(launch.serving.weights.bytes)}})
        init_containers.append(fetch_weights_container(launch, server_image))
    return one_pod_deployment(launch, name=name, selector=labels, pod_labels=pod_labels, scheduler_name=scheduler_name,
                              containers=[container], volumes=volumes, init_containers=init_containers)


def one_pod_deployment(launch: JobLaunch, *, name: str, selector: dict, pod_labels: dict, scheduler_name: str,
                       containers: list[dict], volumes: list[dict], init_containers: list[dict] = (),
                       pod_security: dict | None = None) -> dict:
    """The Deployment of an attempt that is one pod (an inference replica, a workspace): bound where the portal
    placed it (rank 0), recreated rather than rolled (never a second pod beside the first, on the GPUs the portal
    gave to one), no ServiceAccount token, the portal's pod security context (or ``pod_security``)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": launch.namespace, "labels": pod_labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {"labels": pod_labels, "annotations": {**placement_annotation(launch), RANK_ANNOTATION: "0"}},
                "spec": {
                    "schedulerName": scheduler_name,
                    "restartPolicy": "Always",
                    "serviceAccountName": WORKLOAD_SERVICE_ACCOUNT,
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": launch.grace_period_s,
                    "securityContext": dict(pod_security or POD_SECURITY_CONTEXT),
                    **({"initContainers": list(init_containers)} if init_containers else {}),
                    "containers": containers,
                    "volumes": volumes,
                },
            },
        },
    }


def endpoint_service_manifest(*, namespace: str, tenant_slug: str, endpoint_id: int) -> dict:
    """The endpoint's Service: its ready replicas (every attempt's pod carries the endpoint's label)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": endpoint_name(endpoint_id), "namespace": namespace,
                     "labels": endpoint_labels(tenant_slug=tenant_slug, endpoint_id=endpoint_id)},
        "spec": {
            "type": "ClusterIP",
            "selector": {MANAGED_BY_LABEL: MANAGED_BY, ENDPOINT_LABEL: str(endpoint_id)},
            "ports": [{"name": "http", "port": SERVER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def endpoint_pdb_manifest(*, namespace: str, tenant_slug: str, endpoint_id: int) -> dict:
    """The endpoint's PodDisruptionBudget: voluntary disruptions take one replica at a time (see the module)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": endpoint_name(endpoint_id), "namespace": namespace,
                     "labels": endpoint_labels(tenant_slug=tenant_slug, endpoint_id=endpoint_id)},
        "spec": {
            "maxUnavailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": {MANAGED_BY_LABEL: MANAGED_BY, ENDPOINT_LABEL: str(endpoint_id)}},
        },
    }


def endpoint_manifests(*, namespace: str, tenant_slug: str, endpoint_id: int) -> list[dict]:
    """What every replica of the endpoint shares: its Service and its PodDisruptionBudget."""
    where = dict(namespace=namespace, tenant_slug=tenant_slug, endpoint_id=endpoint_id)
    return [endpoint_service_manifest(**where), endpoint_pdb_manifest(**where)]


def serve_manifests(launch: JobLaunch, *, server_image: str, scheduler_name: str, cache_grant_key: bytes = b""
                    ) -> list[dict]:
    """The replica's Deployment, then its endpoint's Service and PodDisruptionBudget, in the order they are applied.

    The Deployment first: the backend removes the endpoint's shared objects only when it finds
    no Deployment of the endpoint, so one applied after its Deployment is never removed for good.
    """
    return [
        serving_deployment_manifest(launch, server_image=server_image, scheduler_name=scheduler_name,
                                    cache_grant_key=cache_grant_key),
        *endpoint_manifests(namespace=launch.namespace, tenant_slug=launch.tenant_slug,
                            endpoint_id=launch.serving.endpoint_id),
    ]
