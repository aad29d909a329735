"""Inference endpoints: the spec check, deploy, scale, rollout and stop.

An endpoint's replicas are jobs of kind "serving" (one replica each), so the scheduler cycle admits,
places, preempts and counts them exactly as it does training gangs: a replica in a slot below
``min_replicas`` is not preemptible and is admitted only within the tenant's guarantee; the rest
borrow and can be reclaimed, which stops them with SIGTERM, and the server drains on SIGTERM.
Nothing here calls the cluster: the reconcile (``runners.inference.reconcile``) reads the replicas,
and the jobs' own launch, stop and reconcile do the rest.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import tempfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.utils import timezone

from audit.services import SYSTEM, record, snapshot
from common.dispatch import send_task_at_most_every
from common.errors import Conflict, Invalid
from quotas.models import PartitionKind, Quota
from runners.backends import engines as engine_kinds
from runners.backends.base import BackendError, CheckpointElsewhere, CheckpointGone, ServingSettings
from runners.clusters.registry import get_backend
from runners.environments.models import Environment, EnvironmentState
from runners.inference.models import EndpointState, InferenceEndpoint, Replica, ScaleEvent
from runners.jobs import services as jobs
from runners.jobs.models import JOB_FINAL_STATES, Checkpoint, Job, JobState
from runners.registry import selectors as registry_selectors
from runners.registry import services as registry
from runners.registry.models import ModelVersion, WeightsFormat
from runners.storage.blobs import BlobMissing, HashMismatch
from runners.workloads.env_policy import TRAINER_MIN_MEMORY_MIB
from tenants.models import Role, Tenant
from tenants.services import require_role

NAME_MAX = 30  # replica jobs are named <endpoint>-g<generation>-r<slot>, within the jobs' 40
NAME_PATTERN = rf"[a-z0-9]([-a-z0-9]{{0,{NAME_MAX - 2}}}[a-z0-9])?"
# Whole-number fields: (low, high, default). The API's schema is generated from this table.
BOUNDS = {
    "gpus_per_replica": (1, 64, 1),
    "min_replicas": (0, 16, 1),
    "max_replicas": (1, 16, 1),
    "warm_replicas": (0, 16, 0),
    # The shipped server's settings default to what a replica runs with when none is given.
    "queue_limit": (1, 4096, ServingSettings.queue_limit),
    "batch_token_budget": (64, 262_144, ServingSettings.batch_token_budget),
    "max_batch_wait_ms": (0, 1000, int(ServingSettings.max_batch_wait_ms)),
    "default_deadline_ms": (100, 120_000, int(ServingSettings.default_deadline_ms)),
}
REQUIRED = ("tenant", "environment", "name", "source", "flavor")
# A foreign engine's fields (runners.backends.engines): which engine, its image, and its named settings.
ENGINE_FIELDS = ("engine", "image", "max_model_len", "dtype")
# The shipped server's own settings, which a foreign engine takes none of.
SHIPPED_ONLY = ("queue_limit", "batch_token_budget", "max_batch_wait_ms")
FIELDS = (*REQUIRED, *BOUNDS, *ENGINE_FIELDS)
SOURCE_FIELDS = ("job", "step", "model", "version", "image", "path")
# What every replica asks for besides its GPUs: the portal's choice (the server needs no more).
REPLICA_CPU_MILLI = 1000
REPLICA_MEMORY_MIB = max(TRAINER_MIN_MEMORY_MIB, 2048)
# A foreign engine's replica, per GPU: its tokenizers, scheduler and workers, and the host side of its KV cache.
ENGINE_CPU_MILLI_PER_GPU = 4000
ENGINE_MEMORY_MIB_PER_GPU = 32768
# What a foreign engine serves from its image: a folder in it (absolute) or a name the engine resolves itself.
ENGINE_MODEL_PATTERN = r"[A-Za-z0-9_./-]{1,200}"
# A replica job's retries before the endpoint counts it as failed.
REPLICA_MAX_RETRIES = 3


def max_deadline_ms() -> int:
    """The longest deadline a request may carry: a drain (at most the grace period) must be able to answer it."""
    return int(min(120_000, max(1000, (settings.PREEMPTION_GRACE_PERIOD_S - 2) * 1000)))


def _whole(data: dict, field: str, low: int, high: int) -> int:
    value = data[field]
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(field, f"Must be a whole number, got {value!r}.")
    if not low <= value <= high:
        raise Invalid(field, f"Must be between {low} and {high}, got {value}.")
    return value


def _source(value, tenant: Tenant) -> dict:
    """{"model": name[, "version": n]}: a version of one of the tenant's models (its newest unless given);
    {"job": id[, "step": n]}: a checkpoint of one of the tenant's training jobs, promoted to a version at deploy;
    or {"image": ...} (Kubernetes). A model or version that does not exist is NotFound naming the field."""
    if not isinstance(value, dict) or not value:
        raise Invalid("source", 'Give {"model": "<name>"} (optionally with "version"), {"job": <id>} (optionally '
                                'with "step") or {"image": "<reference>"}.')
    unknown = sorted(set(value) - set(SOURCE_FIELDS))
    if unknown:
        raise Invalid(f"source.{unknown[0]}", "Unknown field.")
    if "model" in value or "version" in value:
        if set(value) & {"job", "step", "image"}:
            raise Invalid("source", "A model source takes no job, step or image.")
        if "model" not in value:
            raise Invalid("source.model", "The model whose version to serve.")
        version = registry_selectors.tenant_version_get(
            tenant=tenant, name=value["model"], version=value.get("version"), field="source.model",
            version_field="source.version")
        _version_servable(version)
        return {"model": version.name, "version": version.version}
    if "image" in value:
        if len(value) > 1:
            raise Invalid("source", "An image source takes no job or step.")
        if settings.CLUSTER_BACKEND != "kubernetes":
            raise Invalid("source.image", "Custom images run on the Kubernetes backend only; serve a job's checkpoint.")
        image, _ = jobs.image_check(value["image"], ["serve"])
        return {"image": image}
    job_id = value.get("job")
    if isinstance(job_id, bool) or not isinstance(job_id, int) or not 0 < job_id < 2**31:
        raise Invalid("source.job", "A training job's id.")
    job = Job.objects.filter(id=job_id, tenant=tenant, kind=Job.Kind.TRAINING).first()
    if job is None:
        raise Invalid("source.job", f"Tenant {tenant.slug} has no training job {job_id}.")
    if job.spec.get("template") not in SERVABLE_TEMPLATES:
        raise Invalid("source.job", "Only checkpoints of the shipped trainer (template pytorch-ddp) and of script jobs "
                                    "that save its model or a transformers model's folder can be served.")
    checkpoints = Checkpoint.objects.filter(job=job).newest_first()
    if "step" in value:
        step = value["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise Invalid("source.step", "A checkpoint's step.")
        checkpoints = checkpoints.filter(step=step)
    checkpoint = checkpoints.first()
    if checkpoint is None:
        where = f" at step {value['step']}" if "step" in value else ""
        raise Invalid("source.job" if "step" not in value else "source.step",
                      f"Job {job.name} has no checkpoint{where} yet; serve it once it has written one.")
    if job.spec["template"] == "script":
        _script_checkpoint_loads(job, checkpoint)
    return {"job": job.id, "step": checkpoint.step, "uri": checkpoint.uri}


def _version_servable(version: ModelVersion) -> None:
    """Invalid naming ``source`` unless the shipped server loads this version's weights: a checkpoint file of the
    shipped trainer's model, or a folder (kept as its .tar.gz) of a transformers model."""
    what = f"Model {version.name} version {version.version}"
    if version.template not in SERVABLE_TEMPLATES:
        raise Invalid("source", f"{what} was promoted from a {version.template} job's checkpoint, which the shipped "
                                f"server does not load. {SERVER_LOADS}")
    if version.weights_format == WeightsFormat.TAR_GZ:
        try:
            stream = registry.weights_store().open(version.weights_sha256)
        except BlobMissing as exc:
            raise Invalid("source", f"{what}'s weights cannot be read from the model store ({exc}).") from None
        with stream:
            _transformers_archive_check(what, stream)
        return
    if version.weights_format != WeightsFormat.FILE:
        raise Invalid("source", f"{what}'s weights are kept as {version.weights_format}, which the shipped server "
                                f"does not load. {SERVER_LOADS}")
    if version.template != "script":
        return
    if version.weights_bytes > SCRIPT_CHECKPOINT_CHECK_MAX_BYTES:
        raise Invalid("source", f"{what} is bigger than the shipped model's checkpoint ever is "
                                f"({SCRIPT_CHECKPOINT_CHECK_MAX_BYTES} bytes at most). {SERVER_LOADS}")
    try:
        data = registry.weights_store().read(version.weights_sha256)
    except (BlobMissing, HashMismatch) as exc:
        raise Invalid("source", f"{what}'s weights cannot be read from the model store ({exc}).") from None
    _script_bytes_load(what, data, shown_as=f"{version.name}-v{version.version}")


