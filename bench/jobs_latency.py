"""Submission-to-running latency on the local backend: a real worker with its beat, real trainer processes.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/portal CELERY_BROKER_URL=redis://127.0.0.1:6379/0 \\
        .venv/bin/python bench/jobs_latency.py [--jobs 100] [--every-s 2.0]

A scratch database (created and dropped here) with the demo cluster, one tenant with room for
every job, and one Celery worker (`-B`, concurrency 1) with the default cycle and reconcile
intervals. Jobs of one replica and one H100, 5 small steps each, are submitted through the service
every `--every-s` seconds; the latency of each is the time from its `queued` event to its
`running` event (both written by the portal, so the clock is the database's). Prints p50, p90,
p99 and max, and the two parts: queued -> admitted (the cycle) and admitted -> running (the launch).
Jobs are spaced so that the trainers of earlier jobs (each imports torch) leave the cores and the
16 H100s mostly free: closer together, the figure measures the queue, not the portal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
SCRATCH = Path(tempfile.mkdtemp(prefix="portal-latency-"))
os.environ["LOCAL_WORKSPACE_DIR"] = str(SCRATCH / "workspaces")
os.environ["LOCAL_JOBS_DIR"] = str(SCRATCH / "jobs")
os.environ["LOCAL_USE_NVML"] = "false"
os.environ["LOCAL_PROVISION_DELAY_S"] = "0"
os.environ["CELERY_QUEUE"] = f"bench-latency-{uuid.uuid4().hex[:8]}"


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--every-s", type=float, default=2.0)
    args = parser.parse_args()
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.db import connection

    if not settings.DATABASES["default"]["ENGINE"].endswith("postgresql"):
        print("The bench needs PostgreSQL: set DATABASE_URL.", file=sys.stderr)
        return 2
    original = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    worker = None
    try:
        from runners.jobs import services as jobs
        from runners.jobs.models import Job, JobEvent
        from tenants.models import Membership, Tenant
        from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment
        from tests.support.worker import WorkerProcess

        flavors = demo_cluster_with_flavors()
        tenant = Tenant.objects.create(slug="bench", name="Bench")
        user = get_user_model().objects.create_user("bench", password="x")
        Membership.objects.create(tenant=tenant, user=user, role="owner")
        give_quota(tenant, flavors["h100-80gb"], guaranteed=16, max=16)
        environment = ready_environment(actor=user, tenant=tenant)
        worker = WorkerProcess(SCRATCH / "worker.log", beat=True).start()
        ids = []
        for number in range(args.jobs):
            job = jobs.job_submit(actor=user, data=job_data(
                environment, name=f"lat-{number}", replicas=1, gpus_per_replica=1, steps=5, checkpoint_every_steps=0,
                topology={"level": "none", "mode": "required"},
                # A small model step, so that the trainers of earlier jobs do not crowd the two cores.
                hyperparameters={"batch_size": 4, "seq_len": 16},
            ))
            ids.append(job.id)
            time.sleep(args.every_s)
        deadline = time.monotonic() + 600
        while Job.objects.filter(id__in=ids).exclude(state__in=["succeeded", "failed", "cancelled"]).exists():
            if time.monotonic() > deadline:
                print("Not every job finished within 10 minutes; see", SCRATCH / "worker.log", file=sys.stderr)
                return 1
            time.sleep(0.5)
        latencies, admission, launching = [], [], []
        for job_id in ids:
            # The first time it reached each state.
            times = dict(JobEvent.objects.filter(job_id=job_id).values_list("to_state", "at").order_by("-at"))
            latencies.append((times["running"] - times["queued"]).total_seconds())
            admission.append((times["admitted"] - times["queued"]).total_seconds())
            launching.append((times["running"] - times["admitted"]).total_seconds())
        states = dict(Job.objects.filter(id__in=ids).values_list("state").annotate(n=django.db.models.Count("id")))
        print(f"{len(ids)} jobs, one every {args.every_s}s; final states {states}")
        print(f"submission to running: p50 {percentile(latencies, 0.5) * 1000:.0f} ms, "
              f"p90 {percentile(latencies, 0.9) * 1000:.0f} ms, p99 {percentile(latencies, 0.99) * 1000:.0f} ms, "
              f"max {max(latencies) * 1000:.0f} ms, mean {statistics.mean(latencies) * 1000:.0f} ms")
        print(f"  of which queued -> admitted: p50 {percentile(admission, 0.5) * 1000:.0f} ms, "
              f"p99 {percentile(admission, 0.99) * 1000:.0f} ms; admitted -> running (the launch): "
              f"p50 {percentile(launching, 0.5) * 1000:.0f} ms, p99 {percentile(launching, 0.99) * 1000:.0f} ms")
        return 0
    finally:
        if worker is not None:
            worker.stop()
        # Job processes outlive workers by design; the bench's own must not outlive the bench.
        import signal

        for pid_file in (SCRATCH / "jobs").glob("*/attempts/*/supervisor.pid"):
            try:
                os.killpg(int(pid_file.read_text().split()[1]), signal.SIGKILL)
            except (ProcessLookupError, PermissionError, ValueError, IndexError):
                pass
        connection.creation.destroy_test_db(original, verbosity=0)
        import redis

        client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
        queue = settings.CELERY_TASK_DEFAULT_QUEUE
        client.delete(queue, *client.keys(f"{queue}*"))


if __name__ == "__main__":
    sys.exit(main())
