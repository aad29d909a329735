"""The job path under chaos for as long as asked: the driver of tests/jobs/test_job_chaos.py, longer.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/portal CELERY_BROKER_URL=redis://127.0.0.1:6379/0 \\
        .venv/bin/python bench/jobs_chaos.py [--seconds 300] [--seed 1] [--max-delay-ms 40] [--no-worker-kills] \\
        [--kubernetes]

A scratch database (created and dropped here) with the demo cluster, four tenants with guarantees
and room to borrow over whole, MIG and time-sliced flavors, and two Celery workers (the first with
beat) on `tests.support.chaos.ChaosQuickJobs` (jobs are timers; every backend call sleeps a random
0..--max-delay-ms ms). For --seconds it submits, cancels, deletes environments, loses nodes (they
come back), redelivers launch and stop messages, runs cycles and reconcile passes of its own and
SIGKILLs a worker now and then; `tests.support.invariants.check` runs every half second. With
--kubernetes the backend is the Kubernetes one (`ChaosKubernetes`) against the API stand-in
(tests/support/k8s_standin.py) started here, two 8-H100 nodes; the bench plays the trainers. Then it
cancels what is left, waits for every job to end and checks once more. Prints how many operations
of each kind and how many checks it ran, and every violation; exits 1 on a violation.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
SCRATCH = Path(tempfile.mkdtemp(prefix="portal-chaos-"))
os.environ["LOCAL_WORKSPACE_DIR"] = str(SCRATCH / "workspaces")
os.environ["LOCAL_JOBS_DIR"] = str(SCRATCH / "jobs")
os.environ["LOCAL_USE_NVML"] = "false"
os.environ["LOCAL_PROVISION_DELAY_S"] = "0"
os.environ["CELERY_QUEUE"] = f"bench-chaos-{uuid.uuid4().hex[:8]}"
GRACE_PERIOD_S = 3


def _stand_in():
    """The Kubernetes API stand-in with two H100 nodes, and a kubeconfig for it; settings point at it."""
    import yaml

    from tests.support.k8s import gpu_node
    from tests.support.k8s_standin import KubernetesStandIn

    api = KubernetesStandIn(termination_delay_s=0.1, operator_delay_s=0.05).start()
    for node in ("gpu-a", "gpu-b"):
        api.put(gpu_node(node))
    kubeconfig = SCRATCH / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "standin",
        "clusters": [{"name": "standin", "cluster": {"server": api.url}}],
        "users": [{"name": "portal", "user": {"token": "standin-token"}}],
        "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "portal"}}],
    }))
    os.environ.update(CLUSTER_BACKEND="kubernetes", KUBECONFIG=str(kubeconfig),
                      CLUSTER_BACKEND_FACTORY="tests.support.chaos.chaos_kubernetes")
    return api


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-delay-ms", type=float, default=40)
    parser.add_argument("--no-worker-kills", action="store_true")
    parser.add_argument("--kubernetes", action="store_true", help="the Kubernetes backend against the API stand-in")
    args = parser.parse_args()
    os.environ["PREEMPTION_GRACE_PERIOD_S"] = str(GRACE_PERIOD_S)
    os.environ["CLUSTER_BACKEND_FACTORY"] = "tests.support.chaos.chaos_quick_jobs"
    api = _stand_in() if args.kubernetes else None
    import django

    django.setup()
    from tests.support.chaos import ChaosSettings

    config = ChaosSettings(seed=args.seed, max_delay_ms=args.max_delay_ms, grace_period_s=GRACE_PERIOD_S)
    from django.conf import settings
    from django.db import connection

    if not settings.DATABASES["default"]["ENGINE"].endswith("postgresql"):
        print("The bench needs PostgreSQL: set DATABASE_URL.", file=sys.stderr)
        return 2
    original = connection.settings_dict["NAME"]
    connection.settings_dict.setdefault("TEST", {})["NAME"] = f"bench_chaos_{uuid.uuid4().hex[:8]}"
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    workers = None
    try:
        from tests.support.chaos import ChaosRun, LocalCluster, StandInCluster, Workers

        cluster = StandInCluster(api, config.step_s) if api is not None else LocalCluster()
        workers = Workers(config, SCRATCH, factory=cluster.factory)
        run = ChaosRun(config, cluster=cluster, workers=None if args.no_worker_kills else workers)
        run.setup()
        workers.start()
        started = time.monotonic()
        run.run(args.seconds)
        summary = run.drain(timeout_s=180)
        elapsed = time.monotonic() - started
        operations = {key: value for key, value in summary.items()
                      if not key.startswith(("attempt", "job_", "checks", "preempted_for"))}
        print(f"{'Kubernetes stand-in' if api else 'local QuickJobs'}, seed {args.seed}, {args.seconds:.0f}s of chaos "
              f"({elapsed:.0f}s with the drain), delays 0-{args.max_delay_ms:.0f} ms")
        print(f"operations: {operations}")
        print(f"jobs: { {k[4:]: v for k, v in summary.items() if k.startswith('job_')} }; attempts "
              f"{ {k[8:]: v for k, v in summary.items() if k.startswith('attempt_')} }; preempted for a guarantee "
              f"{summary['preempted_for_guarantee']}")
        print(f"failed attempts, by reason: {dict(run.failure_reasons.most_common(5))}")
        print(f"checks: {summary['checks']}; violations: {len(run.violations)}")
        for violation in run.violations:
            print(f"  {violation}")
        if run.violations:
            print(f"worker logs: {SCRATCH}")
        return 1 if run.violations else 0
    finally:
        if workers is not None:
            workers.stop()
        if api is not None:
            api.stop()
        connection.creation.destroy_test_db(original, verbosity=0)
        import redis

        client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
        queue = settings.CELERY_TASK_DEFAULT_QUEUE
        client.delete(queue, *client.keys(f"{queue}*"))


if __name__ == "__main__":
    sys.exit(main())