def served_version(*, actor: AbstractBaseUser, tenant: Tenant, source: dict, model_name: str) -> ModelVersion | None:
    """The model version an endpoint with this checked source serves: the one named, or the job's checkpoint promoted
    to a version of ``model_name`` (the endpoint's name). None for an image, and for a checkpoint the portal cannot
    copy (on Kubernetes, a checkpoint on the cluster's claim not yet durable in the checkpoint store): the replicas
    then read it from the source job's volume."""
    if "model" in source:
        return registry_selectors.tenant_version_get(tenant=tenant, name=source["model"], version=source["version"],
                                                     field="source.model", version_field="source.version")
    if "job" not in source:
        return None
    job = Job.objects.select_related("environment", "bundle", "tenant").get(id=source["job"])
    try:
        version, _ = registry.promote_checkpoint(actor=actor, job=job, step=source["step"], name=model_name)
    except registry.NotDurable:
        return None
    except Invalid as exc:
        raise Invalid("source.step", "; ".join(exc.messages)) from None
    return version


SERVABLE_TEMPLATES = ("pytorch-ddp", "script")
# A script job's checkpoint is served once the shipped server's own loader has loaded it here. The shipped
# model's checkpoints are well under a MiB (model, optimizer and all), so a bigger file is refused unread.
SCRIPT_CHECKPOINT_CHECK_MAX_BYTES = 64 * 1024 * 1024
SERVER_LOADS = ("The shipped server loads one checkpoint file of the shipped trainer's model: torch.save of a dict "
                "with \"format\": runners.workloads.train.CHECKPOINT_FORMAT and \"model\": a CharModel's state_dict "
                "(what runners.workloads.train.checkpoint_state returns, saved with ctx.checkpoint(step, state)); or "
                "a transformers causal language model's folder, as save_pretrained writes it (its config.json, "
                "weights and tokenizer; the folder saved with ctx.checkpoint(step, folder)).")
