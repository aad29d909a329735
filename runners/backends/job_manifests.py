"""The Kubernetes objects one training attempt is made of, as pure functions of its JobLaunch.

The Kubernetes backend applies them (server-side apply); the tests check every one with
kubernetes-validate, strictly, for 1.30 and the newest schema.

- a PersistentVolumeClaim per environment for checkpoints (`checkpoint_pvc_manifest`);
- a headless Service per job, so every replica has a stable DNS name and rank 0 is the
  rendezvous (`rendezvous_service_manifest`);
- an indexed batch/v1 Job, one pod per replica (`training_job_manifest`). Its pods name the
  portal's scheduler (`schedulerName`), so kube-scheduler never places them: the backend binds
  each pod to the node the portal chose for its completion index, as a secondary scheduler
  does through the pods/binding subresource. The rank comes from the completion index; the
  Job never retries by itself (`backoffLimit: 0`): retries are the portal's, with a new attempt.
  It has no `activeDeadlineSeconds` (see `training_job_manifest`): the runtime budget counts from
  the trainer's first step, which a Job deadline cannot.

A `script` pod runs the tenant's `command` in its bundle: an init container (the portal's runtime image)
fetches the archive from the signed portal URL of the launch (`python -m gpuportal.fetch`, which checks
its digest and extracts it safely) into an emptyDir, mounted read-only at CODE_MOUNT in the main
container, its working directory. The script gets the trainer's variables, PORTAL_HYPERPARAMETERS
and, when the portal recorded a checkpoint, PORTAL_RESUME_FROM_STEP.

What a pytorch-ddp pod runs is decided by the job's spec alone, as on the local backend: the
trainer's settings are its flags (`args`), the memory limit is the container's
`resources.limits.memory` (memory_mib_per_replica: the kernel kills the container past it),
and $HOME, $TMPDIR and the torch/Triton caches are folders of an emptyDir volume of the pod,
never the image's filesystem. The tenant's variables (checked by
`runners.workloads.env_policy` in the portal) come first and can name none of the portal's (checked again here).
"""

from __future__ import annotations

import json

from runners.backends.base import JobLaunch, PermanentBackendError
from runners.backends.cache_manifests import dataset_volume
from runners.backends.manifests import MANAGED_BY, MANAGED_BY_LABEL, TENANT_LABEL, WORKLOAD_SERVICE_ACCOUNT
from runners.workloads import env_policy

JOB_LABEL = "portal.gpu/job-id"
ATTEMPT_LABEL = "portal.gpu/attempt"
PLACEMENT_ANNOTATION = "portal.gpu/placement"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
CHECKPOINT_CLAIM = "checkpoints"
CHECKPOINT_MOUNT = "/checkpoints"
RENDEZVOUS_PORT = 29500
TRAINER_COMMAND = ["python", "-m", "runners.workloads.train"]
SCRATCH_VOLUME = "scratch"
SCRATCH_MOUNT = "/scratch"
# A script job's bundle: fetched by the init container into this emptyDir, read-only in the main container.
CODE_VOLUME = "code"
CODE_MOUNT = "/code"
FETCH_COMMAND = ["python", "-m", "gpuportal.fetch"]
# The init container's share while it fetches and unpacks (never more than a replica has).
FETCH_CPU_MILLI = 1000
FETCH_MEMORY_MIB = 1024
# The pod's home, temporary files and caches: on its emptyDir (the caches' owners create their folders).
SCRATCH_VARIABLES = {
    "HOME": SCRATCH_MOUNT,
    "TMPDIR": SCRATCH_MOUNT,
    "XDG_CACHE_HOME": f"{SCRATCH_MOUNT}/.cache",
    "TORCH_HOME": f"{SCRATCH_MOUNT}/.cache/torch",
    "TORCHINDUCTOR_CACHE_DIR": f"{SCRATCH_MOUNT}/.cache/torchinductor",
    "TRITON_CACHE_DIR": f"{SCRATCH_MOUNT}/.cache/triton",
}


def job_name(launch: JobLaunch) -> str:
    """`job-<id>-<attempt>`: each attempt is its own Job, so a relaunch never meets the old pods."""
    return f"job-{launch.job_id}-{launch.attempt}"


