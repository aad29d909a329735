"""An attempt's life: launched, stopped, preempted, its progress recorded, ended. What the workers do
between scheduling cycles; the reconcile (runners/jobs/reconcile.py) drives each open attempt on.

**The ownership rule.** An attempt is open from its admission until ``ended_at`` is written, and
every write that starts, ends or moves an attempt or its job is conditional on what it read, under
the job's row lock, and acted on by its result:

- A launch *claims* the attempt under the job's row lock (admitted -> launching, or a launching
  attempt whose lease ran out), writing its token and a lease (``launch_lease_until``,
  JOB_LAUNCH_LEASE_S) that a thread renews while the backend call runs. Nobody ends or relaunches
  an attempt whose lease is live.
- The launch's final write (``started_at``) matches only while its token holds the attempt and the
  attempt is open. A final write that matched nothing means the attempt was ended (or taken over)
  meanwhile: the launch stops what it started, whatever state the job is in now.
- Ending an attempt that never started (a cancel or preemption of an admitted job, a stop that
  came while it launched, a worker that died mid-launch) happens only with no live lease; and
  since a dead launcher may have started something, the backend is then told to kill and forget it.
- A job in a state that waits on a message (admitted, launching, cancelling, preempted) is found
  again by the reconcile from the database and driven on after a bounded time, whatever the
  broker lost: a launch is sent again (under a fresh token, so stale copies cannot claim), a stop
  is re-sent, a victim past its deadline is killed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import uuid
from dataclasses import replace
from datetime import datetime

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Max, Q
from django.utils import timezone

from audit.services import SYSTEM, record
from quotas.selectors import flavor_kubernetes_resource
from runners.backends.base import (
    BackendError,
    BundleRef,
    CheckpointElsewhere,
    CheckpointGone,
    CheckpointRestore,
    DatasetMount,
    JobLaunch,
    NodeLostError,
    PermanentBackendError,
    ReplicaPlacement,
    ServingSettings,
    ShardRef,
    TrainerSettings,
    WorkspaceSettings,
)
from runners.bundles import services as bundles
from runners.bundles.fetch_view import signed_fetch_url
from runners.clusters.registry import get_backend
from runners.clusters.selectors import node_cache_specs
from runners.datasets import selectors as datasets
from runners.datasets.fetch_view import signed_shard_url
from runners.datasets.services import uses_read
from runners.jobs import checkpoint_store, checkpoint_upload, signals
from runners.jobs.models import (
    JOB_HOLDING_STATES,
    AttemptOutcome,
    Checkpoint,
    Job,
    JobAttempt,
    JobMetric,
    JobState,
)
from runners.jobs.services import (
    TRAINER_KEEP_CHECKPOINTS,
    kick_cycle,
    rows_insert,
    send_job_stop,
    transition,
    transition_locked,
)
from runners.workloads.progress import EXIT_CHECKPOINTED_ON_SIGNAL, EXIT_OK

logger = logging.getLogger(__name__)
# A finishing attempt's progress is read until it is drained, at most this many reads.
FINAL_PROGRESS_READS = 8


# --- Queries every part of the job path shares ------------------------------------------


def open_attempt(job: Job) -> JobAttempt | None:
    """The job's open attempt (at most one exists), or None."""
    return job.attempts.open().order_by("-number").first()


def open_attempts(jobs) -> dict[int, JobAttempt]:
    """The open attempt of each of these jobs (a list or a queryset), by job id, in one query."""
    return {
        attempt.job_id: attempt
        for attempt in JobAttempt.objects.open().filter(job__in=jobs).order_by("number")
    }


def newest_checkpoint_step(job: Job) -> int | None:
    return job.checkpoints.newest_first().values_list("step", flat=True).first()


def runtime_used_s(job: Job, *, now=None) -> float:
    """How much of max_runtime_s the job's attempts have used, each counted from its trainer's first step."""
    now = now or timezone.now()
    used = 0.0
    for first_step, ended in job.attempts.filter(first_step_at__isnull=False).values_list("first_step_at", "ended_at"):
        used += max(0.0, ((ended or now) - first_step).total_seconds())
    return used