# A transformers model's folder: its config.json (at the folder's root, or in the one folder its archive holds) is
# read, at most this big; the weights and the tokenizer are the replica's to load when it starts.
TRANSFORMERS_CONFIG = "config.json"
TRANSFORMERS_CONFIG_MAX_BYTES = 1024 * 1024


class _ChunksReader(io.RawIOBase):
    """An iterator of byte chunks (a folder checkpoint's .tar.gz as the backend makes it) read as a stream."""

    def __init__(self, chunks) -> None:
        self._chunks = iter(chunks)
        self._left = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._left:
            try:
                self._left = memoryview(next(self._chunks))
            except StopIteration:
                return 0
        count = min(len(buffer), len(self._left))
        buffer[:count] = self._left[:count]
        self._left = self._left[count:]
        return count


def _transformers_archive_check(what: str, stream) -> None:
    """Invalid naming ``source`` unless the .tar.gz read from ``stream`` is a transformers model's folder: a
    config.json at its root or in a folder at its root (where the server's unpacking looks), a JSON object naming
    its ``model_type``. Read as a stream, up to that file only (a folder's files come in name order, so it is near
    the start); nothing is unpacked, and neither torch nor transformers is loaded here."""
    where = "at its root or in its one top folder"
    try:
        with tarfile.open(fileobj=stream, mode="r|gz") as archive:
            for member in archive:
                parts = [part for part in PurePosixPath(member.name).parts if part not in (".", "/")]
                if not parts or parts[-1] != TRANSFORMERS_CONFIG or len(parts) > 2:
                    continue
                if not member.isfile():
                    raise Invalid("source", f"{what} is a folder whose {member.name} is not a file. {SERVER_LOADS}")
                if member.size > TRANSFORMERS_CONFIG_MAX_BYTES:
                    raise Invalid("source", f"{what} is a folder whose {member.name} is over "
                                            f"{TRANSFORMERS_CONFIG_MAX_BYTES} bytes: not a model's config. "
                                            f"{SERVER_LOADS}")
                data = archive.extractfile(member).read(TRANSFORMERS_CONFIG_MAX_BYTES + 1)
                _transformers_config_check(what, member.name, data)
                return
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise Invalid("source", f"{what} is not a readable .tar.gz of a folder ({type(exc).__name__}: "
                                f"{str(exc)[:200]}). {SERVER_LOADS}") from None
    raise Invalid("source", f"{what} is a folder with no {TRANSFORMERS_CONFIG} {where}, so not a transformers "
                            f"model's. {SERVER_LOADS}")


def _transformers_config_check(what: str, name: str, data: bytes) -> None:
    """Invalid naming ``source`` unless ``data`` (the folder's config.json) is a JSON object naming a model_type,
    as every config save_pretrained writes does (transformers picks the model's class by it)."""
    try:
        config = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Invalid("source", f"{what} is a folder whose {name} is not JSON ({str(exc)[:200]}). "
                                f"{SERVER_LOADS}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise Invalid("source", f"{what} is a folder whose {name} names no model_type, so not a transformers "
                                f"model's config. {SERVER_LOADS}")


def _script_checkpoint_loads(job: Job, checkpoint: Checkpoint) -> None:
    """Invalid naming ``source`` unless the shipped server's loader (runners.workloads.serve_engine.load_model) loads this
    script checkpoint, onto the CPU, weights only (no pickled code runs); or, for a folder, unless it is a
    transformers model's (`_transformers_archive_check`: its config.json, read without loading anything).

    The file is the tenant's (its script may still write it), so it is read once through the backend (a file in
    the job's folder, no link followed) into a copy of the portal's, and only a torch.save archive whose members
    are stored as torch.save stores them (uncompressed) and add up to at most the bound is loaded: nothing the
    load reads can grow past what was checked."""
    what = f"Job {job.name}'s checkpoint of step {checkpoint.step}"
    backend = get_backend()
    try:
        opened = backend.job_checkpoint(job.id, job.environment.namespace, checkpoint.uri)
    except CheckpointGone:
        raise Invalid("source", f"{what} was deleted; serve one the job still keeps.") from None
    except CheckpointElsewhere:
        raise Invalid("source", f"The {backend.name} backend keeps job {job.name}'s checkpoints in the cluster, where "
                                f"the portal cannot check that the shipped server loads them; on this backend only "
                                f"pytorch-ddp jobs' checkpoints are served.") from None
    except BackendError as exc:
        raise Invalid("source", f"{what} cannot be read now ({exc}); try again.") from None
    try:
        if opened.is_folder:
            # Read as the .tar.gz the backend makes of it (what a promotion stores), up to its config.json.
            _transformers_archive_check(what, io.BufferedReader(_ChunksReader(opened.chunks), 1024 * 1024))
            return
        data = opened.stream.read(SCRIPT_CHECKPOINT_CHECK_MAX_BYTES + 1)
    finally:
        opened.close()
    if len(data) > SCRIPT_CHECKPOINT_CHECK_MAX_BYTES:
        raise Invalid("source", f"{what} is bigger than the shipped model's checkpoint ever is "
                                f"({SCRIPT_CHECKPOINT_CHECK_MAX_BYTES} bytes at most). {SERVER_LOADS}")
    _script_bytes_load(what, data, shown_as=checkpoint.uri)


