"""Helpers for job tests: a ready environment, a quota, and a valid submission to change one field of."""

import os
import time

from quotas.models import Quota, ResourceFlavor
from runners.clusters.services import flavors_discover, inventory_sync
from runners.environments import services as environments
from runners.jobs import attempts, reconcile
from runners.scheduling import services as scheduling


def demo_cluster_with_flavors() -> dict[str, ResourceFlavor]:
    """The demo cluster synced, every kind of capacity given a flavor, capacities written."""
    inventory_sync()
    flavors_discover()
    from runners.clusters.services import flavor_capacity_refresh

    flavor_capacity_refresh()
    return {flavor.name: flavor for flavor in ResourceFlavor.objects.all()}


def ready_environment(*, actor, tenant, name="train"):
    environment = environments.environment_request(actor=actor, tenant=tenant, name=name)
    assert environments.environment_provision_run(environment_id=environment.id) == "ready"
    environment.refresh_from_db()
    return environment


def give_quota(tenant, flavor, *, guaranteed, max, max_priority=100, weight=1):
    return Quota.objects.update_or_create(
        tenant=tenant, flavor=flavor,
        defaults=dict(guaranteed=guaranteed, max=max, max_priority=max_priority, fair_share_weight=weight),
    )[0]


def job_data(environment, /, **overrides) -> dict:
    """A valid pytorch-ddp submission. Each replica declares one CPU, so the local backend runs the shipped
    trainer on one thread (OMP_NUM_THREADS follows the declared CPU): on these machines its small model is
    no slower on one thread and costs about a third less CPU per step than on two."""
    data = {
        "tenant": environment.tenant.slug, "environment": environment.id, "name": "llm-pretrain",
        "template": "pytorch-ddp", "replicas": 2, "flavor": "h100-80gb", "gpus_per_replica": 1,
        "cpu_milli_per_replica": 1000, "memory_mib_per_replica": 4096,
        "topology": {"level": "node", "mode": "required"}, "priority": 10, "preemptible": True,
        "steps": 40, "checkpoint_every_steps": 10, "max_runtime_s": 600, "max_retries": 1,
        "env": {"DATASET_SPLIT": "train"}, "image": None, "command": None,
    }
    data.update(overrides)
    return data


def submit(actor, environment, /, **overrides):
    """Submit a valid job into the environment, with some of its fields changed."""
    from runners.jobs import services as jobs

    return jobs.job_submit(actor=actor, data=job_data(environment, **overrides))


def play_launch(job):
    """Play the launcher: the admitted job is running (its open attempt started now)."""
    from runners.jobs import services as jobs
    from runners.jobs.models import JobState

    job.refresh_from_db()
    assert jobs.transition(job, JobState.LAUNCHING, "test")
    attempt = job.attempts.get(ended_at__isnull=True)
    attempt.started_at = job.state_changed_at
    attempt.save()
    assert jobs.transition(job, JobState.RUNNING, "test")
    return attempt


def admit_and_launch(job):
    """The cycle admits the job and its launch (what the job_launch task runs) starts it; its open attempt."""
    scheduling.cycle_run()
    job.refresh_from_db()
    assert job.state == "admitted", job.reason
    attempt = job.attempts.get(ended_at__isnull=True)
    assert attempts.job_launch_run(job_id=job.id, attempt_number=attempt.number) == "running"
    return attempt


def reconcile_until(job, states, *, timeout_s: float = 60, pause_s: float = 0.3):
    """Run reconcile passes until the job is in one of `states`; a requeued job gets its next cycle and launch."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reconcile.jobs_reconcile_run()
        job.refresh_from_db()
        if job.state in states:
            return job
        if job.state == "queued":
            scheduling.cycle_run()
            job.refresh_from_db()
            attempt = job.attempts.filter(ended_at__isnull=True).first()
            if attempt is not None:
                attempts.job_launch_run(job_id=job.id, attempt_number=attempt.number)
        time.sleep(pause_s)
    raise AssertionError(f"job {job.id} is {job.state}: {job.reason}")


def demo_with_jobs():
    """`manage.py demo`'s world, with a ready environment in each tenant, one job placed and one
    waiting with its reason (launches are not sent: no commit callbacks run in such a test)."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from runners.jobs import services as jobs
    from tenants.models import Tenant

    call_command("demo", stdout=open(os.devnull, "w"))
    users = get_user_model().objects
    alice, carol = users.get(username="alice"), users.get(username="carol")
    research = ready_environment(actor=alice, tenant=Tenant.objects.get(slug="ml-research"))
    ready_environment(actor=carol, tenant=Tenant.objects.get(slug="vision"), name="vision-train")
    jobs.job_submit(actor=alice, data=job_data(research, name="placed", replicas=1, topology={"level": "none"}))
    jobs.job_submit(
        actor=alice, data=job_data(research, name="waiting", replicas=2, gpus_per_replica=8, topology={"level": "none"})
    )
    scheduling.cycle_run()
    return users