def runtime_left_s(job: Job) -> int:
    return max(1, int(job.spec["max_runtime_s"] - runtime_used_s(job)))


def _lease_until():
    return timezone.now() + timezone.timedelta(seconds=settings.JOB_LAUNCH_LEASE_S)


def _lease_live(attempt: JobAttempt, now) -> bool:
    return attempt.launch_lease_until is not None and attempt.launch_lease_until > now


# --- Launch -----------------------------------------------------------------------------


def _bundle_ref(job: Job, attempt: JobAttempt) -> BundleRef | None:
    """A script job's bundle as the backends read it: its digest, its archive's storage URL (the local
    backend reads it there) and a signed portal URL a pod fetches it from (Kubernetes)."""
    if job.spec.get("template") != "script":
        return None
    bundle = job.bundle
    if bundle is None or bundle.deleted_at is not None:
        raise PermanentBackendError(f"The job's bundle {job.spec.get('bundle')} was deleted; submit it again "
                                    f"with a bundle that exists.")
    return BundleRef(sha256=bundle.sha256, url=bundles.bundle_url(bundle),
                     fetch_url=signed_fetch_url(bundle, job_id=job.id, attempt=attempt.number,
                                                since=attempt.admitted_at))


def _dataset_mounts(job: Job, attempt: JobAttempt) -> tuple[DatasetMount, ...]:
    """The dataset versions the spec pinned, shard by shard, each with a signed portal URL for a pod that cannot
    read its node's cache. Access is checked again: a dataset unshared since the submit fails the launch."""
    if not job.spec.get("datasets"):
        return ()
    try:
        mounts = datasets.mounts_for_job_spec(job.tenant, job.spec)
    except datasets.UnknownDataset as exc:
        raise PermanentBackendError(f"{exc.messages[0]} The job names it in its spec; it was removed or unshared "
                                    "since the submit.") from None
    return tuple(
        DatasetMount(name=name, version=number, shards=tuple(
            ShardRef(sha256=sha256, bytes=size, fetch_url=signed_shard_url(
                sha256, job_id=job.id, attempt=attempt.number, since=attempt.admitted_at))
            for sha256, size in shards))
        for name, number, shards in mounts
    )


def _checkpoint_restore(job: Job) -> CheckpointRestore | None:
    """The job's newest durable checkpoint, for the backend to restore from the store where the job folder on
    the node the attempt lands on lacks it (or holds it damaged); None when no checkpoint is durable."""
    if job.kind != Job.Kind.TRAINING:
        return None
    newest = (job.checkpoints.filter(store_state="durable", manifest__isnull=False)
              .select_related("attempt").order_by("-step").first())
    if newest is None:
        return None
    placement = newest.attempt.placement if newest.attempt is not None else []
    node = next((replica["node"] for replica in placement if replica.get("replica") == 0), "")
    return CheckpointRestore(step=newest.step, path=newest.uri, node=node,
                             manifest=json.dumps(newest.manifest, separators=(",", ":")))


def _serving_settings(job: Job, attempt: JobAttempt) -> ServingSettings:
    """An inference replica's settings; a model version's weights come with the URL signed for this attempt that
    a pod without the node cache's volume fetches them from (the apps above answer ``serving_weights_url``)."""
    serving = ServingSettings(**job.spec["serving"])
    if serving.weights is None:
        return serving
    urls = [url for _receiver, url in signals.serving_weights_url.send(sender=Job, job=job, attempt=attempt) if url]
    return replace(serving, weights=replace(serving.weights, fetch_url=urls[0])) if urls else serving


def _workspace_settings(job: Job) -> WorkspaceSettings:
    """A workspace's settings, answered by the app that owns workspaces (above this one)."""
    answers = [fields for _receiver, fields in signals.workspace_launch.send(sender=Job, job=job) if fields]
    if not answers:
        raise PermanentBackendError("The workspace this job started is gone.")
    return WorkspaceSettings(**answers[0])