def _script_bytes_load(what: str, data: bytes, *, shown_as: str) -> None:
    """Invalid naming ``source`` unless ``data`` is a torch.save archive of stored members within the bound that the
    shipped server's loader loads (onto the CPU, weights only)."""
    too_big = (f"{what} is bigger than the shipped model's checkpoint ever is ({SCRIPT_CHECKPOINT_CHECK_MAX_BYTES} "
               f"bytes at most). {SERVER_LOADS}")
    with tempfile.NamedTemporaryFile(prefix="script-checkpoint-", suffix=".pt") as copy:
        copy.write(data)
        copy.flush()
        try:
            with zipfile.ZipFile(copy.name) as archive:
                members = archive.infolist()
        except (zipfile.BadZipFile, OSError):
            raise Invalid("source", f"{what} is not a torch.save file. {SERVER_LOADS}") from None
        if any(member.compress_type != zipfile.ZIP_STORED for member in members):
            raise Invalid("source", f"{what} is not a torch.save file (it has compressed members). {SERVER_LOADS}")
        if sum(member.file_size for member in members) > SCRIPT_CHECKPOINT_CHECK_MAX_BYTES:
            raise Invalid("source", too_big)
        import torch

        from runners.workloads.serve_engine import load_model

        try:
            load_model(Path(copy.name), torch.device("cpu"))
        except Exception as exc:  # whatever torch says of a file that is not the model's, in its own words
            first_line = (str(exc).replace(copy.name, shown_as).strip().splitlines() or [""])[0][:300]
            raise Invalid("source", f"{what} does not load in the shipped server ({type(exc).__name__}: "
                                    f"{first_line}). {SERVER_LOADS}") from None


def engine_of(spec: dict) -> str:
    """The engine an endpoint's spec runs ("shipped" for a spec from before engines)."""
    return spec.get("engine") or engine_kinds.SHIPPED


def _engine_check(spec: dict, given: dict) -> None:
    """The engine fields of a spec, checked in place (Invalid names the field): ``engine`` one of the engines, a
    foreign one on the Kubernetes backend only, with its ``image`` from an allowed registry and its settings."""
    engine = spec.setdefault("engine", engine_kinds.SHIPPED)
    if engine not in engine_kinds.ENGINES:
        raise Invalid("engine", f"One of {', '.join(engine_kinds.ENGINES)}, got {engine!r}.")
    if engine == engine_kinds.SHIPPED:
        for field in ("image", "max_model_len", "dtype"):
            if field in given:
                raise Invalid(field, f"Only a foreign engine ({', '.join(engine_kinds.FOREIGN_ENGINES)}) takes "
                                     f"{field}; the shipped server's image is the portal's (a custom one is "
                                     f'source {{"image": ...}}).')
        for field in ENGINE_FIELDS[1:]:
            spec.pop(field, None)
        return
    if settings.CLUSTER_BACKEND != "kubernetes":
        raise Invalid("engine", f"Engine {engine} runs on the Kubernetes backend only; here endpoints run the "
                                f"shipped server.")
    for field in SHIPPED_ONLY:
        if field in given:
            raise Invalid(field, f"A setting of the shipped server; engine {engine} takes none (max_model_len and "
                                 f"dtype are its settings).")
        spec.pop(field, None)
    if given.get("image") in (None, ""):
        raise Invalid("image", f"Engine {engine} runs an image from an allowed registry: name it.")
    spec["image"], _ = jobs.image_check(given["image"], ["serve"])
    length = spec.setdefault("max_model_len", None)
    if length is not None:
        _whole(spec, "max_model_len", *engine_kinds.MAX_MODEL_LEN)
    dtype = spec.setdefault("dtype", "auto")
    if dtype not in engine_kinds.dtypes(engine):
        raise Invalid("dtype", f"Engine {engine} takes one of {', '.join(engine_kinds.dtypes(engine))}, got {dtype!r}.")


def _engine_source(value, engine: str, tenant: Tenant) -> dict:
    """What a foreign engine serves: {"path": "<folder in its image, or a name the engine resolves>"}, or
    {"model": name[, "version": n]}, a version of one of the tenant's models whose weights are a folder (kept as a
    .tar.gz: what save_pretrained writes), fetched and unpacked in the replica's pod."""
    if isinstance(value, dict) and ("model" in value or "version" in value) and not set(value) - {"model", "version"}:
        if "model" not in value:
            raise Invalid("source.model", "The model whose version to serve.")
        version = registry_selectors.tenant_version_get(
            tenant=tenant, name=value["model"], version=value.get("version"), field="source.model",
            version_field="source.version")
        if version.weights_format != WeightsFormat.TAR_GZ:
            raise Invalid("source", f"Model {version.name} version {version.version} is one checkpoint file (the "
                                    f"shipped server's); engine {engine} serves a model's folder (a version promoted "
                                    f"from a checkpoint that is a folder, e.g. what save_pretrained writes).")
        return {"model": version.name, "version": version.version}
    if not isinstance(value, dict) or set(value) != {"path"}:
        raise Invalid("source", f'Engine {engine} serves {{"path": "<folder in its image, or a model name>"}} or '
                                f'{{"model": "<name>", "version": <n>}} (a version whose weights are a folder).')
    path = value["path"]
    if not isinstance(path, str) or not re.fullmatch(ENGINE_MODEL_PATTERN, path) or ".." in path.split("/"):
        raise Invalid("source.path", "A folder in the image (/models/<name>) or a model's name (<org>/<name>): "
                                     "letters, digits, '.', '_', '-' and '/', at most 200, no '..'.")
    return {"path": path}


