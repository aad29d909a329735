"""The REST API under load: gunicorn, PostgreSQL and a real worker, a team's automation mix, p50 / p99 per endpoint.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/portal CELERY_BROKER_URL=redis://127.0.0.1:6379/7 \\
        .venv/bin/python bench/api_load.py [--clients 32] [--duration 60] [--workers 4] [--threads 8] \\
        [--think-ms 100] [--tenants 8] [--jobs-per-tenant 300]

A scratch PostgreSQL database (`--database`, dropped and made again, migrated, dropped at the end)
seeded at a team's scale: `--tenants` tenants on the demo cluster, each with three ready
environments, a quota on the H100s, `--jobs-per-tenant` finished jobs of the past month (succeeded,
failed, cancelled; each with its events, an attempt and checkpoints, as the API nests them) and
`--clients` / `--tenants` members with an API token each. The portal runs as gunicorn
(`.venv/bin/python -m gunicorn portal.wsgi`, `-c python:portal.gunicorn_conf` when that module exists,
`--workers` x `--threads`, gthread) with DEBUG off, its cache in Redis as in production, logging at
`--log-level` (WARNING: no access line a request); one Celery worker with its beat runs the scheduler
cycle and the reconcile on `tests.support.backends.QuickJobs` (timers in place of trainers), so a
submit's queued job is admitted and launched for real.

`--clients` threads, one per member, each on a keep-alive connection of its own, make requests for
`--duration` seconds with an exponential pause of mean `--think-ms` between them (0: back to back, a
saturation test). The mix, by weight: list the tenant's jobs (half with a state filter) 25, read a
job 25, list environments 10, read an environment 10, list quotas 10, list tenants 5, submit a job
(one replica, one H100, long enough not to finish) 8, cancel the oldest job this client submitted and
has not cancelled yet 7 (a submit when it has none). An error is a connection error or an answer
other than the one expected (200; 201 for a submit, 202 for a cancel). Prints per endpoint the
count, p50, p99, max and errors (with their statuses), the throughput, and the CPU time gunicorn's
processes (and the worker's, and the bench's own) used while measured: per request, the figure that
other work on the machine disturbs least. Figures also go to `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MIX = {
    "GET /jobs/": 25, "GET /jobs/{id}/": 25, "GET /environments/": 10, "GET /environments/{id}/": 10,
    "GET /quotas/": 10, "GET /tenants/": 5, "POST /jobs/": 8, "POST /jobs/{id}/cancel/": 7,
}
EXPECTED = {"POST /jobs/": 201, "POST /jobs/{id}/cancel/": 202}
FINAL_STATES_MIX = [("succeeded", 0.65), ("failed", 0.15), ("cancelled", 0.20)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--workers", type=int, default=4, help="gunicorn worker processes")
    parser.add_argument("--threads", type=int, default=8, help="threads per gunicorn worker (gthread)")
    parser.add_argument("--think-ms", type=float, default=100.0,
                        help="mean pause between a client's requests (exponential); 0: none")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--jobs-per-tenant", type=int, default=300, help="finished jobs seeded per tenant")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the measured part")
    parser.add_argument("--database", default="portal_bench_api", help="the scratch database (dropped first)")
    parser.add_argument("--no-worker", action="store_true", help="no Celery worker: submits stay queued")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="the portal's LOG_LEVEL; INFO writes an access line a request (to the scratch folder)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=Path(tempfile.gettempdir()) / "api_load.json")
    return parser.parse_args()


ARGS = parse_args()
SCRATCH = Path(tempfile.mkdtemp(prefix="portal-api-load-"))
RUN = uuid.uuid4().hex[:8]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
os.environ.update(
    TEST_DATABASE_NAME=ARGS.database, CELERY_QUEUE=f"bench-api-{RUN}",
    LOCAL_WORKSPACE_DIR=str(SCRATCH / "workspaces"), LOCAL_JOBS_DIR=str(SCRATCH / "jobs"), LOCAL_USE_NVML="false",
    LOCAL_PROVISION_DELAY_S="0", CLUSTER_BACKEND_FACTORY="tests.support.backends.quick_jobs",
)


def percentile(ordered: list[float], fraction: float) -> float:
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))] if ordered else float("nan")


def cpu_seconds(group: int) -> float:
    """CPU time (user + system) of the processes of a process group: the portal's gunicorn, the worker."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:  # pgrp; then utime and stime, in clock ticks
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- the world ------------------------------------------------------------------------------------