def attempt_labels(launch: JobLaunch) -> dict[str, str]:
    """What every object of an attempt is labelled with: the portal's, the tenant's, the job's and the attempt's."""
    return {
        MANAGED_BY_LABEL: MANAGED_BY,
        TENANT_LABEL: launch.tenant_slug,
        JOB_LABEL: str(launch.job_id),
        ATTEMPT_LABEL: str(launch.attempt),
    }


def checkpoint_pvc_manifest(*, namespace: str, tenant_slug: str, storage_class: str, size: str) -> dict:
    """The environment's checkpoint volume; every job writes under its own folder on it."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": CHECKPOINT_CLAIM, "namespace": namespace,
            "labels": {MANAGED_BY_LABEL: MANAGED_BY, TENANT_LABEL: tenant_slug},
        },
        "spec": {
            # ReadWriteMany: the replicas of one job may sit on different nodes, rank 0 writes.
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": size}},
            # None: the cluster's default storage class.
            **({"storageClassName": storage_class} if storage_class else {}),
        },
    }


def rendezvous_service_manifest(launch: JobLaunch) -> dict:
    """A headless Service over the attempt's pods: `<job>-0.<job>` is rank 0, MASTER_ADDR."""
    name = job_name(launch)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": launch.namespace, "labels": attempt_labels(launch)},
        "spec": {
            "clusterIP": "None",
            # Pods resolve before they are ready: rank 0 must be reachable while the others start.
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: str(launch.job_id), ATTEMPT_LABEL: str(launch.attempt)},
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT}],
        },
    }


def _job_dir(launch: JobLaunch) -> str:
    return f"{CHECKPOINT_MOUNT}/job-{launch.job_id}"


def trainer_args(launch: JobLaunch) -> list[str]:
    """The shipped trainer's flags for this attempt: every setting from the spec (flags win over TRAIN_*)."""
    return [
        "--job-dir", _job_dir(launch), "--steps", str(launch.steps),
        "--checkpoint-every", str(launch.checkpoint_every_steps), "--max-runtime-s", str(launch.max_runtime_s),
        *launch.trainer.flags(),
    ]


def _env(launch: JobLaunch) -> list[dict]:
    name = job_name(launch)
    job_dir = _job_dir(launch)
    fixed = [
        {"name": "RANK", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}}},
        {"name": "WORLD_SIZE", "value": str(len(launch.replicas))},
        {"name": "LOCAL_RANK", "value": "0"},
        {"name": "LOCAL_WORLD_SIZE", "value": "1"},
        {"name": "MASTER_ADDR", "value": f"{name}-0.{name}"},
        {"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)},
        {"name": "PORTAL_ATTEMPT", "value": str(launch.attempt)},
        {"name": "PORTAL_JOB", "value": str(launch.job_id)},
        {"name": "TRAIN_JOB_DIR", "value": job_dir},
        {"name": "TRAIN_STEPS", "value": str(launch.steps)},
        {"name": "TRAIN_CHECKPOINT_EVERY", "value": str(launch.checkpoint_every_steps)},
        {"name": "TRAIN_MAX_RUNTIME_S", "value": str(launch.max_runtime_s)},
        *({"name": key, "value": value} for key, value in SCRATCH_VARIABLES.items()),
    ]
    if launch.template == "script":
        fixed.append({"name": "PORTAL_HYPERPARAMETERS", "value": launch.hyperparameters_json})
        if launch.resume_from_step is not None:
            fixed.append({"name": "PORTAL_RESUME_FROM_STEP", "value": str(launch.resume_from_step)})
    # The tenant's variables were checked by the portal; checked again here, as the local backend
    # does, since env_policy refuses every name above (a duplicate would also fail the apply).
    refused = [f"{key}: {why}" for key, _ in launch.env if (why := env_policy.refusal(key))]
    if refused:
        raise PermanentBackendError(f"The job sets variables a tenant may not set: {'; '.join(refused)}.")
    return [{"name": key, "value": value} for key, value in launch.env] + fixed