def endpoint_spec_check(*, actor: AbstractBaseUser, data) -> dict:
    """The endpoint as asked for, checked field by field; Invalid names the first bad field.

    Exactly the documented shape: any other field is refused by name, never ignored.
    """
    jobs.spec_shape_check(data, fields=FIELDS, required=REQUIRED, what="An endpoint")
    spec = {**{field: default for field, (_, _, default) in BOUNDS.items()}, **data}
    tenant, environment = jobs.member_tenant_and_ready_environment(actor, spec["tenant"], spec["environment"])
    if not isinstance(spec["name"], str) or not re.fullmatch(NAME_PATTERN, spec["name"]):
        raise Invalid("name", f"Lowercase letters, digits and '-', at most {NAME_MAX}, starting and ending alphanumeric.")
    _engine_check(spec, data)
    engine = engine_of(spec)
    if engine == engine_kinds.SHIPPED:
        if isinstance(spec["source"], dict) and "path" in spec["source"]:
            raise Invalid("source.path", "A path is what a foreign engine serves from its image; the shipped server "
                                         "serves a model version or a job's checkpoint.")
        spec["source"] = _source(spec["source"], tenant)
    else:
        spec["source"] = _engine_source(spec["source"], engine, tenant)
    flavor, quota = jobs.flavor_and_quota(tenant, spec["flavor"])
    sliced = flavor.kind in (PartitionKind.MIG, PartitionKind.TIMESLICE)
    for field, (low, high, _) in BOUNDS.items():
        if field not in spec:
            continue  # a shipped server's setting, which a foreign engine has none of
        if field == "gpus_per_replica" and sliced:
            high = 1
        if field == "default_deadline_ms":
            high = min(high, max_deadline_ms())
        _whole(spec, field, low, high)
    if spec["max_replicas"] < max(1, spec["min_replicas"]):
        raise Invalid("max_replicas", f"At least min_replicas ({spec['min_replicas']}) and at least 1.")
    if spec["warm_replicas"] > spec["max_replicas"]:
        raise Invalid("warm_replicas", f"At most max_replicas ({spec['max_replicas']}).")
    units = spec["gpus_per_replica"]
    if spec["min_replicas"] * units > quota.guaranteed:
        raise Invalid(
            "min_replicas",
            f"Replicas up to min_replicas are never preempted, so they must fit the guarantee: {spec['min_replicas']} x "
            f"{units} units of {flavor.name} is past tenant {tenant.slug}'s guarantee of {quota.guaranteed}.",
        )
    if spec["max_replicas"] * units > quota.max:
        raise Invalid(
            "max_replicas",
            f"{spec['max_replicas']} x {units} units of {flavor.name} is past tenant {tenant.slug}'s max of {quota.max}.",
        )
    jobs.gang_fits_the_cluster(flavor, replicas=1, gpus_per_replica=units,
                               topology={"level": "none", "mode": "preferred"})
    return {"spec": spec, "tenant": tenant, "environment": environment, "flavor": flavor}


def _checkpoint_fields(source: dict, version: ModelVersion | None) -> dict:
    """What the endpoint records of what it serves: the model version, and the job and step it came from (while the
    job exists; the version's lineage keeps them after)."""
    if "job" in source:
        return {"source_job_id": source["job"], "checkpoint_uri": source["uri"], "checkpoint_step": source["step"],
                "model_version": version}
    if version is not None:
        return {"source_job_id": version.source_job_id, "checkpoint_uri": version.lineage.get("checkpoint_uri", ""),
                "checkpoint_step": version.step, "model_version": version}
    return {"source_job_id": None, "checkpoint_uri": "", "checkpoint_step": None, "model_version": None}


def _served_what(endpoint: InferenceEndpoint) -> dict:
    """The endpoint's source for the audit log: as asked, and the model version it became."""
    source = {key: value for key, value in endpoint.spec["source"].items() if key != "uri"}
    if endpoint.model_version is not None:
        source["model_version"] = {"name": endpoint.model_version.name, "version": endpoint.model_version.version}
    return source


