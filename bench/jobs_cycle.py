"""How long one scheduler cycle takes on the openb cluster (1,213 nodes, 6,212 GPUs) with many jobs queued.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/portal CELERY_BROKER_URL=redis://127.0.0.1:6379/0 \\
        .venv/bin/python bench/jobs_cycle.py --queued 1000,15000 [--tenants 20] [--seed 1] [--nodes-scale 1]

For each size: a scratch PostgreSQL database (created and dropped by the bench), the openb node
list synced as the inventory (every GPU model a whole-GPU flavor), tenants with guarantees that
add up to the capacity and a max of a fifth of it, and that many queued jobs of mixed shapes
(1-4 replicas of 1, 2, 4 or 8 GPUs of one model, topology none or node, priorities 0-20),
written straight into the job table in the shape the submit service stores. Then
``runners.scheduling.services.cycle_run()`` runs on the empty cluster and again once what it admitted holds
its GPUs; the bench prints each cycle's time (in all, and under the lock: snapshot, decisions
and writes, before the launches are sent after commit), how many jobs it admitted, how many it left
waiting with a reason, and admissions per second. The launch messages go to a queue of the
bench's own that it deletes; the bench counts them there, so "launches_sent" is what reached the broker.

``--nodes-scale N`` makes the cluster N copies of the openb node list (node names suffixed with
the copy's number, so each is unique), written to a temporary CSV file that the bench points
LOCAL_CLUSTER_FILE at: 16 makes 19,408 nodes.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
OPENB_NODES = REPO / "tests" / "data" / "openb" / "openb_node_list_gpu_node.csv"
os.environ.setdefault("LOCAL_USE_NVML", "false")


def scaled_node_list(scale: int) -> Path:
    """The openb node list, or (scale > 1) that many copies of it in a temporary CSV, each node renamed
    with its copy's number (openb-node-0000-c01) so that every name is unique."""
    if scale <= 1:
        return OPENB_NODES
    with OPENB_NODES.open(newline="") as source:
        reader = csv.DictReader(source)
        fields, rows = reader.fieldnames, list(reader)
    handle = tempfile.NamedTemporaryFile("w", suffix=".csv", prefix=f"openb-x{scale}-", delete=False, newline="")
    with handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for copy in range(scale):
            for row in rows:
                writer.writerow({**row, "sn": f"{row['sn']}-c{copy:02d}"})
    return Path(handle.name)