def replica_resources(launch: JobLaunch) -> dict[str, str]:
    """One replica's CPU, memory and GPU units: requests equal limits, since the portal placed it on exactly these."""
    return {
        "cpu": f"{launch.cpu_milli_per_replica}m",
        "memory": f"{launch.memory_mib_per_replica}Mi",
        launch.gpu_resource: str(launch.gpus_per_replica),
    }


# Every workload container of the portal's: what the namespace's "restricted" Pod Security level asks, and no more.
CONTAINER_SECURITY_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "readOnlyRootFilesystem": False,
    "seccompProfile": {"type": "RuntimeDefault"},
}
POD_SECURITY_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def bundle_fetch_container(launch: JobLaunch, image: str) -> dict:
    """The init container of a script pod: fetches the bundle from its signed portal URL, checks its digest
    and unpacks it into the code volume (the pod holds no storage credentials). It runs the portal's runtime
    image, which has gpuportal, whatever image the tenant's command runs in."""
    bundle = launch.bundle
    if bundle is None or not bundle.fetch_url.startswith(("https://", "http://")):
        raise PermanentBackendError(
            "A script job's pods fetch their bundle from the portal, and the launch has no URL to fetch it from "
            "(set PORTAL_PUBLIC_URL to the address the cluster reaches the portal at)."
        )
    share = {
        "cpu": f"{min(FETCH_CPU_MILLI, launch.cpu_milli_per_replica)}m",
        "memory": f"{min(FETCH_MEMORY_MIB, launch.memory_mib_per_replica)}Mi",
    }
    return {
        "name": "fetch-bundle",
        "image": image,
        "command": [*FETCH_COMMAND, bundle.fetch_url, CODE_MOUNT, "--sha256", bundle.sha256],
        "env": [{"name": key, "value": value} for key, value in SCRATCH_VARIABLES.items()],
        "resources": {"requests": dict(share), "limits": dict(share)},
        "volumeMounts": [
            {"name": CODE_VOLUME, "mountPath": CODE_MOUNT},
            {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_MOUNT},
        ],
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
    }


# The checkpoint uploader, a native sidecar (an init container that restarts: it runs beside the trainer and
# is ended after it). Its share is added to the pod's: requests equal limits, so the pod stays as placed.
UPLOADER_COMMAND = ["python", "-m", "runners.workloads.checkpoint_uploader"]
UPLOADER_CPU_MILLI = 250
UPLOADER_MEMORY_MIB = 256
UPLOAD_URL_VARIABLE = "PORTAL_CHECKPOINT_UPLOAD_URL"