def endpoint_deploy(*, actor: AbstractBaseUser, data) -> InferenceEndpoint:
    """Check and record an endpoint; the reconcile starts its replicas (kicked after commit)."""
    checked = endpoint_spec_check(actor=actor, data=data)
    spec = checked["spec"]
    # The copy into the model store is made once every other field is checked, with no row locked.
    version = served_version(actor=actor, tenant=checked["tenant"], source=spec["source"], model_name=spec["name"])
    try:
        with transaction.atomic():
            environment = Environment.objects.select_for_update(of=("self",)).filter(
                id=checked["environment"].id).order_by("id").first()
            if environment is None or environment.state != EnvironmentState.READY:
                raise Invalid("environment", f"Environment {checked['environment'].name} is no longer ready.")
            if version is not None:  # a delete of the version waits for this, or wins and this says so
                version = registry_selectors.version_lock(version)
            desired = max(spec["min_replicas"], min(spec["max_replicas"], 1 + spec["warm_replicas"]))
            endpoint = InferenceEndpoint.objects.create(
                tenant=checked["tenant"], environment=environment, name=spec["name"], spec=spec,
                flavor=checked["flavor"], gpus_per_replica=spec["gpus_per_replica"],
                min_replicas=spec["min_replicas"], max_replicas=spec["max_replicas"],
                warm_replicas=spec["warm_replicas"], desired_replicas=desired, created_by=actor,
                reason="Starting its replicas.", last_request_at=timezone.now(),
                **_checkpoint_fields(spec["source"], version),
            )
            ScaleEvent.objects.create(endpoint=endpoint, from_replicas=0, to_replicas=desired,
                                      reason=f"Deployed by {actor.get_username()}.")
            record("endpoint.created", actor=actor, tenant=endpoint.tenant, obj=endpoint,
                   object_repr=_endpoint_repr(endpoint),
                   after={"flavor": endpoint.flavor.name, "environment": environment.name,
                          **snapshot(endpoint, SCALE_FIELDS), "source": _served_what(endpoint)})
            transaction.on_commit(kick_reconcile)
    except IntegrityError:
        raise Invalid("name", f"Tenant {checked['tenant'].slug} already has a live endpoint {spec['name']}.") from None
    return endpoint


SCALE_FIELDS = ["min_replicas", "max_replicas", "warm_replicas", "gpus_per_replica"]


def _endpoint_repr(endpoint: InferenceEndpoint) -> str:
    return f"{endpoint.name} #{endpoint.id}"


def _locked(endpoint: InferenceEndpoint) -> InferenceEndpoint:
    return InferenceEndpoint.objects.select_for_update(of=("self",)).get(id=endpoint.id)


def endpoint_scale(*, actor: AbstractBaseUser, endpoint: InferenceEndpoint, data) -> InferenceEndpoint:
    """Change min, max and warm replicas (any of them); the autoscaler moves within the new bounds."""
    require_role(user=actor, tenant=endpoint.tenant, at_least=Role.MEMBER)
    if not isinstance(data, dict):
        raise Invalid("non_field_errors", "A JSON object with any of min_replicas, max_replicas, warm_replicas.")
    allowed = ("min_replicas", "max_replicas", "warm_replicas")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise Invalid(unknown[0], "Unknown field; scale takes min_replicas, max_replicas and warm_replicas.")
    if not data:
        raise Invalid("non_field_errors", "Give at least one of min_replicas, max_replicas, warm_replicas.")
    with transaction.atomic():
        endpoint = _locked(endpoint)
        if endpoint.stop_requested_at is not None:
            raise Conflict(f"Endpoint {endpoint.name} is {endpoint.state}.")
        values = {field: data.get(field, getattr(endpoint, field)) for field in allowed}
        for field in allowed:
            low, high, _ = BOUNDS[field]
            _whole(values, field, low, high)
        if values["max_replicas"] < max(1, values["min_replicas"]):
            raise Invalid("max_replicas", f"At least min_replicas ({values['min_replicas']}) and at least 1.")
        if values["warm_replicas"] > values["max_replicas"]:
            raise Invalid("warm_replicas", f"At most max_replicas ({values['max_replicas']}).")
        quota = Quota.objects.filter(tenant=endpoint.tenant, flavor=endpoint.flavor).first()
        if quota is None:
            raise Invalid("flavor", f"Tenant {endpoint.tenant.slug} no longer has a quota for {endpoint.flavor.name}.")
        if values["min_replicas"] * endpoint.gpus_per_replica > quota.guaranteed:
            raise Invalid("min_replicas", f"Past tenant {endpoint.tenant.slug}'s guarantee of {quota.guaranteed} units "
                                          f"of {endpoint.flavor.name}.")
        if values["max_replicas"] * endpoint.gpus_per_replica > quota.max:
            raise Invalid("max_replicas", f"Past tenant {endpoint.tenant.slug}'s max of {quota.max} units "
                                          f"of {endpoint.flavor.name}.")
        before = endpoint.desired_replicas
        audit_before = snapshot(endpoint, allowed)
        for field, value in values.items():
            setattr(endpoint, field, value)
            endpoint.spec[field] = value
        endpoint.desired_replicas = max(endpoint.min_replicas, min(endpoint.max_replicas, before))
        endpoint.save(update_fields=[*allowed, "spec", "desired_replicas"])
        ScaleEvent.objects.create(
            endpoint=endpoint, from_replicas=before, to_replicas=endpoint.desired_replicas,
            reason=f"{actor.get_username()} set min {values['min_replicas']}, max {values['max_replicas']}, "
                   f"warm {values['warm_replicas']}.",
        )
        record("endpoint.scaled", actor=actor, tenant=endpoint.tenant, obj=endpoint, object_repr=_endpoint_repr(endpoint),
               before=audit_before, after=snapshot(endpoint, allowed))
        # A replica's preemptibility follows its slot: the reconcile replaces replicas whose slot changed side.
        transaction.on_commit(kick_reconcile)
    return endpoint