def populate(queued: int, tenants: int, seed: int) -> None:
    from django.utils import timezone

    from quotas.models import Quota, ResourceFlavor
    from runners.clusters.models import Gpu, Node
    from runners.clusters.services import flavor_capacity_refresh, flavors_discover, inventory_sync
    from runners.environments.models import Environment, EnvironmentState
    from runners.jobs.models import Job
    from runners.jobs.services import DEFAULTS
    from tenants.models import Tenant

    inventory_sync()
    flavors_discover()
    # openb's models (P100, V100M16, G2, ...) are not in the GPU catalog, so discovery names none of
    # them; the bench makes a whole-GPU flavor per model directly.
    for model in sorted(set(Gpu.objects.values_list("model", flat=True))):
        ResourceFlavor.objects.get_or_create(kind="whole", gpu_model=model, mig_profile="",
                                             defaults={"name": f"bench-{model.lower()}"})
    flavor_capacity_refresh()
    flavors = [f for f in ResourceFlavor.objects.filter(kind="whole") if f.capacity > 0]
    most_gpus = {f.gpu_model: 0 for f in flavors}
    for node in Node.objects.prefetch_related("gpus"):
        gpus = list(node.gpus.all())
        if gpus:
            most_gpus[gpus[0].model] = max(most_gpus.get(gpus[0].model, 0), len(gpus))
    rng = random.Random(seed)
    made = []
    for index in range(tenants):
        tenant = Tenant.objects.create(slug=f"team-{index:02d}", name=f"Team {index}")
        environment = Environment.objects.create(
            tenant=tenant, name="train", namespace=f"team-{index:02d}-train", backend="local",
            state=EnvironmentState.READY,
        )
        for flavor in flavors:
            Quota.objects.create(tenant=tenant, flavor=flavor, guaranteed=flavor.capacity // tenants,
                                 max=max(1, flavor.capacity // 5), max_priority=100)
        made.append((tenant, environment))
    weights = [f.capacity for f in flavors]
    now = timezone.now()
    rows = []
    for number in range(queued):
        tenant, environment = made[number % tenants]
        flavor = rng.choices(flavors, weights)[0]
        gpus = rng.choice([g for g in (1, 2, 4, 8) if g <= most_gpus[flavor.gpu_model]])
        replicas = rng.choice([1, 1, 1, 2, 4])
        spec = {**DEFAULTS, "tenant": tenant.slug, "environment": environment.id, "name": f"job-{number}",
                "flavor": flavor.name, "replicas": replicas, "gpus_per_replica": gpus,
                "cpu_milli_per_replica": 4000, "memory_mib_per_replica": 16384,
                "topology": {"level": rng.choice(["none", "node"]), "mode": "required"},
                "priority": rng.randint(0, 20), "max_runtime_s": rng.choice([600, 3600, 14400])}
        rows.append(Job(tenant=tenant, environment=environment, name=spec["name"], spec=spec, flavor=flavor,
                        replicas=replicas, gpus_per_replica=gpus, priority=spec["priority"],
                        submitted_at=now, reason="Waiting for the scheduler."))
    Job.objects.bulk_create(rows, batch_size=2000)


def _queue_length(queue: str) -> int:
    import redis
    from django.conf import settings

    return redis.Redis.from_url(settings.CELERY_BROKER_URL).llen(queue)


def run(queued: int, tenants: int, seed: int, queue: str, nodes_scale: int) -> list[dict]:
    from django.db import connection

    from runners.jobs.models import Job
    from runners.scheduling.services import cycle_run

    creation = connection.creation
    original = connection.settings_dict["NAME"]
    name = creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        started = time.perf_counter()
        populate(queued, tenants, seed)
        print(f"queued {queued} jobs for {tenants} tenants in {time.perf_counter() - started:.1f}s ({name})",
              flush=True)
        results = []
        for label in ("empty cluster", "second cycle"):
            on_broker = _queue_length(queue)
            started = time.perf_counter()
            result = cycle_run()
            elapsed = time.perf_counter() - started
            decided = len(result["admitted"]) + len(result["waiting"])
            row = {"queued": queued, "nodes_scale": nodes_scale, "cycle": label, "seconds": round(elapsed, 3),
                   # Snapshot, decisions and writes, under the lock; the rest is sending the launches after commit.
                   "locked_s": round(result["duration_ms"] / 1000, 3), "admitted": len(result["admitted"]),
                   "waiting": len(result["waiting"]), "decided": decided,
                   "admitted_per_s": round(len(result["admitted"]) / elapsed, 1) if elapsed else None,
                   "decided_per_s": round(decided / elapsed, 1) if elapsed else None,
                   "launches_sent": _queue_length(queue) - on_broker}
            print(row, flush=True)
            results.append(row)
        held = Job.objects.filter(state="admitted").count()
        print(f"jobs holding GPUs after both cycles: {held}", flush=True)
        return results
    finally:
        creation.destroy_test_db(original, verbosity=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queued", default="1000,15000", help="comma-separated queue sizes")
    parser.add_argument("--tenants", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nodes-scale", type=int, default=1,
                        help="the openb node list replicated this many times (16: 19,408 nodes)")
    args = parser.parse_args()
    queue = f"bench-cycle-{uuid.uuid4().hex[:8]}"
    os.environ["CELERY_QUEUE"] = queue
    node_list = scaled_node_list(args.nodes_scale)
    if node_list == OPENB_NODES:
        os.environ.setdefault("LOCAL_CLUSTER_FILE", str(node_list))
    else:
        os.environ["LOCAL_CLUSTER_FILE"] = str(node_list)
    import django

    django.setup()
    from django.conf import settings

    if not settings.DATABASES["default"]["ENGINE"].endswith("postgresql"):
        print("The bench needs PostgreSQL: set DATABASE_URL.", file=sys.stderr)
        return 2
    try:
        for size in (int(part) for part in args.queued.split(",")):
            run(size, args.tenants, args.seed, queue, args.nodes_scale)
    finally:
        if node_list != OPENB_NODES:
            node_list.unlink(missing_ok=True)
        import redis

        client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
        client.delete(queue, *client.keys(f"{queue}*"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