def preempt(job, reason: str = "Preempted for globex's guarantee.") -> None:
    """Preempt a running job as the scheduler does (the stop asked under the job's lock), then send the stop
    the job_stop task sends after the commit."""
    from django.db import transaction

    from runners.jobs.models import Job

    with transaction.atomic():
        locked = Job.objects.select_for_update().get(id=job.id)
        assert attempts.job_preempt_locked(locked, reason) == "stopping"
    attempts.job_stop_run(job_id=job.id)


def script_bundle(tenant, owner, folder, script: str):
    """A project folder whose train.py is `script`, packed as the CLI packs it and stored as an upload is: the
    bundle row."""
    from gpuportal import bundle as packing

    from runners.bundles import services as bundles

    (folder / "project").mkdir()
    (folder / "project" / "train.py").write_text(script)
    archive = folder / "project.tar.gz"
    archive.write_bytes(packing.pack(folder / "project"))
    with archive.open("rb") as upload:
        return bundles.store(tenant, owner, upload)[0]


def script_job_launched(actor, environment, bundle, *, name: str, steps: int):
    """A one-rank script job running `python train.py` of the bundle for `steps` steps of 0.1 s, in the sandbox,
    admitted and launched."""
    from runners.jobs import services as jobs

    job = jobs.job_submit(actor=actor, data=job_data(
        environment, name=name, template="script", bundle=bundle.sha256, command=["python", "train.py"],
        hyperparameters={"steps": steps, "pause_s": 0.1}, replicas=1, topology={"level": "none", "mode": "preferred"},
        memory_mib_per_replica=2048, max_runtime_s=600, max_retries=0, env={}))
    admit_and_launch(job)
    return job


def preempted_after_step(job, step: int = 3):
    """Reconcile the running job until it reported `step`, preempt it, and reconcile it until it is queued again
    (its log's tail when it never reports the step): the job, read again."""
    from runners.clusters.registry import get_backend
    from tests.support.races import wait_until

    def stepped():
        reconcile.jobs_reconcile_run()
        return job.metrics.filter(step__gte=step).exists()

    assert wait_until(stepped, timeout_s=120), get_backend().job_logs(job.id, 1, 0, tail=50)
    preempt(job)
    return reconcile_until(job, {"queued"}, timeout_s=60, pause_s=0.2)


def script_job_with_checkpoint(owner, environment, what, *, bundle: str, step: int = 10):
    """A cancelled script job of the tenant (of the bundle with that sha256) with one checkpoint: `what`, as its
    SDK's ctx.checkpoint(step, what) saves it (a state, or a folder)."""
    from django.utils import timezone
    from gpuportal import write_checkpoint

    from runners.clusters.registry import get_backend
    from runners.jobs import services as jobs
    from runners.jobs.models import Checkpoint

    job = jobs.job_submit(actor=owner, data=job_data(environment, name=f"script-{step}", template="script",
                                                     bundle=bundle, command=["python", "train.py"],
                                                     hyperparameters={}, replicas=1, topology={"level": "none"}))
    job_dir = get_backend().jobs.job_dir(job.id)
    path = write_checkpoint(job_dir, step, what, attempt=1)
    Checkpoint.objects.create(job=job, step=step, uri=str(path.relative_to(job_dir)), bytes=0,
                              created_at=timezone.now())
    jobs.job_cancel(actor=owner, job=job)
    return job
