"""Helpers for endpoint tests: a trained checkpoint recorded for a job, and the passes that move an endpoint on."""

import time

from django.utils import timezone

from runners.clusters.registry import get_backend
from runners.inference import reconcile as endpoint_reconcile
from runners.inference.models import InferenceEndpoint
from runners.jobs import attempts, reconcile
from runners.jobs import services as jobs
from runners.jobs.models import Checkpoint, Job, JobAttempt
from runners.scheduling import services as scheduling
from tests.support.jobs import job_data


def trained_job(*, actor, environment, name="trained", seed=0, step=10) -> Job:
    """A training job of the tenant with one checkpoint recorded: the shipped model's, written by the
    trainer's own save (weights from a seed, so two seeds serve different text); the job itself is over."""
    # Imported here, not at the top: the edge tests' conftest imports this module, and torch would cost every
    # pytest process that collects them a CPU-second and a half whether it runs them or not.
    import torch

    from runners.workloads.train import CharModel, save_checkpoint

    job = jobs.job_submit(actor=actor, data=job_data(
        environment, name=name, replicas=1, topology={"level": "none"}, steps=step, checkpoint_every_steps=step))
    torch.manual_seed(seed)
    model = CharModel()
    # Where the local backend's trainer writes, recorded as the trainer records it: relative to its job folder.
    job_dir = get_backend().jobs.job_dir(job.id)
    path = save_checkpoint(job_dir, step, model, torch.optim.Adam(model.parameters()), keep=3, world_size=1, attempt=0,
                           alphabet=bytes(range(32, 127)) + b"\n")
    Checkpoint.objects.create(job=job, step=step, uri=str(path.relative_to(job_dir)), bytes=path.stat().st_size,
                              created_at=timezone.now())
    # Done training (cancelled before it ever ran): its checkpoint stays servable and it holds no GPU.
    jobs.job_cancel(actor=actor, job=job)
    job.refresh_from_db()
    return job


def worker_passes(kind: str) -> None:
    """What a worker does for jobs of one kind, once: the cycle, their launches and stops, the jobs' reconcile."""
    scheduling.cycle_run()
    for attempt in JobAttempt.objects.open().filter(started_at__isnull=True, job__kind=kind):
        attempts.job_launch_run(job_id=attempt.job_id, attempt_number=attempt.number)
    for job_id in Job.objects.filter(kind=kind, state__in=["cancelling", "preempted"]).values_list("id", flat=True):
        attempts.job_stop_run(job_id=job_id)
    reconcile.jobs_reconcile_run()


def drive(endpoint: InferenceEndpoint, until, *, timeout_s: float = 90, pause_s: float = 0.3):
    """Run the passes a worker would (endpoint reconcile, scheduler cycle, launches, job reconcile) until
    `until(endpoint)` holds; the endpoint is refreshed before each look."""
    deadline = time.monotonic() + timeout_s
    while True:
        endpoint_reconcile.endpoints_reconcile_run()
        worker_passes(Job.Kind.SERVING)
        endpoint.refresh_from_db()
        if until(endpoint):
            return endpoint
        if time.monotonic() > deadline:
            replicas = "; ".join(f"{r.id} slot {r.slot} g{r.generation} {r.job.state} ready={r.ready} "
                                 f"retiring={r.retiring} ({r.job.reason})" for r in endpoint.replicas.select_related("job"))
            raise AssertionError(f"endpoint {endpoint.name} is {endpoint.state} ({endpoint.reason}); {replicas}")
        time.sleep(pause_s)


def ready_count(endpoint: InferenceEndpoint) -> int:
    return endpoint.replicas.filter(ready=True, retiring=False).count()