def seed(rng: random.Random) -> list[dict]:
    """Tenants, members with tokens, environments, quotas and finished jobs; one dict per client."""
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.utils import timezone

    from runners.jobs.models import Checkpoint, Job, JobAttempt, JobEvent
    from tenants import services as tenant_services
    from tenants.models import Membership, Tenant
    from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment

    flavors = demo_cluster_with_flavors()
    h100 = flavors["h100-80gb"]
    users = get_user_model().objects
    clients = []
    now = timezone.now()
    for t in range(ARGS.tenants):
        tenant = Tenant.objects.create(slug=f"team-{t}", name=f"Team {t}")
        give_quota(tenant, h100, guaranteed=max(1, h100.capacity // ARGS.tenants), max=h100.capacity)
        members = []
        for m in range(-(-ARGS.clients // ARGS.tenants)):
            user = users.create_user(f"team-{t}-bot-{m}", password=secrets.token_urlsafe(12))
            Membership.objects.create(tenant=tenant, user=user, role="owner" if m == 0 else "member")
            members.append(user)
        environments = [ready_environment(actor=members[0], tenant=tenant, name=name)
                        for name in ("train", "eval", "sweep")]
        jobs = []
        for n in range(ARGS.jobs_per_tenant):
            state = rng.choices([s for s, _ in FINAL_STATES_MIX], [w for _, w in FINAL_STATES_MIX])[0]
            environment = rng.choice(environments)
            spec = job_data(environment, name=f"run-{n}", replicas=rng.choice([1, 1, 2, 4]), topology={"level": "none"})
            jobs.append(Job(
                tenant=tenant, environment=environment, name=spec["name"], spec=spec, flavor=h100,
                replicas=spec["replicas"], gpus_per_replica=1, priority=spec["priority"], state=state,
                reason={"succeeded": "Exited 0.", "failed": "Exited 1 on rank 0.", "cancelled": "Cancelled."}[state],
                submitted_by=rng.choice(members), started_at=now, finished_at=now,
            ))
        Job.objects.bulk_create(jobs, batch_size=1000)
        attempts, events, checkpoints = [], [], []
        for job in jobs:
            path = ["queued", "admitted", "launching", "running", job.state]
            events.extend(JobEvent(job=job, from_state=a if i else "", to_state=b, reason=f"{a} -> {b}")
                          for i, (a, b) in enumerate(zip(["", *path], path)))
            attempts.append(JobAttempt(
                job=job, number=1, started_at=now, ended_at=now, outcome=job.state if job.state != "succeeded"
                else "succeeded", exit_code=0 if job.state == "succeeded" else 1,
                placement=[{"replica": r, "node": f"gpu-node-{r}", "gpus": [r]} for r in range(job.replicas)],
            ))
            checkpoints.extend(Checkpoint(job=job, step=step, uri=f"file:///ckpt/{job.id}/{step}", bytes=2**20,
                                          created_at=now) for step in (10, 20, 30)[:rng.randint(0, 3)])
        JobAttempt.objects.bulk_create(attempts, batch_size=1000)
        JobEvent.objects.bulk_create(events, batch_size=2000)
        Checkpoint.objects.bulk_create(checkpoints, batch_size=2000)
        job_ids = [job.id for job in jobs]
        for user in members:
            _, token = tenant_services.token_create(user=user, name="automation")
            clients.append({"tenant": tenant.slug, "token": token, "user": user.username, "jobs": job_ids,
                            "environments": [e.id for e in environments], "submit_into": environments[0].id})
    # A month of history, not every job submitted this second.
    with connection.cursor() as cursor:
        cursor.execute("UPDATE runners_job SET submitted_at = now() - random() * interval '30 days'")
        cursor.execute("UPDATE runners_job SET state_changed_at = submitted_at + interval '1 hour', "
                       "started_at = submitted_at + interval '5 minutes', finished_at = submitted_at + interval '1 hour'")
        cursor.execute("ANALYZE")
    return clients[:ARGS.clients]


# --- the portal -----------------------------------------------------------------------------------


def start_portal(port: int, log_path: Path) -> subprocess.Popen:
    from django.conf import settings

    from tests.support.worker import worker_environment

    env = worker_environment(
        DEBUG="false", SECRET_KEY=secrets.token_urlsafe(50), ALLOWED_HOSTS="127.0.0.1",
        SECURE_SSL_REDIRECT="false", CACHE_URL=settings.CELERY_BROKER_URL, LOG_LEVEL=ARGS.log_level,
    )
    command = [sys.executable, "-m", "gunicorn", "portal.wsgi", "-b", f"127.0.0.1:{port}",
               "--workers", str(ARGS.workers), "--threads", str(ARGS.threads), "--worker-class", "gthread"]
    if (REPO / "portal" / "gunicorn_conf.py").exists():
        command[3:3] = ["-c", "python:portal.gunicorn_conf"]
    log = open(log_path, "ab")
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    import requests

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"gunicorn exited; see {log_path}:\n{log_path.read_text()[-3000:]}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return process
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"gunicorn did not answer /healthz within 60 s; see {log_path}")


def stop(process: subprocess.Popen | None) -> None:
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


# --- the load -------------------------------------------------------------------------------------


class Client(threading.Thread):
    def __init__(self, number: int, world: dict, base: str, start_at: float, measure_from: float, stop_at: float):
        super().__init__(daemon=True)
        import requests

        self.number, self.world, self.base = number, world, base
        self.start_at, self.measure_from, self.stop_at = start_at, measure_from, stop_at
        self.rng = random.Random(ARGS.seed * 1000 + number)
        self.session = requests.Session()
        self.session.headers.update({"Authorization": f"Token {world['token']}", "Accept": "application/json"})
        self.pending: list[int] = []  # jobs this client submitted and has not cancelled yet
        self.submitted = 0
        self.took: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, Counter] = defaultdict(Counter)

    def request(self, name: str, method: str, path: str, body: dict | None = None):
        began, start = time.monotonic(), time.perf_counter()
        try:
            response = self.session.request(method, self.base + path, json=body, timeout=30)
            status, ok = response.status_code, response.status_code == EXPECTED.get(name, 200)
        except Exception as error:  # noqa: BLE001 - any failure to get an answer is an error of the bench
            response, status, ok = None, error.__class__.__name__, False
        took = (time.perf_counter() - start) * 1000
        if began >= self.measure_from:
            self.took[name].append(took)
            if not ok:
                self.errors[name][status] += 1
        return response if ok else None

    def submit(self):
        self.submitted += 1
        body = {"tenant": self.world["tenant"], "environment": self.world["submit_into"],
                "name": f"bot-{self.number}-{self.submitted}", "flavor": "h100-80gb", "replicas": 1,
                "gpus_per_replica": 1, "topology": {"level": "none"}, "steps": 100_000,
                "checkpoint_every_steps": 0, "max_runtime_s": 3600, "max_retries": 0}
        response = self.request("POST /jobs/", "POST", "/api/v1/jobs/", body)
        if response is not None:
            self.pending.append(response.json()["id"])

    def one(self):
        name = self.rng.choices(list(MIX), list(MIX.values()))[0]
        world, rng = self.world, self.rng
        if name == "GET /jobs/":
            query = f"?tenant={world['tenant']}" + (f"&state={rng.choice(['succeeded', 'failed', 'cancelled'])}"
                                                    if rng.random() < 0.5 else "")
            self.request(name, "GET", f"/api/v1/jobs/{query}")
        elif name == "GET /jobs/{id}/":
            self.request(name, "GET", f"/api/v1/jobs/{rng.choice(world['jobs'] + self.pending)}/")
        elif name == "GET /environments/":
            self.request(name, "GET", "/api/v1/environments/")
        elif name == "GET /environments/{id}/":
            self.request(name, "GET", f"/api/v1/environments/{rng.choice(world['environments'])}/")
        elif name == "GET /quotas/":
            self.request(name, "GET", "/api/v1/quotas/")
        elif name == "GET /tenants/":
            self.request(name, "GET", "/api/v1/tenants/")
        elif name == "POST /jobs/" or not self.pending:
            self.submit()
        else:
            self.request(name, "POST", f"/api/v1/jobs/{self.pending.pop(0)}/cancel/")

    def run(self):
        time.sleep(max(0.0, self.start_at - time.monotonic()))
        while time.monotonic() < self.stop_at:
            self.one()
            if ARGS.think_ms > 0:
                time.sleep(self.rng.expovariate(1000 / ARGS.think_ms))
        # What is left running is cancelled, so the worker's cluster ends empty.
        for job_id in self.pending:
            try:
                self.session.post(f"{self.base}/api/v1/jobs/{job_id}/cancel/", timeout=30)
            except Exception:  # noqa: BLE001 - the database is dropped anyway
                pass


def drive(worlds: list[dict], port: int, groups: dict[str, int]) -> tuple[list[Client], dict[str, float]]:
    """Run the clients; (them, CPU seconds each process group used while they were measured)."""
    base = f"http://127.0.0.1:{port}"
    start_at = time.monotonic() + 1.0
    measure_from = start_at + ARGS.warmup
    stop_at = measure_from + ARGS.duration
    clients = [Client(i, world, base, start_at + i * 0.02, measure_from, stop_at) for i, world in enumerate(worlds)]
    for client in clients:
        client.start()
    time.sleep(max(0.0, measure_from - time.monotonic()))
    before = {name: cpu_seconds(group) for name, group in groups.items()}
    before["bench"] = time.process_time()
    time.sleep(max(0.0, stop_at - time.monotonic()))
    used = {name: cpu_seconds(group) - before[name] for name, group in groups.items()}
    used["bench"] = time.process_time() - before["bench"]
    for client in clients:
        client.join()
    return clients, used


def report(clients: list[Client], seconds: float, cpu: dict[str, float]) -> dict:
    rows = {}
    for name in MIX:
        took = sorted(t for client in clients for t in client.took.get(name, []))
        errors = Counter()
        for client in clients:
            errors.update(client.errors.get(name, Counter()))
        rows[name] = {"count": len(took), "p50_ms": percentile(took, 0.5), "p99_ms": percentile(took, 0.99),
                      "max_ms": took[-1] if took else float("nan"), "errors": sum(errors.values()),
                      "statuses": {str(k): v for k, v in errors.items()}}
    total = sum(row["count"] for row in rows.values())
    print(f"\n{len(clients)} clients, {seconds:.0f} s measured (after {ARGS.warmup:.0f} s of warm-up), think "
          f"{ARGS.think_ms:g} ms; gunicorn {ARGS.workers} workers x {ARGS.threads} threads; {total} requests, "
          f"{total / seconds:.1f}/s")
    # CPU per request does not depend on what else runs on the machine as much as latency does.
    print(f"CPU while measured: portal {cpu['portal']:.1f} s ({cpu['portal'] * 1000 / max(total, 1):.1f} ms a request), "
          f"worker {cpu.get('worker', 0):.1f} s, load generator {cpu['bench']:.1f} s; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}\n")
    print("| endpoint | count | p50 ms | p99 ms | max ms | errors |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        statuses = ", ".join(f"{k}: {v}" for k, v in row["statuses"].items())
        print(f"| {name} | {row['count']} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {row['max_ms']:.1f} | "
              f"{row['errors']}{f' ({statuses})' if statuses else ''} |")
    return {"clients": len(clients), "seconds": seconds, "think_ms": ARGS.think_ms, "workers": ARGS.workers,
            "threads": ARGS.threads, "requests": total, "per_s": total / seconds, "cpu_s": cpu,
            "cpu_ms_per_request": cpu["portal"] * 1000 / max(total, 1), "endpoints": rows}


def main() -> int:
    import django

    django.setup()
    from django.conf import settings
    from django.db import connection

    from bench.timing import needs_postgres_and_redis
    from tests.support.worker import WorkerProcess

    if missing := needs_postgres_and_redis():
        print(missing, file=sys.stderr)
        return 2
    original = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    worker = portal = None
    try:
        started = time.monotonic()
        worlds = seed(random.Random(ARGS.seed))
        print(f"seeded {ARGS.tenants} tenants, {len(worlds)} members with tokens, "
              f"{ARGS.tenants * ARGS.jobs_per_tenant} jobs in {time.monotonic() - started:.1f} s", flush=True)
        connection.close()  # the portal's and the worker's connections only, while the load runs
        if not ARGS.no_worker:
            worker = WorkerProcess(SCRATCH / "worker.log", beat=True).start()
        port = free_port()
        portal = start_portal(port, SCRATCH / "gunicorn.log")
        print(f"gunicorn on 127.0.0.1:{port}; logs in {SCRATCH}", flush=True)
        groups = {"portal": portal.pid, **({"worker": worker.process.pid} if worker else {})}
        clients, cpu = drive(worlds, port, groups)
        figures = report(clients, ARGS.duration, cpu)
        ARGS.json.write_text(json.dumps(figures, indent=1))
        print(f"\nfigures in {ARGS.json}")
        return 0 if all(row["errors"] == 0 for row in figures["endpoints"].values()) else 1
    finally:
        stop(portal)
        if worker is not None:
            worker.stop()
        connection.close()
        connection.creation.destroy_test_db(original, verbosity=0)
        import redis

        client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
        queue = settings.CELERY_TASK_DEFAULT_QUEUE
        client.delete(queue, *client.keys(f"{queue}*"))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))
    sys.exit(main())