def endpoint_rollout(*, actor: AbstractBaseUser, endpoint: InferenceEndpoint, data) -> InferenceEndpoint:
    """Serve another checkpoint: a new generation, replacing the replicas one at a time, none dropped."""
    require_role(user=actor, tenant=endpoint.tenant, at_least=Role.MEMBER)
    engine = engine_of(endpoint.spec)
    foreign = engine != engine_kinds.SHIPPED
    if not isinstance(data, dict) or "source" not in data:
        raise Invalid("source", 'Give what to roll out to: {"source": {"model": "<name>", "version": <n>}} or '
                                '{"source": {"job": <id>, "step": <n>}}' + (
                                    ' (a foreign engine: {"source": {"path": "..."}}, optionally with "image").'
                                    if foreign else "."))
    allowed = {"source", "image"} if foreign else {"source"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise Invalid(unknown[0], "Unknown field; rollout takes " + (
            "source and image." if foreign else "source only (image: a foreign engine's endpoint)."))
    if endpoint.stop_requested_at is not None:
        raise Conflict(f"Endpoint {endpoint.name} is {endpoint.state}.")
    image = endpoint.spec.get("image")
    if foreign:
        source = _engine_source(data["source"], engine, endpoint.tenant)
        if "image" in data:
            image, _ = jobs.image_check(data["image"], ["serve"])
    else:
        source = _source(data["source"], endpoint.tenant)
    version = served_version(actor=actor, tenant=endpoint.tenant, source=source, model_name=endpoint.name)
    with transaction.atomic():
        endpoint = _locked(endpoint)
        if endpoint.stop_requested_at is not None:
            raise Conflict(f"Endpoint {endpoint.name} is {endpoint.state}.")
        if version is not None:  # a delete of the version waits for this, or wins and this says so
            version = registry_selectors.version_lock(version)
        audit_before = {"source": _served_what(endpoint), "generation": endpoint.generation,
                        **({"image": endpoint.spec.get("image")} if foreign else {})}
        endpoint.spec["source"] = source
        if foreign:
            endpoint.spec["image"] = image
        for field, value in _checkpoint_fields(source, version).items():
            setattr(endpoint, field, value)
        endpoint.generation += 1
        endpoint.save(update_fields=["spec", "source_job", "checkpoint_uri", "checkpoint_step", "model_version",
                                     "generation"])
        if version is not None:
            what = f"model {version.name} version {version.version}"
        elif foreign:
            what = source["path"]
        else:
            what = f"job {source['job']} step {source['step']}" if "job" in source else source["image"]
        if foreign:
            what = f"{what} on {engine} ({image})"
        ScaleEvent.objects.create(
            endpoint=endpoint, from_replicas=endpoint.desired_replicas, to_replicas=endpoint.desired_replicas,
            reason=f"Rollout to {what} (generation {endpoint.generation}) by {actor.get_username()}: "
                   f"replicas are replaced one at a time.",
        )
        record("endpoint.rolled_out", actor=actor, tenant=endpoint.tenant, obj=endpoint,
               object_repr=_endpoint_repr(endpoint), before=audit_before,
               after={"source": _served_what(endpoint), "generation": endpoint.generation,
                      **({"image": image} if foreign else {})})
        transaction.on_commit(kick_reconcile)
    return endpoint


def endpoint_stop(*, actor: AbstractBaseUser, endpoint: InferenceEndpoint) -> InferenceEndpoint:
    """Stop serving: every replica drains (answers what it admitted) and ends; the endpoint then reads stopped."""
    require_role(user=actor, tenant=endpoint.tenant, at_least=Role.MEMBER)
    with transaction.atomic():
        endpoint = _locked(endpoint)
        if endpoint.stop_requested_at is None:
            audit_before = {"state": endpoint.state, "desired_replicas": endpoint.desired_replicas}
            endpoint.stop_requested_at = timezone.now()
            ScaleEvent.objects.create(endpoint=endpoint, from_replicas=endpoint.desired_replicas, to_replicas=0,
                                      reason=f"Stopped by {actor.get_username()}.")
            endpoint.desired_replicas = 0
            set_state(endpoint, EndpointState.DRAINING, f"Stopped by {actor.get_username()}: draining its replicas.")
            endpoint.save(update_fields=["stop_requested_at", "desired_replicas"])
            record("endpoint.stopped", actor=actor, tenant=endpoint.tenant, obj=endpoint,
                   object_repr=_endpoint_repr(endpoint), before=audit_before,
                   after={"state": endpoint.state, "desired_replicas": 0})
            transaction.on_commit(kick_reconcile)
    return endpoint


def set_state(endpoint: InferenceEndpoint, state: str, reason: str) -> None:
    """Write the endpoint's state and reason (the caller holds its row)."""
    if endpoint.state == state and endpoint.reason == reason:
        return
    fields = {"state": state, "reason": reason[:1000]}
    if endpoint.state != state:
        fields["state_changed_at"] = timezone.now()
    InferenceEndpoint.objects.filter(id=endpoint.id).update(**fields)
    for name, value in fields.items():
        setattr(endpoint, name, value)


def kick_reconcile() -> None:
    """Ask for an endpoint reconcile soon; the beat runs one anyway."""
    send_task_at_most_every(1, "runners.tasks.endpoints_reconcile", timezone.now().timestamp())


# --- Replicas: one serving job each -----------------------------------------------------


def replica_job_spec(endpoint: InferenceEndpoint, slot: int, *, borrowing: bool = False) -> dict:
    """The spec of one replica's job, built here from the endpoint's validated spec only. ``borrowing``: preemptible
    whatever its slot (started beside its slot's old replica in a rollout)."""
    spec = endpoint.spec
    source = spec["source"]
    version = endpoint.model_version
    # A model version's replicas serve its weights (from the node cache's copy, else the store); only an endpoint
    # whose checkpoint the portal could not copy (Kubernetes) reads it from the source job's volume.
    weights = {"sha256": version.weights_sha256, "bytes": version.weights_bytes} if version is not None else None
    engine = engine_of(spec)
    if engine != engine_kinds.SHIPPED:
        return _engine_replica_job_spec(endpoint, slot, engine, borrowing=borrowing)
    return {
        "tenant": endpoint.tenant.slug, "environment": endpoint.environment_id,
        "name": f"{endpoint.name}-g{endpoint.generation}-r{slot}", "template": "serve", "replicas": 1,
        "flavor": endpoint.flavor.name, "gpus_per_replica": endpoint.gpus_per_replica,
        "cpu_milli_per_replica": REPLICA_CPU_MILLI, "memory_mib_per_replica": REPLICA_MEMORY_MIB,
        "topology": {"level": "none", "mode": "preferred"}, "priority": 0,
        "preemptible": borrowing or slot >= endpoint.min_replicas, "steps": 1, "checkpoint_every_steps": 0,
        "max_runtime_s": jobs.MAX_RUNTIME_S, "max_retries": REPLICA_MAX_RETRIES, "env": {}, "hyperparameters": {},
        "image": source.get("image"), "command": None,
        "serving": {
            "endpoint_id": endpoint.id, "checkpoint": "" if weights else endpoint.checkpoint_uri,
            "source_job_id": None if weights else source.get("job"), "weights": weights,
            "queue_limit": spec["queue_limit"], "batch_token_budget": spec["batch_token_budget"],
            "max_batch_wait_ms": spec["max_batch_wait_ms"], "default_deadline_ms": spec["default_deadline_ms"],
            "max_deadline_ms": max_deadline_ms(), "image": source.get("image"),
        },
    }


def _engine_replica_job_spec(endpoint: InferenceEndpoint, slot: int, engine: str, *, borrowing: bool) -> dict:
    """A foreign engine's replica job: its image and the model in it, its named settings, CPU and memory for an
    engine (per GPU); nothing of the shipped server's."""
    spec = endpoint.spec
    units = endpoint.gpus_per_replica
    version = endpoint.model_version
    # A model version's folder is fetched (or read from the node cache) and unpacked in the pod; a path is the image's.
    weights = {"sha256": version.weights_sha256, "bytes": version.weights_bytes} if version is not None else None
    return {
        "tenant": endpoint.tenant.slug, "environment": endpoint.environment_id,
        "name": f"{endpoint.name}-g{endpoint.generation}-r{slot}", "template": "serve", "replicas": 1,
        "flavor": endpoint.flavor.name, "gpus_per_replica": units,
        "cpu_milli_per_replica": ENGINE_CPU_MILLI_PER_GPU * units,
        "memory_mib_per_replica": ENGINE_MEMORY_MIB_PER_GPU * units,
        "topology": {"level": "none", "mode": "preferred"}, "priority": 0,
        "preemptible": borrowing or slot >= endpoint.min_replicas, "steps": 1, "checkpoint_every_steps": 0,
        "max_runtime_s": jobs.MAX_RUNTIME_S, "max_retries": REPLICA_MAX_RETRIES, "env": {}, "hyperparameters": {},
        "image": spec["image"], "command": None,
        "serving": {
            "endpoint_id": endpoint.id, "checkpoint": "", "source_job_id": None, "weights": weights,
            "default_deadline_ms": spec["default_deadline_ms"], "max_deadline_ms": max_deadline_ms(),
            "image": spec["image"], "engine": engine, "model": spec["source"].get("path", ""),
            "served_name": endpoint.name,
            "max_model_len": spec.get("max_model_len"), "dtype": spec.get("dtype", "auto"),
        },
    }


def replica_start(endpoint: InferenceEndpoint, slot: int, reason: str, *, borrowing: bool = False) -> Replica:
    """Queue one replica's job through the jobs app, as a submit is queued (the caller holds the endpoint's row,
    then `jobs.queue_locks`); TooMany past the tenant's budget of waiting jobs. The cycle is kicked after commit."""
    spec = replica_job_spec(endpoint, slot, borrowing=borrowing)
    job = jobs.job_queue_locked(
        tenant=endpoint.tenant, environment=endpoint.environment, flavor=endpoint.flavor, spec=spec,
        submitted_by=endpoint.created_by, actor=SYSTEM, kind=Job.Kind.SERVING,
        event_reason=f"Replica of endpoint {endpoint.name}: {reason}",
    )
    return Replica.objects.create(endpoint=endpoint, job=job, slot=slot, generation=endpoint.generation,
                                  model_version=endpoint.model_version)


def replica_retire(replica: Replica, reason: str) -> None:
    """Drain and stop one replica (the caller holds the endpoint's row): its job is cancelled with the grace period,
    and the server answers everything it admitted before it exits."""
    job = Job.objects.select_for_update(of=("self",)).get(id=replica.job_id)
    Replica.objects.filter(id=replica.id).update(retiring=True, ready=False)
    replica.retiring, replica.ready = True, False
    if job.state in JOB_FINAL_STATES:
        return
    jobs.job_cancel_locked(job, reason, final_is_conflict=False)
    if job.state == JobState.CANCELLING:
        transaction.on_commit(lambda: jobs.send_job_stop(job.id))
    transaction.on_commit(jobs.kick_cycle)