def job_launch_spec(job: Job, attempt: JobAttempt) -> JobLaunch:
    spec = job.spec
    hyper = spec.get("hyperparameters") or {}
    script = spec["template"] == "script"
    return JobLaunch(
        job_id=job.id,
        attempt=attempt.number,
        tenant_slug=job.tenant.slug,
        namespace=job.environment.namespace,
        name=job.name,
        template=spec["template"],
        replicas=tuple(
            ReplicaPlacement(
                rank=replica["replica"], node=replica["node"], gpus=tuple(replica["gpus"]),
                mig_profile=replica.get("mig_profile"), mig_start=replica.get("mig_start"),
            )
            for replica in attempt.placement
        ),
        gpu_resource=flavor_kubernetes_resource(job.flavor),
        gpus_per_replica=job.gpus_per_replica,
        cpu_milli_per_replica=spec["cpu_milli_per_replica"],
        memory_mib_per_replica=spec["memory_mib_per_replica"],
        steps=spec["steps"],
        checkpoint_every_steps=spec["checkpoint_every_steps"],
        max_runtime_s=runtime_left_s(job),
        env=tuple(sorted(spec["env"].items())),
        image=spec.get("image"),
        command=tuple(spec["command"]) if spec.get("command") else None,
        grace_period_s=settings.PREEMPTION_GRACE_PERIOD_S,
        resume_from_step=newest_checkpoint_step(job),
        # The shipped trainer's settings are its hyperparameters; a script's are its own, handed over as JSON.
        trainer=TrainerSettings(keep_checkpoints=TRAINER_KEEP_CHECKPOINTS, **({} if script else hyper)),
        serving=_serving_settings(job, attempt) if job.kind == Job.Kind.SERVING else None,
        workspace=_workspace_settings(job) if job.kind == Job.Kind.WORKSPACE else None,
        bundle=_bundle_ref(job, attempt),
        hyperparameters_json=json.dumps(hyper, sort_keys=True) if script else "{}",
        datasets=_dataset_mounts(job, attempt),
        restore=_checkpoint_restore(job),
        checkpoint_upload_url=checkpoint_upload.signed_upload_url(job, attempt) if job.kind == Job.Kind.TRAINING
        and checkpoint_store.store_enabled() else "",
        node_caches=node_cache_specs(replica["node"] for replica in attempt.placement),
    )