def checkpoint_uploader_container(launch: JobLaunch, image: str) -> dict | None:
    """The sidecar that sends the job folder's checkpoints to the portal's store through the portal's upload
    endpoint (runners/jobs/checkpoint_upload.py), with the URL the portal signed for the attempt: the pod never
    holds the store's credentials, and reads the checkpoint volume read-only. None without an absolute URL
    (PORTAL_PUBLIC_URL unset): the checkpoints then stay on the volume, as before the store."""
    url = launch.checkpoint_upload_url
    if not url.startswith(("https://", "http://")):
        return None
    share = {"cpu": f"{UPLOADER_CPU_MILLI}m", "memory": f"{UPLOADER_MEMORY_MIB}Mi"}
    rank = {"name": "RANK", "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}}}
    return {
        "name": "checkpoint-uploader",
        "image": image,
        "restartPolicy": "Always",
        "command": [*UPLOADER_COMMAND, "--job-dir", _job_dir(launch)],
        "env": [rank, {"name": UPLOAD_URL_VARIABLE, "value": url},
                *({"name": key, "value": value} for key, value in SCRATCH_VARIABLES.items())],
        "resources": {"requests": dict(share), "limits": dict(share)},
        "volumeMounts": [
            {"name": CHECKPOINT_CLAIM, "mountPath": CHECKPOINT_MOUNT, "readOnly": True},
            {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_MOUNT},
        ],
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
    }


def placement_annotation(launch: JobLaunch) -> dict[str, str]:
    """Rank -> node, as the binder reads it from each pod (every pod carries the whole placement)."""
    placement = {str(replica.rank): replica.node for replica in launch.replicas}
    return {PLACEMENT_ANNOTATION: json.dumps(placement, sort_keys=True)}


def training_job_manifest(
    launch: JobLaunch, *, trainer_image: str, scheduler_name: str, grace_period_s: int, finished_ttl_s: int = 86400,
    cache_grant_key: bytes = b"",
) -> dict:
    """The indexed Job of one attempt, with every pod spec field set by the portal."""
    name = job_name(launch)
    replicas = len(launch.replicas)
    resources = replica_resources(launch)
    own_command = launch.template in ("custom", "script")
    image = (launch.image or trainer_image) if own_command else trainer_image
    container = {
        "name": "trainer",
        "image": image,
        "command": list(launch.command or ()) if own_command else list(TRAINER_COMMAND),
        **({} if own_command else {"args": trainer_args(launch)}),
        "env": _env(launch),
        "ports": [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT}],
        # Requests equal limits: the portal placed the pod on exactly these resources, and the
        # memory limit is memory_mib_per_replica, enforced by the kernel (OOM kill past it).
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": [
            {"name": CHECKPOINT_CLAIM, "mountPath": CHECKPOINT_MOUNT},
            {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_MOUNT},
        ],
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
    }
    volumes = [
        {"name": CHECKPOINT_CLAIM, "persistentVolumeClaim": {"claimName": CHECKPOINT_CLAIM}},
        {"name": SCRATCH_VOLUME, "emptyDir": {}},
    ]
    init_containers = []
    if launch.template == "script":
        container["workingDir"] = CODE_MOUNT
        container["volumeMounts"].append({"name": CODE_VOLUME, "mountPath": CODE_MOUNT, "readOnly": True})
        volumes.append({"name": CODE_VOLUME, "emptyDir": {}})
        init_containers.append(bundle_fetch_container(launch, trainer_image))
    uploader = checkpoint_uploader_container(launch, trainer_image)
    if uploader is not None:
        init_containers.append(uploader)
    # The node cache's view of the job's shards, read-only, granted by the portal's signature (cache_manifests).
    datasets = dataset_volume(launch, cache_grant_key)
    if datasets is not None:
        volume, mount, variable = datasets
        volumes.append(volume)
        container["volumeMounts"].append(mount)
        container["env"].append(variable)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name, "namespace": launch.namespace, "labels": attempt_labels(launch),
            # Which node each completion index goes to: what the binder reads.
            "annotations": placement_annotation(launch),
        },
        "spec": {
            "completionMode": "Indexed",
            "completions": replicas,
            "parallelism": replicas,
            "backoffLimit": 0,
            # No activeDeadlineSeconds: it counts from the Job's start, before binding, image pull and
            # the trainer's first step, so it would fire before max_runtime_s (counted from that step)
            # is used, and the requeued attempt would get a deadline as short as its start-up. The
            # trainer ends itself at --max-runtime-s (a custom command is handed TRAIN_MAX_RUNTIME_S).
            # A finished attempt's pods stay this long, so their logs can still be read.
            "ttlSecondsAfterFinished": finished_ttl_s,
            "template": {
                # Every pod carries the whole placement; the binder picks its own index's node.
                "metadata": {"labels": attempt_labels(launch), "annotations": placement_annotation(launch)},
                "spec": {
                    "schedulerName": scheduler_name,
                    "restartPolicy": "Never",
                    "serviceAccountName": WORKLOAD_SERVICE_ACCOUNT,
                    "automountServiceAccountToken": False,
                    "subdomain": name,
                    "terminationGracePeriodSeconds": grace_period_s,
                    "securityContext": dict(POD_SECURITY_CONTEXT),
                    **({"initContainers": init_containers} if init_containers else {}),
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def job_manifests(
    launch: JobLaunch, *, trainer_image: str, scheduler_name: str, grace_period_s: int, finished_ttl_s: int = 86400,
    cache_grant_key: bytes = b"",
) -> list[dict]:
    """The attempt's Service and Job, in the order they are applied (the PVC is the environment's)."""
    return [
        rendezvous_service_manifest(launch),
        training_job_manifest(launch, trainer_image=trainer_image, scheduler_name=scheduler_name,
                              grace_period_s=grace_period_s, finished_ttl_s=finished_ttl_s,
                              cache_grant_key=cache_grant_key),
    ]
