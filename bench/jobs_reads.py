"""What the job page, its live fragment and the metrics endpoint cost at step 10 and at step 1,000,000.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/portal \\
        .venv/bin/python bench/jobs_reads.py [--steps 1000000] [--requests 200]

A scratch database (created and dropped here) with the demo cluster and three jobs: with 10, 5,000
and `--steps` recorded steps (past the chart's 400 and the API's 1,000 points, only history grows). Each view is asked `--requests` times in this process (the
"web process": Django's test client runs the same middleware and views gunicorn would) and the
bench prints the median and p99 time of each, and this process's resident memory before and after
the requests, so a read that loads the whole history shows as time and as memory that stays.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
from bench.timing import scratch_database, timed  # noqa: E402

SCRATCH = Path(tempfile.mkdtemp(prefix="portal-reads-"))
os.environ["LOCAL_WORKSPACE_DIR"] = str(SCRATCH / "workspaces")
os.environ["LOCAL_JOBS_DIR"] = str(SCRATCH / "jobs")
os.environ["LOCAL_USE_NVML"] = "false"
os.environ["LOCAL_PROVISION_DELAY_S"] = "0"


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.db import connection

    with scratch_database():
        from django.test import Client
        from rest_framework.test import APIClient

        from runners.jobs import services as jobs
        from runners.jobs.models import JobMetric
        from tenants.models import Membership, Tenant
        from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment

        flavors = demo_cluster_with_flavors()
        tenant = Tenant.objects.create(slug="bench", name="Bench")
        user = get_user_model().objects.create_user("bench", password="x")
        Membership.objects.create(tenant=tenant, user=user, role="owner")
        give_quota(tenant, flavors["h100-80gb"], guaranteed=16, max=16)
        environment = ready_environment(actor=user, tenant=tenant)
        sizes = (10, 5_000, args.steps)
        made = [(jobs.job_submit(actor=user, data=job_data(environment, name=f"steps-{n}")), n) for n in sizes]
        short = made[0][0]
        started = time.perf_counter()
        table = JobMetric._meta.db_table
        with connection.cursor() as cursor:
            for job, steps in made:
                cursor.execute(
                    f"INSERT INTO {table} (job_id, attempt, step, loss, samples_per_s, at) "
                    f"SELECT %s, 1, s, 3.0 / s, 1000.0, '2026-12-03T10:00:00+00:00' FROM generate_series(1, %s) AS s",
                    [job.id, steps],
                )
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE runners_jobmetric")
        print(f"recorded {', '.join(f'{n:,}' for n in sizes)} steps in {time.perf_counter() - started:.1f} s")
        page, api = Client(), APIClient()
        page.force_login(user)
        api.force_authenticate(user)
        for _ in range(5):  # warm: imports, templates, connections
            page.get(f"/jobs/{short.id}/")
            api.get(f"/api/v1/jobs/{short.id}/metrics/")
        before = rss_mib()
        print(f"{'view':<28}{'steps':>12}{'median ms':>12}{'p99 ms':>10}")
        for label, url, client in (
            ("job page", "/jobs/{id}/", page),
            ("live fragment", "/jobs/{id}/live/", page),
            ("metrics API (1000 points)", "/api/v1/jobs/{id}/metrics/", api),
        ):
            for job, steps in made:
                median, p99 = timed(lambda url=url, job=job, client=client: client.get(url.format(id=job.id)),
                                    args.requests)
                print(f"{label:<28}{steps:>12,}{median:>12.1f}{p99:>10.1f}")
        after = rss_mib()
        print(f"resident memory of this process: {before:.0f} MiB before the requests, {after:.0f} MiB after "
              f"{3 * len(sizes) * args.requests} requests")
        return 0


if __name__ == "__main__":
    sys.exit(main())