@contextlib.contextmanager
def _lease_renewed(attempt_id: int, token: str):
    """Renew the attempt's launch lease every third of its length while the block runs."""
    done = threading.Event()

    def renew() -> None:
        try:
            while not done.wait(settings.JOB_LAUNCH_LEASE_S / 3):
                JobAttempt.objects.open().filter(id=attempt_id, launch_token=token).update(
                    launch_lease_until=_lease_until()
                )
        except Exception:  # a lease that cannot be renewed runs out; the final write then says so
            logger.exception("Could not renew the launch lease of attempt %s", attempt_id)
        finally:
            connection.close()

    thread = threading.Thread(target=renew, name=f"lease-{attempt_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _claim(job_id: int, attempt_number: int, token: str) -> tuple[Job, JobAttempt] | str:
    """Take the attempt's launch lease under the job's row lock, or say why not (the state to report)."""
    with transaction.atomic():
        job = Job.objects.select_for_update(of=("self",)).select_related(
            "tenant", "environment", "flavor", "bundle"
        ).get(id=job_id)
        attempt = job.attempts.get(number=attempt_number)
        now = timezone.now()
        if attempt.ended_at is not None:
            return "ended"
        if attempt.started_at is not None:
            return job.state  # a copy of the message after the launch went through
        if _lease_live(attempt, now) and attempt.launch_token != token:
            return job.state  # another worker launches it (or a resent message is reserved for it)
        if job.state == JobState.ADMITTED:
            transition(job, JobState.LAUNCHING, f"Launching attempt {attempt_number}.")
        elif job.state != JobState.LAUNCHING:
            # Told to stop before it launched: nothing is started; the reconcile ends the attempt.
            return job.state
        JobAttempt.objects.filter(id=attempt.id).update(launch_token=token, launch_lease_until=_lease_until())
        attempt.launch_token = token
    return job, attempt


def job_launch_run(*, job_id: int, attempt_number: int, token: str | None = None) -> str:
    """Launch one admitted attempt: claim it, start it with no lock held, then record it started, or undo.

    ``token`` names this launch (the task passes its message's token, the same across its
    retries); a launch whose token no longer holds the attempt does nothing.
    """
    token = token or str(uuid.uuid4())
    claimed = _claim(job_id, attempt_number, token)
    if isinstance(claimed, str):
        return claimed
    job, attempt = claimed
    backend = get_backend()
    try:
        with _lease_renewed(attempt.id, token):
            resumed = backend.launch_job(job_launch_spec(job, attempt))
    except PermanentBackendError as exc:
        # A node lost before the launch is not the job's failure: it is requeued, like a node lost while it ran.
        outcome = AttemptOutcome.NODE_LOST if isinstance(exc, NodeLostError) else AttemptOutcome.FAILED
        attempt_end(job.id, attempt.id, outcome=outcome, reason=f"Could not launch: {exc}", token=token)
        return Job.objects.get(id=job_id).state
    where = ", ".join(sorted({replica["node"] for replica in attempt.placement}))
    detail = f"resumed from step {resumed}" if resumed else "from the start"
    with transaction.atomic():
        job = Job.objects.select_for_update(of=("self",)).get(id=job_id)
        started = JobAttempt.objects.open().filter(
            id=attempt.id, launch_token=token, started_at__isnull=True
        ).update(started_at=timezone.now(), resumed_from_step=resumed, launch_lease_until=None)
        if started and job.bundle_id is not None:
            bundles.mark_used(job.bundle)  # the bundle list says when a job last started from it
        if started and job.state == JobState.LAUNCHING:
            transition(job, JobState.RUNNING, f"Running on {where} ({detail}).")
            return JobState.RUNNING
        if started:
            # Cancelled or preempted while it launched: it runs now, so stop it with the grace period.
            transaction.on_commit(lambda: send_job_stop(job_id))
            return job.state
        ended = JobAttempt.objects.filter(id=attempt.id, ended_at__isnull=False).exists()
    if ended:
        # The attempt was ended while this launch ran (its lease ran out): what was started must go.
        logger.warning("Job %s attempt %s ended while it launched; stopping what the launch started.",
                       job_id, attempt_number)
        _kill_and_forget(job_id, attempt_number)
        return "ended"
    return job.state  # another launcher holds it now and records the start itself


def job_launch_give_up(*, job_id: int, attempt_number: int, reason: str, token: str | None = None) -> None:
    """The launch's retries are spent: the attempt fails (and is retried or the job fails by the usual rule)."""
    attempt = JobAttempt.objects.filter(job_id=job_id, number=attempt_number).first()
    if attempt is not None:
        attempt_end(job_id, attempt.id, outcome=AttemptOutcome.FAILED, reason=f"Could not launch: {reason}",
                    token=token)


def job_stop_run(*, job_id: int) -> str:
    """Tell a job's started attempt to checkpoint and stop (a preemption or a cancel committed)."""
    job = Job.objects.get(id=job_id)
    if job.state not in (JobState.PREEMPTED, JobState.CANCELLING):
        return job.state
    attempt = open_attempt(job)
    if attempt is None or attempt.started_at is None:
        return job.state  # not started: the launch's final write or the reconcile deals with it
    get_backend().stop_job(job.id, attempt.number, grace_period_s=settings.PREEMPTION_GRACE_PERIOD_S)
    return job.state


def _kill_and_forget(job_id: int, attempt_number: int) -> None:
    backend = get_backend()
    backend.kill_job(job_id, attempt_number)
    backend.forget_job(job_id, attempt_number)


# --- Preempting and stopping from the portal's side -------------------------------------


def job_preempt_locked(job: Job, reason: str, *, now=None, only_preemptible: bool = False) -> str | None:
    """Preempt a job whose row the caller holds locked (fresh from select_for_update).

    Returns "requeued" (admitted, never launched: its attempt ended here), "stopping" (it runs
    or launches: preempted with the grace period; send_job_stop after commit), or None when it
    is in no state to preempt. ``only_preemptible``: a reclaim of capacity (the cycle's victims),
    which leaves a job that is no longer preemptible (a replica promoted into its tenant's
    guarantee since the cycle read it); a node taken away preempts whatever runs on it.
    """
    now = now or timezone.now()
    if only_preemptible and not job.preemptible:
        return None
    if job.state == JobState.ADMITTED:
        # No launch is in flight: a claim moves the job to launching under this same row lock.
        if JobAttempt.objects.open().filter(job=job).update(
            ended_at=now, outcome=AttemptOutcome.PREEMPTED, reason=reason[:1000], launch_lease_until=None
        ):
            signals.ended(job.id)
        return "requeued" if transition(job, JobState.QUEUED, reason) else None
    if job.state in (JobState.LAUNCHING, JobState.RUNNING):
        deadline = now + timezone.timedelta(seconds=settings.PREEMPTION_GRACE_PERIOD_S)
        return "stopping" if transition(job, JobState.PREEMPTED, reason, stop_deadline=deadline) else None
    return None


def jobs_admit_locked(admitted: list[Job], placed: dict[int, list[dict]]) -> list[tuple[int, int]]:
    """Admit these jobs with their placements in a few statements (attempts, states, events); returns
    (job id, attempt number) of each to launch after commit.

    The rows are locked (in id order; the cycle holds them already) and read fresh: only a job still
    queued, and as preemptible as the cycle read it (the instance's ``preemptible``), is admitted, so a cancel
    or a promotion into the guarantee that committed meanwhile wins and the next cycle decides again.
    """
    if not admitted:
        return []
    locked = Job.objects.select_for_update(of=("self",)).filter(id__in=[job.id for job in admitted]).order_by("id")
    fresh = {job_id: (state, flag) for job_id, state, flag in locked.values_list("id", "state", "preemptible")}
    admitted = [job for job in admitted if fresh.get(job.id) == (JobState.QUEUED, job.preemptible)]
    numbers = dict(
        JobAttempt.objects.filter(job__in=admitted).values("job_id").annotate(top=Max("number"))
        .values_list("job_id", "top")
    )
    new_attempts, reasons, launches = [], {}, []
    for job in admitted:
        number = numbers.get(job.id, 0) + 1
        where = ", ".join(sorted({replica["node"] for replica in placed[job.id]}))
        reasons[job.id] = f"Admitted and placed on {where}."
        new_attempts.append(JobAttempt(job=job, number=number, placement=placed[job.id]))
        launches.append((job.id, number))
    rows_insert(JobAttempt, new_attempts)
    transition_locked(admitted, JobState.ADMITTED, reasons)
    return launches


def jobs_preempt_on_nodes(nodes: list[str], *, reason: str) -> set[str]:
    """Preempt every job holding an open attempt placed on these nodes; returns their workload names (job-<id>)."""
    wanted = set(nodes)
    job_ids = [
        job_id for job_id, placement in JobAttempt.objects.open().filter(
            job__state__in=JOB_HOLDING_STATES
        ).values_list("job_id", "placement")
        if {replica["node"] for replica in placement} & wanted
    ]
    names = set()
    for job_id in job_ids:
        with transaction.atomic():
            job = Job.objects.select_for_update(of=("self",)).select_related("tenant").get(id=job_id)
            before = job.state
            outcome = job_preempt_locked(job, reason)
            if outcome is not None:
                record("job.preempted", actor=SYSTEM, tenant=job.tenant, obj=job, object_repr=f"{job.name} #{job.id}",
                       before={"state": before}, after={"state": job.state, "why": reason})
            if outcome == "stopping":
                transaction.on_commit(lambda job_id=job_id: send_job_stop(job_id))
        names.add(f"job-{job_id}")
    if job_ids:
        kick_cycle()
    return names


# --- Recording progress -----------------------------------------------------------------


def _parse_time(text):
    try:
        moment = datetime.fromisoformat(text) if text else None
    except (TypeError, ValueError):
        return None
    if moment is not None and timezone.is_naive(moment):
        moment = timezone.make_aware(moment, timezone.get_current_timezone())
    return moment


def _checkpoints_pruned(job: Job) -> None:
    """The shipped trainer deletes a checkpoint when it writes the one TRAINER_KEEP_CHECKPOINTS newer: record when."""
    rows = list(Checkpoint.objects.filter(job=job).order_by("step").values_list("id", "created_at", "deleted_at"))
    for (checkpoint_id, _created, deleted), (_newer, newer_created, _) in zip(rows, rows[TRAINER_KEEP_CHECKPOINTS:]):
        if deleted is None:
            Checkpoint.objects.filter(id=checkpoint_id, deleted_at__isnull=True).update(deleted_at=newer_created)


def _checkpoint_files_gone(job: Job, backend) -> None:
    """A script's checkpoints whose files went are marked deleted, so storage stops being charged for them.

    The SDK keeps its script's newest few checkpoints and deletes the older ones as it writes a new one (and a
    script may delete its own files): the backend is asked which recorded ones are still there. A file found
    gone was deleted at the latest when the newest checkpoint was written (the SDK deletes only then), so that
    is its deleted_at (never before its own creation). A backend that keeps checkpoints where the portal does
    not read them (Kubernetes) cannot tell: nothing is marked there.
    """
    rows = list(Checkpoint.objects.filter(job=job, deleted_at__isnull=True).order_by("step")
                .values_list("id", "uri", "created_at"))
    newest = Checkpoint.objects.filter(job=job).order_by("-created_at").values_list("created_at", flat=True).first()
    namespace = job.environment.namespace
    for checkpoint_id, uri, created in rows:
        try:
            backend.job_checkpoint(job.id, namespace, uri).close()
        except CheckpointGone:
            gone_at = min(max(created, newest or created), timezone.now())
            Checkpoint.objects.filter(id=checkpoint_id, deleted_at__isnull=True).update(deleted_at=gone_at)
        except CheckpointElsewhere:
            return
        except BackendError as exc:  # read again with the next checkpoint or the attempt's end
            logger.warning("Could not check the checkpoint files of job %s: %s", job.id, exc)
            return


def progress_record(job: Job, attempt: JobAttempt, backend, *, drain: bool = False) -> int:
    """Read what the attempt wrote since the job's cursor, record metrics and checkpoints; returns bytes read."""
    total = 0
    recorded = False
    for _ in range(FINAL_PROGRESS_READS if drain else 1):
        read = backend.job_progress(job.id, attempt.number, job.progress_cursor or {})
        total += read.bytes_read
        numbers = dict(job.attempts.values_list("number", "id"))
        metrics = [
            JobMetric(
                job=job, attempt=int(record.get("attempt") or attempt.number), step=record["step"],
                loss=record.get("loss") if isinstance(record.get("loss"), (int, float)) else None,
                samples_per_s=record.get("samples_per_s") if isinstance(record.get("samples_per_s"), (int, float))
                else None,
                at=str(record.get("time", ""))[:40],
            )
            for record in read.metrics if isinstance(record.get("step"), int) and record["step"] >= 0
        ]
        JobMetric.objects.bulk_create(metrics, batch_size=2000, ignore_conflicts=True)
        checkpoints = [
            Checkpoint(
                job=job, attempt_id=numbers.get(int(record.get("attempt") or attempt.number)), step=record["step"],
                uri=str(record.get("path", ""))[:1000], bytes=int(record.get("bytes") or 0),
                created_at=_parse_time(record.get("created_at")) or timezone.now(),
                store_state="pending" if checkpoint_store.store_enabled() else "",
            )
            for record in read.checkpoints if isinstance(record.get("step"), int) and record["step"] >= 0
        ]
        Checkpoint.objects.bulk_create(checkpoints, ignore_conflicts=True)
        if checkpoints and checkpoint_store.store_enabled():
            checkpoint_store.checkpoints_store_ask(job.id)  # copied to the store in the background
        recorded = recorded or bool(checkpoints)
        if checkpoints and job.spec.get("template") == "pytorch-ddp":
            _checkpoints_pruned(job)
        _stops_recorded(job, read.stops)
        if read.datasets:
            uses_read(job_id=job.id, records=read.datasets)  # DatasetUse.read_at: which version the script read
        if attempt.first_step_at is None:
            mine = [m for m in metrics if m.attempt == attempt.number]
            if mine:
                first = _parse_time(mine[0].at) or timezone.now()
                JobAttempt.objects.filter(id=attempt.id, first_step_at__isnull=True).update(first_step_at=first)
                attempt.first_step_at = first
        if read.cursor != job.progress_cursor:
            Job.objects.filter(id=job.id).update(progress_cursor=read.cursor)
            job.progress_cursor = read.cursor
        if not read.bytes_read:
            break
    if job.spec.get("template") == "script" and (recorded or drain):
        # Looked at when a new checkpoint is recorded (the SDK deletes the old ones right after it has written
        # a new one: what that deleted is seen with the next) and once more as the attempt ends.
        _checkpoint_files_gone(job, backend)
    return total


def _stops_recorded(job: Job, stops: list[dict]) -> None:
    """Mark the attempts whose rank 0 wrote a stop record (the SDK's, once its script saw should_stop()):
    each record names its attempt; a record of an attempt this job does not have is skipped."""
    numbers = {record.get("attempt") for record in stops}
    numbers = {number for number in numbers if isinstance(number, int) and not isinstance(number, bool)}
    if numbers:
        JobAttempt.objects.filter(job=job, number__in=numbers, stop_recorded_at__isnull=True).update(
            stop_recorded_at=timezone.now()
        )


# --- Finishing an attempt ---------------------------------------------------------------


def _outcome(job: Job, attempt: JobAttempt, status) -> tuple[str, str, int | None]:
    """How an attempt that stopped running ended, judged against the job's locked row."""
    codes = status.exit_codes
    if attempt.stop_recorded_at is not None:
        # Its script checkpointed on the portal's request and exited 0 (the SDK wrote the stop record):
        # exactly what the trainer's 75 says, so it is judged as that.
        codes = {rank: EXIT_CHECKPOINTED_ON_SIGNAL if code == EXIT_OK else code for rank, code in codes.items()}
    failing = {rank: code for rank, code in codes.items() if code not in (EXIT_OK, EXIT_CHECKPOINTED_ON_SIGNAL)}
    first_failing = min(failing.items()) if failing else None
    if status.node_lost:
        return AttemptOutcome.NODE_LOST, status.reason, None
    if job.state == JobState.CANCELLING:
        return AttemptOutcome.CANCELLED, job.reason, first_failing[1] if first_failing else max(codes.values(), default=None)
    if job.kind in (Job.Kind.SERVING, Job.Kind.WORKSPACE) and job.state == JobState.PREEMPTED and not failing:
        # A server (a replica's, a workspace's JupyterLab) exits 0 once it has stopped on SIGTERM: for a
        # preempted one that is the stop it was asked for, never the end of its work.
        return AttemptOutcome.PREEMPTED, job.reason, max(codes.values(), default=None)
    if status.phase == "exited" and codes and not failing and all(code == EXIT_OK for code in codes.values()):
        return AttemptOutcome.SUCCEEDED, "Every replica finished.", EXIT_OK
    if status.phase == "preempted" and not failing:
        # The cluster stopped a replica (evicted, or refused by its node's kubelet): requeued, saying why.
        reason = job.reason if job.state == JobState.PREEMPTED else f"Preempted by the cluster: {status.reason}"
        return AttemptOutcome.PREEMPTED, reason, max(codes.values(), default=None)
    if job.state == JobState.PREEMPTED:
        # Stopped as asked: checkpointed (75), or killed after the grace period (the steps since
        # the last checkpoint are lost, the job still resumes from it).
        code = first_failing[1] if first_failing else (EXIT_CHECKPOINTED_ON_SIGNAL if codes else None)
        return AttemptOutcome.PREEMPTED, job.reason, code
    if first_failing:
        rank, code = first_failing
        return AttemptOutcome.FAILED, f"Replica {rank} exited with {code}.", code
    if status.phase == "lost":
        return AttemptOutcome.FAILED, status.reason, None
    if runtime_used_s(job) >= job.spec["max_runtime_s"] - 1:
        return AttemptOutcome.FAILED, f"Ran past max_runtime_s ({job.spec['max_runtime_s']} s).", EXIT_CHECKPOINTED_ON_SIGNAL
    return AttemptOutcome.PREEMPTED, "Stopped from outside the portal (the node was drained).", EXIT_CHECKPOINTED_ON_SIGNAL


def attempt_end(job_id: int, attempt_id: int, *, outcome: str | None = None, reason: str = "",
                exit_code: int | None = None, status=None, token: str | None = None,
                never_started: bool = False) -> bool:
    """End an open attempt and move its job on: done, cancelled, requeued, or failed. False if it was not open.

    Everything is decided under the job's row lock from what the rows say now: the outcome
    (from ``status`` when given), whether the attempt is still open, and, with ``token``, that
    the launch holding it is this one; ``never_started`` ends it only if it never started and
    no launch holds a live lease. The backend forgets the attempt after commit.
    """
    now = timezone.now()
    with transaction.atomic():
        job = Job.objects.select_for_update(of=("self",)).get(id=job_id)
        attempt = JobAttempt.objects.get(id=attempt_id)
        if status is not None:
            outcome, reason, exit_code = _outcome(job, attempt, status)
        open_rows = JobAttempt.objects.open().filter(id=attempt_id)
        if token is not None:
            open_rows = open_rows.filter(launch_token=token)
        if never_started:
            open_rows = open_rows.filter(started_at__isnull=True).filter(
                Q(launch_lease_until__isnull=True) | Q(launch_lease_until__lte=now)
            )
        if not open_rows.update(ended_at=now, outcome=outcome, reason=reason[:1000], exit_code=exit_code,
                                launch_lease_until=None):
            return False
        attempt.ended_at = now
        signals.ended(job.id)
        newest = newest_checkpoint_step(job)
        resume = f" It resumes from step {newest}." if newest else ""
        spent = runtime_used_s(job, now=now) >= job.spec["max_runtime_s"] - 1
        if job.state not in JOB_HOLDING_STATES:
            pass  # the job already moved on (a cancel of an admitted job ends its attempt itself)
        elif job.state == JobState.CANCELLING or outcome == AttemptOutcome.CANCELLED:
            if job.state == JobState.CANCELLING:
                transition(job, JobState.CANCELLED, job.reason)
            else:
                transition(job, JobState.CANCELLED, reason)
        elif outcome == AttemptOutcome.SUCCEEDED:
            # A script or an image counts no steps of the portal's: its replicas finishing is what there is to say.
            own_code = job.spec.get("template") in ("script", "custom")
            transition(job, JobState.SUCCEEDED,
                       "Every replica exited 0." if own_code else f"Finished all {job.spec['steps']} steps.")
        elif spent:
            # The budget is the job's, across attempts: once spent there is nothing to retry.
            transition(job, JobState.FAILED, f"Used up max_runtime_s ({job.spec['max_runtime_s']} s across "
                                             f"attempts): {reason}", stop_deadline=None)
        elif outcome in (AttemptOutcome.PREEMPTED, AttemptOutcome.NODE_LOST):
            transition(job, JobState.QUEUED, f"{reason}{resume}", stop_deadline=None)
        else:
            failures = job.failures + 1
            if failures > job.spec["max_retries"]:
                times = {1: "once", 2: "twice"}.get(failures, f"{failures} times")
                transition(job, JobState.FAILED, f"{reason} It failed {times} and max_retries is "
                                                 f"{job.spec['max_retries']}: fix the cause, then submit it again.",
                           failures=failures, stop_deadline=None)
            else:
                transition(job, JobState.QUEUED, f"Retrying ({failures} of {job.spec['max_retries']}) after: {reason}"
                                                 f"{resume}", failures=failures, stop_deadline=None)
        transaction.on_commit(kick_cycle)
    try:
        get_backend().forget_job(job_id, attempt.number)
    except BackendError as exc:
        # The reconcile of an ended attempt is over; a backend that could not forget it now is
        # told again by forget's idempotent callers (kill on a late launch, the next pass's jobs_open).
        logger.warning("Could not forget job %s attempt %s: %s", job_id, attempt.number, exc)
    return True
