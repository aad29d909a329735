"""What the usage query costs for a 30-day range over 100 tenants, through the API.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/portal \\
        .venv/bin/python bench/usage_query.py [--tenants 100] [--jobs 10] [--requests 50]

A scratch database (created and dropped here) with the demo cluster, priced flavors and a cloud
reference, `--tenants` tenants with `--jobs` jobs each: every job has three attempts spread over
the 30 days (one preempted and resumed), a few checkpoints kept for days, and one job per tenant
still running. The sweep settles the ledger (timed once), then the API is asked `--requests` times
per query, as staff (every tenant, with the idle line) and as one tenant's member, and the bench
prints the median and p99 of each in this process (Django's test client runs the same middleware
and views gunicorn would), with the ledger's size.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
from bench.timing import scratch_database, timed  # noqa: E402

SCRATCH = Path(tempfile.mkdtemp(prefix="portal-usage-"))
os.environ["LOCAL_WORKSPACE_DIR"] = str(SCRATCH / "workspaces")
os.environ["LOCAL_JOBS_DIR"] = str(SCRATCH / "jobs")
os.environ["LOCAL_USE_NVML"] = "false"
os.environ["LOCAL_PROVISION_DELAY_S"] = "0"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.db import connection

    with scratch_database():
        from django.utils import timezone
        from rest_framework.test import APIClient

        from quotas.models import PriceCard
        from runners.environments.models import Environment, EnvironmentState
        from runners.jobs.models import Checkpoint, Job, JobAttempt
        from runners.usage import ledger
        from runners.usage.models import CloudPrice, UsageEntry
        from tenants.models import Membership, Tenant
        from tests.support.jobs import demo_cluster_with_flavors

        random.seed(7)
        flavors = list(demo_cluster_with_flavors().values())
        now = timezone.now()
        start = now - timedelta(days=30)
        for flavor in flavors:
            PriceCard.objects.create(flavor=flavor, price_per_hour=Decimal("1.50"), effective_from=start - timedelta(days=1))
            PriceCard.objects.create(flavor=flavor, price_per_hour=Decimal("1.75"), effective_from=start + timedelta(days=15))
            CloudPrice.objects.create(flavor=flavor, price_per_hour=Decimal("4.00"), effective_from=start - timedelta(days=1))
        staff = get_user_model().objects.create_user("staff", password="x", is_staff=True)
        member = get_user_model().objects.create_user("member", password="x")
        made = time.perf_counter()
        for t in range(args.tenants):
            tenant = Tenant.objects.create(slug=f"team-{t:03d}", name=f"Team {t}")
            if t == 0:
                Membership.objects.create(tenant=tenant, user=member, role="owner")
            environment = Environment.objects.create(tenant=tenant, name="train", namespace=f"{tenant.slug}--train",
                                                     state=EnvironmentState.READY)
            for j in range(args.jobs):
                flavor = random.choice(flavors)
                job = Job.objects.create(tenant=tenant, environment=environment, name=f"job-{j}",
                                         spec={"template": "pytorch-ddp"}, flavor=flavor, replicas=2,
                                         gpus_per_replica=1, state="running" if j == 0 else "succeeded")
                moment = start + timedelta(hours=random.uniform(0, 24 * 20))
                for number in (1, 2, 3):
                    attempt = JobAttempt.objects.create(job=job, number=number, placement=[])
                    length = timedelta(hours=random.uniform(2, 60))
                    running = j == 0 and number == 3
                    JobAttempt.objects.filter(id=attempt.id).update(
                        admitted_at=moment, started_at=moment, ended_at=None if running else min(now, moment + length)
                    )
                    moment = min(now - timedelta(hours=1), moment + length + timedelta(hours=random.uniform(0, 6)))
                for step in (1, 2, 3):
                    created = start + timedelta(hours=random.uniform(0, 24 * 28))
                    Checkpoint.objects.create(job=job, step=step * 100, uri="bench", bytes=random.randint(1, 40) * 10**9,
                                              created_at=created,
                                              deleted_at=created + timedelta(days=2) if step < 3 else None)
        print(f"made {args.tenants} tenants x {args.jobs} jobs (3 attempts, 3 checkpoints each) "
              f"in {time.perf_counter() - made:.1f} s")
        # Yesterday's midnight as the sweep's "now": today stays unwritten, as on a live cluster.
        settled = time.perf_counter()
        result = ledger.settle_run(now=now)
        print(f"settled {result['items']} items into {UsageEntry.objects.count():,} ledger entries "
              f"in {time.perf_counter() - settled:.1f} s")
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
        as_staff, as_member = APIClient(), APIClient()
        as_staff.force_authenticate(staff)
        as_member.force_authenticate(member)
        first, last = (now - timedelta(days=29)).date(), now.date()
        queries = [
            ("staff, by tenant (+ idle line)", as_staff, "group_by=tenant"),
            ("staff, by tenant and day", as_staff, "group_by=tenant,day"),
            ("staff, by flavor and day", as_staff, "group_by=flavor,day"),
            ("staff, by job, CSV", as_staff, "group_by=job&format=csv"),
            ("member, own tenant by job and day", as_member, "group_by=job,day"),
        ]
        for _label, client, query in queries:  # warm: imports, connections, plans
            client.get(f"/api/v1/usage/?start={first}&end={last}&{query}")
        print(f"{'query (30 days)':<36}{'rows':>7}{'median ms':>12}{'p99 ms':>10}")
        for label, client, query in queries:
            url = f"/api/v1/usage/?start={first}&end={last}&{query}"
            response = client.get(url)
            rows = len(response.json()) if "csv" not in query else response.content.count(b"\n") - 1
            median, p99 = timed(lambda url=url, client=client: client.get(url), args.requests)
            print(f"{label:<36}{rows:>7}{median:>12.1f}{p99:>10.1f}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
