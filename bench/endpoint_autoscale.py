"""Inference endpoints under a load step: the autoscaler's control loop, warm pools and scale to zero.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/portal CELERY_BROKER_URL=redis://127.0.0.1:6379/6 \\
        .venv/bin/python bench/endpoint_autoscale.py [--scale-in-after-s 20] [--idle-after-s 5] \\
        [--low 0.5 --low-s 40 --high 3 --high-s 60] [--repeats 3] [--capacity N] [--seed 1]

Everything real on the local backend: a scratch PostgreSQL database (created and dropped here)
with the demo cluster and one tenant (16 H100s guaranteed), one Celery worker with its beat
(concurrency 1; the endpoints reconcile, the scheduler cycle and the jobs reconcile every second),
the portal as an HTTP server subprocess on a loopback port, and each replica a serving job running
the shipped server (`runners/workloads/serve.py`) on a checkpoint recorded for a training job
(`tests.support.endpoints.trained_job`). Every request goes through the router,
`POST /serve/<tenant>/<endpoint>/v1/generate`, with an API token.

The portal's server is Django's own WSGI server on a fixed pool of `--portal-threads` (32)
threads, DEBUG off (`python bench/endpoint_autoscale.py --as-portal PORT THREADS`, what gunicorn's
gthread worker would do; gunicorn is not installed here). `manage.py runserver` starts a thread,
and so a database connection, per request in flight: under the 3x step that ran PostgreSQL (shared
with other runs) out of connections.

Requests: a prompt of `--prompt-bytes` (20-60) random printable bytes, `--max-tokens` (128-192)
tokens asked, deadline `--deadline-ms` (1,000 ms) in the body; Poisson arrivals (open loop: each
request is sent at its time whatever the earlier ones are doing); a client gives up 10 s past the
deadline. The endpoints' `batch_token_budget` is `--batch-token-budget` (256): about one request
decodes at a time, so that one replica (about 40 requests/s alone), not the router (about 100
short requests/s in one Python process on this machine), is what saturates first.

1. Capacity of one replica through the router: the endpoint held at max_replicas 1, an open-loop
   ramp from `--ramp-from` (10) requests/s up by x1.5 every 5 s (2 s apart) until goodput falls
   under 80 % of what was sent; the capacity is the highest goodput (answered within the
   deadline, per second) of any level.
2. The step: the same endpoint with min 1, max 4, warm 0: `--low` x capacity for `--low-s`, then
   `--high` x capacity for `--high-s`, then nothing. Reported: the scale events in order with their
   times from the step, when the new replicas were ready (`Replica.ready_since`), the time from the
   load's end to the scale-in, per phase p50 / p99 latency of the answered, goodput, shed, expired,
   late and unanswered, what the refused got, and a 5 s timeline of offered load, goodput, wanted
   and ready replicas, in flight and refused at the replicas (the endpoint's samples).
3. Warm against cold: an endpoint with min 0, max 1, warm 0 left idle until it has scaled to zero,
   and one with min 0, max 2, warm 1 (kept at one ready replica when idle); one request to each
   (the cold one first, so that the warm endpoint's scale-out after its request overlaps nothing),
   `--repeats` times; the time to the first answer, and for the cold start its parts from the
   database: request -> scale-out event -> replica job running -> replica ready.

All processes started here (worker, portal, replicas) are stopped and the database dropped at the
end, on error and on SIGTERM too. Figures also go to `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale-in-after-s", type=float, default=20.0, help="ENDPOINT_SCALE_IN_AFTER_S")
    parser.add_argument("--idle-after-s", type=float, default=5.0, help="ENDPOINT_IDLE_AFTER_S")
    parser.add_argument("--target-inflight", type=float, default=8.0, help="ENDPOINT_TARGET_INFLIGHT (the default)")
    parser.add_argument("--low", type=float, default=0.5)
    parser.add_argument("--low-s", type=float, default=40.0)
    parser.add_argument("--high", type=float, default=3.0)
    parser.add_argument("--high-s", type=float, default=60.0)
    parser.add_argument("--deadline-ms", type=float, default=1000.0)
    parser.add_argument("--prompt-bytes", default="20,60", help="a request's prompt length, low,high (uniform)")
    parser.add_argument("--max-tokens", default="128,192", help="a request's max_tokens, low,high (uniform)")
    parser.add_argument("--ramp-from", type=float, default=10.0, help="the capacity ramp's first level, requests/s")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-token-budget", type=int, default=256,
                        help="the endpoints' batch_token_budget: small, so that a replica, not the router, is the bottleneck")
    parser.add_argument("--portal-threads", type=int, default=32, help="requests the portal serves at once")
    parser.add_argument("--capacity", type=float, help="requests/s of one replica through the router; measured if not given")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=Path("/tmp/endpoint_autoscale.json"), help="all figures, as JSON")
    return parser.parse_args()


def serve_portal(port: int, threads: int) -> None:
    """The portal's WSGI application on a fixed pool of threads (as gunicorn's gthread worker would run it): at
    most `threads` requests in the portal at once, so at most that many database connections; the rest wait
    in the pool's queue. (`runserver` starts a thread, and so a database connection, per request in flight:
    under an open-loop overload that ran PostgreSQL out of connections.)"""
    from concurrent.futures import ThreadPoolExecutor

    import django

    django.setup()
    from django.core.servers.basehttp import WSGIRequestHandler, WSGIServer
    from django.core.wsgi import get_wsgi_application

    class QuietHandler(WSGIRequestHandler):
        def log_request(self, code="-", size="-"):  # only server errors: hundreds of lines a second otherwise
            if str(code).startswith("5") and str(code) != "503":
                super().log_request(code, size)

    class PoolServer(WSGIServer):
        request_queue_size = 1024

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.pool = ThreadPoolExecutor(threads, thread_name_prefix="portal")

        def process_request(self, request, client_address):
            self.pool.submit(self.handle_in_pool, request, client_address)

        def handle_in_pool(self, request, client_address):
            try:
                self.finish_request(request, client_address)
            except Exception:  # noqa: BLE001 - logged as socketserver does
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)

    server = PoolServer(("127.0.0.1", port), QuietHandler)
    server.set_app(get_wsgi_application())
    print(f"serving on 127.0.0.1:{port} with {threads} threads", flush=True)
    server.serve_forever()


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--as-portal":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    serve_portal(int(sys.argv[2]), int(sys.argv[3]))
    sys.exit(0)

ARGS = parse_args()
SCRATCH = Path(tempfile.mkdtemp(prefix="portal-autoscale-"))
RUN = uuid.uuid4().hex[:8]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
os.environ.update(
    LOCAL_WORKSPACE_DIR=str(SCRATCH / "workspaces"), LOCAL_JOBS_DIR=str(SCRATCH / "jobs"), LOCAL_USE_NVML="false",
    LOCAL_PROVISION_DELAY_S="0", CELERY_QUEUE=f"bench-autoscale-{RUN}", TEST_DATABASE_NAME=f"bench_autoscale_{RUN}",
    # The control loop's settings, for this process, the worker and the portal alike.
    ENDPOINT_RECONCILE_INTERVAL_S="1", SCHEDULER_CYCLE_INTERVAL_S="1", JOB_RECONCILE_INTERVAL_S="1",
    ENDPOINT_SCALE_IN_AFTER_S=f"{ARGS.scale_in_after_s:g}", ENDPOINT_IDLE_AFTER_S=f"{ARGS.idle_after_s:g}",
    ENDPOINT_TARGET_INFLIGHT=f"{ARGS.target_inflight:g}",
)
ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,?"
PROMPT_BYTES = tuple(int(x) for x in ARGS.prompt_bytes.split(","))
MAX_TOKENS = tuple(int(x) for x in ARGS.max_tokens.split(","))
GIVE_UP_AFTER_DEADLINE_S = 10.0
TENANT = "bench"


class Stop(Exception):
    """SIGTERM: leave through the cleanup."""


def _on_sigterm(signum, frame):
    raise Stop()


# --- the load -------------------------------------------------------------------------------------


def make_requests(rate: float, seconds: float, rng: random.Random, *, offset: float = 0.0, phase: str = "") -> list[dict]:
    at, out = 0.0, []
    while True:
        at += rng.expovariate(rate)
        if at >= seconds:
            return out
        prompt = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(*PROMPT_BYTES)))
        out.append({"at": offset + at, "phase": phase, "prompt": prompt, "max_tokens": rng.randint(*MAX_TOKENS),
                    "deadline_ms": ARGS.deadline_ms})


async def post(port: int, path: str, token: str, body: dict, timeout: float) -> tuple[int | str, str]:
    """(status, the answer's "detail" when it is not a 200) of one request."""
    data = json.dumps(body).encode()
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nAuthorization: Token {token}\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode() + data
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            await writer.drain()
            raw = await reader.read()
    except TimeoutError:
        return "gave up", ""
    except OSError as error:
        return f"error {error.__class__.__name__}", ""
    finally:
        if writer is not None:
            writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    line = head.split(b"\r\n", 1)[0].split()
    status = int(line[1]) if len(line) > 1 and line[1].isdigit() else "bad answer"
    detail = ""
    if status != 200:
        try:
            detail = str(json.loads(payload).get("detail", ""))[:60]
        except (ValueError, AttributeError):
            detail = payload[:60].decode(errors="replace")
    return status, detail


async def drive(port: int, path: str, token: str, requests: list[dict]) -> tuple[float, list[dict]]:
    """Send every request at its time; (wall-clock time of the schedule's zero, results)."""
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.2
    wall_zero = time.time() + 0.2
    results = []

    async def one(req):
        await asyncio.sleep(max(0.0, start + req["at"] - loop.time()))
        sent = loop.time()
        body = {"prompt": req["prompt"], "max_tokens": req["max_tokens"], "deadline_ms": req["deadline_ms"]}
        status, detail = await post(port, path, token, body, req["deadline_ms"] / 1000 + GIVE_UP_AFTER_DEADLINE_S)
        results.append({"at": req["at"], "phase": req["phase"], "deadline_ms": req["deadline_ms"], "status": status,
                        "detail": detail,
                        "late_start_s": sent - start - req["at"], "latency_ms": (loop.time() - sent) * 1000})

    await asyncio.gather(*(one(r) for r in requests))
    return wall_zero, results


class ConnectionWatch:
    """The most database connections open to the bench's database, sampled every 0.5 s while it runs."""

    def __init__(self):
        import threading

        self.most = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        from django.db import connection

        try:
            while not self.done.wait(0.5):
                with connection.cursor() as cursor:
                    cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
                    self.most = max(self.most, cursor.fetchone()[0])
        finally:
            connection.close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(5)


def refusals(results: list[dict]) -> str:
    """What the requests not answered 200 got, most frequent first."""
    counts: dict[str, int] = {}
    for r in results:
        if r["status"] != 200:
            key = f"{r['status']} {r.get('detail', '').split('(')[0].rstrip(' ;:.')}".strip()
            counts[key] = counts.get(key, 0) + 1
    return "; ".join(f"{n} x {key}" for key, n in sorted(counts.items(), key=lambda item: -item[1])) or "none"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarize(results: list[dict], seconds: float) -> dict:
    n = max(1, len(results))
    answered = [r for r in results if r["status"] == 200]
    in_time = [r for r in answered if r["latency_ms"] <= r["deadline_ms"]]
    return {
        "requests": len(results), "offered_per_s": len(results) / seconds, "answered": len(answered),
        "p50_ms": pct([r["latency_ms"] for r in answered], 0.5), "p99_ms": pct([r["latency_ms"] for r in answered], 0.99),
        "goodput_per_s": len(in_time) / seconds,
        "shed": sum(r["status"] in (429, 503) for r in results) / n,
        "expired": sum(r["status"] == 504 for r in results) / n,
        "late": (len(answered) - len(in_time)) / n,
        "unanswered": sum(not isinstance(r["status"], int) for r in results) / n,
        "other": sum(isinstance(r["status"], int) and r["status"] not in (200, 429, 503, 504) for r in results) / n,
    }


def one_request(port: int, path: str, token: str, deadline_ms: float) -> tuple[int, float, dict]:
    """(status, seconds to the answer, its body) of one request, synchronously."""
    body = json.dumps({"prompt": "hello from the bench", "max_tokens": 16, "deadline_ms": deadline_ms})
    started = time.monotonic()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=deadline_ms / 1000 + 30)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                            "Authorization": f"Token {token}"})
        answer = connection.getresponse()
        data = answer.read()
    finally:
        connection.close()
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = {"raw": data[:200].decode(errors="replace")}
    return answer.status, time.monotonic() - started, parsed


# --- the portal's server ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PortalServer:
    """The portal as `make run` serves it, on loopback, DEBUG off, on the bench's database: the edge
    (`python -m runners.edge`) on `port`, serving the endpoints, in front of the web process (`serve_portal`:
    Django's own WSGI server on a pool of threads) on a port of its own."""

    def __init__(self, log_path: Path):
        from tests.support.worker import worker_environment

        self.port = free_port()
        web_port = free_port()
        self.log = open(log_path, "ab")
        env = worker_environment(DEBUG="false", SECRET_KEY=secrets.token_urlsafe(50), ALLOWED_HOSTS="127.0.0.1,localhost",
                                 SECURE_SSL_REDIRECT="false")
        self.processes = [subprocess.Popen(argv, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                           start_new_session=True) for argv in (
            [sys.executable, __file__, "--as-portal", str(web_port), str(ARGS.portal_threads)],
            [sys.executable, "-m", "runners.edge", "--bind", f"127.0.0.1:{self.port}",
             "--upstream", f"http://127.0.0.1:{web_port}"],
        )]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(process.poll() is not None for process in self.processes):
                raise RuntimeError(f"The portal's web process or its edge exited early; see {log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    sock.sendall(b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                    if sock.recv(64).split(b" ")[1:2] == [b"200"]:  # the edge answers 502 until the web process does
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"The portal did not answer in 60 s; see {log_path}")

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.log.close()


# --- the bench ------------------------------------------------------------------------------------


def main() -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    import django

    django.setup()
    from django.conf import settings
    from django.db import connection

    from bench.timing import needs_postgres_and_redis

    if missing := needs_postgres_and_redis():
        print(missing, file=sys.stderr)
        return 2
    original = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    worker = portal = None
    try:
        from tests.support.worker import WorkerProcess

        world = setup_world()
        worker = WorkerProcess(SCRATCH / "worker.log", beat=True).start()
        portal = PortalServer(SCRATCH / "portal.log")
        print(f"scratch {SCRATCH}; portal on 127.0.0.1:{portal.port}; settings: reconcile, cycle and jobs reconcile "
              f"every 1 s, ENDPOINT_TARGET_INFLIGHT {ARGS.target_inflight:g}, ENDPOINT_SCALE_IN_AFTER_S "
              f"{ARGS.scale_in_after_s:g}, ENDPOINT_IDLE_AFTER_S {ARGS.idle_after_s:g}", flush=True)
        figures = {"settings": {k: v for k, v in vars(ARGS).items() if k != "json"}}
        figures["step"] = step_bench(world, portal)
        figures["warm_cold"] = warm_cold_bench(world, portal)
        ARGS.json.write_text(json.dumps(figures, indent=1, default=str))
        print(f"\nall figures in {ARGS.json}", flush=True)
        return 0
    except Stop:
        print("stopped (SIGTERM)", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup runs to its end
        if portal is not None:
            portal.stop()
        if worker is not None:
            worker.stop()
        # Replica processes outlive the worker by design; the bench's own must not outlive the bench.
        for pid_file in (SCRATCH / "jobs").glob("*/attempts/*/supervisor.pid"):
            try:
                os.killpg(int(pid_file.read_text().split()[1]), signal.SIGKILL)
            except (ProcessLookupError, PermissionError, ValueError, IndexError):
                pass
        connection.close()
        connection.creation.destroy_test_db(original, verbosity=0)
        import redis

        client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
        queue = settings.CELERY_TASK_DEFAULT_QUEUE
        keys = client.keys(f"{queue}*")
        client.delete(queue, *keys)
        print(f"cleaned up: processes stopped, database {os.environ['TEST_DATABASE_NAME']} dropped; logs in {SCRATCH}",
              file=sys.stderr)


def setup_world() -> dict:
    from django.contrib.auth import get_user_model

    from tenants.models import Membership, Tenant
    from tenants.services import token_create
    from tests.support.endpoints import trained_job
    from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

    flavors = demo_cluster_with_flavors()
    tenant = Tenant.objects.create(slug=TENANT, name="Bench")
    user = get_user_model().objects.create_user("bench", password="x")
    Membership.objects.create(tenant=tenant, user=user, role="owner")
    give_quota(tenant, flavors["h100-80gb"], guaranteed=16, max=16)
    environment = ready_environment(actor=user, tenant=tenant)
    job = trained_job(actor=user, environment=environment)
    _, token = token_create(user=user, name="bench")
    return {"user": user, "environment": environment, "job": job, "token": token}


def deploy(world: dict, name: str, **bounds):
    from runners.inference.services import endpoint_deploy

    return endpoint_deploy(actor=world["user"], data={
        "tenant": TENANT, "environment": world["environment"].id, "name": name, "source": {"job": world["job"].id},
        "flavor": "h100-80gb", "gpus_per_replica": 1, "queue_limit": 64, "batch_token_budget": ARGS.batch_token_budget,
        "max_batch_wait_ms": 5, "default_deadline_ms": 10000, **bounds})


def wait_until(what: str, predicate, timeout_s: float, interval_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise RuntimeError(f"Timed out after {timeout_s:g} s waiting for {what}; see the logs in {SCRATCH}")


def live_replicas(endpoint) -> int:
    return endpoint.replicas.exclude(job__state__in=["succeeded", "failed", "cancelled"]).count()


def ready_replicas(endpoint) -> int:
    return endpoint.replicas.filter(ready=True, retiring=False).count()


def settled(endpoint, count: int) -> bool:
    """Wanted, live and ready all equal to count (none starting or draining)."""
    endpoint.refresh_from_db()
    return endpoint.desired_replicas == count and live_replicas(endpoint) == count and ready_replicas(endpoint) == count


def step_bench(world: dict, portal: PortalServer) -> dict:
    from datetime import datetime, timezone

    from django.db.models import F

    from runners.inference.models import EndpointSample, Replica, ScaleEvent
    from runners.inference.services import endpoint_scale

    token = world["token"]
    path = f"/serve/{TENANT}/step/v1/generate"
    started = time.monotonic()
    endpoint = deploy(world, "step", min_replicas=1, max_replicas=1, warm_replicas=0)
    wait_until("the step endpoint's first replica", lambda: settled(endpoint, 1), 120)
    print(f"step endpoint ready in {time.monotonic() - started:.1f} s (deploy to one replica ready)", flush=True)

    # 1. One replica's capacity through the router: the endpoint held at one replica, an open-loop ramp.
    capacity = ARGS.capacity
    ramp = []
    if capacity is None:
        rng = random.Random(ARGS.seed)
        rate = ARGS.ramp_from
        print("\n| ramp level | offered/s | answered | p50 ms | p99 ms | goodput/s | shed | expired | late | unanswered |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for _ in range(12):
            requests = make_requests(rate, 5.0, rng, phase="ramp")
            _, results = asyncio.run(drive(portal.port, path, token, requests))
            row = {"rate": rate, **summarize(results, 5.0), "refusals": refusals(results)}
            ramp.append(row)
            print(f"| {rate:.0f}/s | {row['offered_per_s']:.0f} | {row['answered']} | {row['p50_ms']:.0f} | "
                  f"{row['p99_ms']:.0f} | {row['goodput_per_s']:.1f} | {row['shed']:.1%} | {row['expired']:.1%} | "
                  f"{row['late']:.1%} | {row['unanswered']:.1%} |", flush=True)
            if row["refusals"] != "none":
                print(f"    not answered 200: {row['refusals']}", flush=True)
            if row["goodput_per_s"] < 0.8 * row["offered_per_s"]:
                break
            rate *= 1.5
            time.sleep(2.0)
        capacity = max(row["goodput_per_s"] for row in ramp)
        print(f"capacity of one replica through the router: {capacity:.0f} requests/s (highest goodput of the ramp)",
              flush=True)

    # 2. The step: min 1, max 4, warm 0.
    endpoint = endpoint_scale(actor=world["user"], endpoint=endpoint, data={"max_replicas": 4})
    time.sleep(max(3.0, ARGS.scale_in_after_s / 4))  # the ramp's queues drain; the autoscaler sees a quiet endpoint
    wait_until("the step endpoint quiet at one replica", lambda: settled(endpoint, 1), 60)
    rng = random.Random(ARGS.seed + 1)
    requests = make_requests(capacity * ARGS.low, ARGS.low_s, rng, phase="low")
    requests += make_requests(capacity * ARGS.high, ARGS.high_s, rng, offset=ARGS.low_s, phase="high")
    print(f"\nstep: {ARGS.low:g}x = {capacity * ARGS.low:.0f}/s for {ARGS.low_s:g} s, then {ARGS.high:g}x = "
          f"{capacity * ARGS.high:.0f}/s for {ARGS.high_s:g} s, then nothing ({len(requests)} requests)", flush=True)
    with ConnectionWatch() as watch:
        wall_zero, results = asyncio.run(drive(portal.port, path, token, requests))
    step_at = wall_zero + ARGS.low_s
    load_end = step_at + ARGS.high_s
    print(f"load sent; the last answer came {time.time() - load_end:.1f} s after the load's end", flush=True)

    def when(moment) -> float:
        return moment.timestamp() - step_at

    # Wait for the scale-in, and a little past it (a second one would be flapping).
    def scaled_in():
        endpoint.refresh_from_db()
        return endpoint.desired_replicas == 1 and ScaleEvent.objects.filter(
            endpoint=endpoint, at__gte=datetime.fromtimestamp(load_end, timezone.utc), to_replicas__lt=F("from_replicas")
        ).exists()

    try:
        wait_until("the scale-in after the load", scaled_in, ARGS.scale_in_after_s + 60, 0.5)
        time.sleep(3.0)
    except RuntimeError as exc:
        print(f"NOTE: {exc}", flush=True)
    done_at = time.time()

    since = datetime.fromtimestamp(wall_zero - 1, timezone.utc)
    events = list(ScaleEvent.objects.filter(endpoint=endpoint, at__gte=since).order_by("at", "id"))
    print("\nscale events (seconds from the step; the low load starts at "
          f"{-ARGS.low_s:g}, the load ends at {ARGS.high_s:g}):")
    for event in events:
        print(f"  {when(event.at):+7.1f} s  {event.from_replicas} -> {event.to_replicas}  {event.reason}")
    ups = [e for e in events if e.to_replicas > e.from_replicas]
    downs = [e for e in events if e.to_replicas < e.from_replicas]
    directions = [1 if e.to_replicas > e.from_replicas else -1 for e in events if e.to_replicas != e.from_replicas]
    reversals = sum(1 for a, b in zip(directions, directions[1:]) if a != b)
    out_after_step = [e for e in ups if when(e.at) >= 0]
    first_out = out_after_step[0] if out_after_step else None
    in_after_end = [e for e in downs if when(e.at) >= ARGS.high_s]
    first_in = in_after_end[0] if in_after_end else None
    new = list(Replica.objects.filter(endpoint=endpoint, created_at__gte=datetime.fromtimestamp(step_at, timezone.utc))
               .order_by("created_at"))
    ready_times = [when(r.ready_since) for r in new if r.ready_since is not None]
    step = {
        "capacity_per_s": capacity, "ramp": ramp, "events": [
            {"at_s": when(e.at), "from": e.from_replicas, "to": e.to_replicas, "reason": e.reason} for e in events],
        "scale_out_at_s": when(first_out.at) if first_out else None,
        "scale_out_to": first_out.to_replicas if first_out else None,
        "scale_outs_before_step": [when(e.at) for e in ups if when(e.at) < 0],
        "new_replicas": len(new), "new_ready_at_s": ready_times,
        "new_created_at_s": [when(r.created_at) for r in new],
        "scale_in_after_end_s": (when(first_in.at) - ARGS.high_s) if first_in else None,
        "scale_in_to": first_in.to_replicas if first_in else None,
        "direction_changes": directions, "reversals": reversals,
    }
    print(f"scale-out: {step['scale_out_at_s']} s after the step, to {step['scale_out_to']}; scale-outs during the low "
          f"phase: {len(step['scale_outs_before_step'])}")
    print(f"new replicas: {len(new)}, created at {[round(x, 1) for x in step['new_created_at_s']]} s, ready at "
          f"{[round(x, 1) for x in ready_times]} s after the step")
    print(f"scale-in: {step['scale_in_after_end_s']} s after the load's end, to {step['scale_in_to']}; direction "
          f"changes {directions} ({reversals} reversal(s); 1 = up then down once)")

    # Per phase, and the 3x phase split at the moment every new replica was ready.
    phases = {"low": [r for r in results if r["phase"] == "low"], "high": [r for r in results if r["phase"] == "high"]}
    rows = {"low": summarize(phases["low"], ARGS.low_s), "high": summarize(phases["high"], ARGS.high_s)}
    if ready_times:
        all_ready = max(ready_times)
        split = ARGS.low_s + max(0.0, min(ARGS.high_s, all_ready))
        before = [r for r in phases["high"] if r["at"] < split]
        after = [r for r in phases["high"] if r["at"] >= split]
        if before:
            rows["high, before all new replicas ready"] = summarize(before, split - ARGS.low_s)
        if after:
            rows["high, after"] = summarize(after, ARGS.low_s + ARGS.high_s - split)
    print("\n| phase | offered/s | requests | answered | p50 ms | p99 ms | goodput/s | shed | expired | late | unanswered |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['offered_per_s']:.0f} | {row['requests']} | {row['answered']} | {row['p50_ms']:.0f} | "
              f"{row['p99_ms']:.0f} | {row['goodput_per_s']:.1f} | {row['shed']:.1%} | {row['expired']:.1%} | "
              f"{row['late']:.1%} | {row['unanswered']:.1%} |")
    step["phases"] = rows
    for name in ("low", "high"):
        print(f"not answered 200, {name}: {refusals(phases[name])}")
        step[f"refusals_{name}"] = refusals(phases[name])
    step["db_connections_max"] = watch.most
    print(f"most database connections open during the load: {watch.most}")
    step["client_late_start_p99_s"] = pct([r["late_start_s"] for r in results], 0.99)

    # A timeline: 5 s buckets from the start of the low load to the scale-in.
    samples = list(EndpointSample.objects.filter(endpoint=endpoint, at__gte=since).order_by("at"))
    timeline = []
    print("\n| t from step (s) | offered/s | goodput/s | wanted | ready (samples) | in flight (samples, max) "
          "| refused by replicas/s (samples, max) |")
    print("|---|---|---|---|---|---|---|")
    t = -ARGS.low_s
    while wall_zero + ARGS.low_s + t < done_at:
        lo, hi = t, t + 5
        bucket = [r for r in results if lo <= r["at"] - ARGS.low_s < hi]
        good = sum(1 for r in bucket if r["status"] == 200 and r["latency_ms"] <= r["deadline_ms"])
        wanted = 1
        for event in events:
            if when(event.at) < hi:
                wanted = event.to_replicas
        mine = [s for s in samples if lo <= when(s.at) < hi]
        ready = sorted({s.ready_replicas for s in mine})
        inflight = max((s.queue_depth + s.running for s in mine), default=0)
        refused = max((s.shed_per_s + s.expired_per_s for s in mine), default=0.0)
        timeline.append({"t": lo, "offered": len(bucket) / 5, "goodput": good / 5, "wanted": wanted,
                         "ready": ready, "inflight_max": inflight, "refused_max": refused})
        print(f"| {lo:+.0f} | {len(bucket) / 5:.0f} | {good / 5:.0f} | {wanted} | {'/'.join(map(str, ready))} | {inflight} "
              f"| {refused:.1f} |")
        t += 5
    step["timeline"] = timeline

    from runners.inference.services import endpoint_stop

    endpoint_stop(actor=world["user"], endpoint=endpoint)  # its replica drains and ends: the next part has the cores
    return step


def warm_cold_bench(world: dict, portal: PortalServer) -> dict:
    from runners.inference.models import InferenceEndpoint, ScaleEvent
    from runners.jobs.models import JobEvent

    token = world["token"]
    idle = ARGS.idle_after_s
    cold = deploy(world, "cold", min_replicas=0, max_replicas=1, warm_replicas=0)
    warm = deploy(world, "warm", min_replicas=0, max_replicas=2, warm_replicas=1)
    step = InferenceEndpoint.objects.get(name="step", tenant__slug=TENANT)
    wait_until("the step endpoint stopped", lambda: live_replicas(step) == 0, 120)
    print(f"\nwarm against cold: endpoint cold (min 0, max 1, warm 0) and warm (min 0, max 2, warm 1); "
          f"{ARGS.repeats} rounds", flush=True)
    rounds = []
    for number in range(ARGS.repeats):
        # Both idle: cold at zero (no replica left), warm at its one warm replica, no request for the idle window.
        started = time.monotonic()
        wait_until("cold at zero and warm at one", lambda: settled(cold, 0) and settled(warm, 1),
                   idle + ARGS.scale_in_after_s + 120, 0.5)
        time.sleep(1.0)
        waited = time.monotonic() - started
        before = time.time()
        status_c, cold_s, body_c = one_request(portal.port, f"/serve/{TENANT}/cold/v1/generate", token, 60_000)
        status_w, warm_s, body_w = one_request(portal.port, f"/serve/{TENANT}/warm/v1/generate", token, 60_000)
        # The cold start's parts, from the database.
        event = ScaleEvent.objects.filter(endpoint=cold, at__gte=_dt(before), to_replicas__gt=0).order_by("at").first()
        replica = cold.replicas.order_by("-id").first()
        running = JobEvent.objects.filter(job=replica.job, to_state="running").order_by("at").first()
        row = {
            "round": number + 1, "waited_for_idle_s": waited, "cold_status": status_c, "cold_s": cold_s,
            "warm_status": status_w, "warm_s": warm_s,
            "cold_scale_out_s": event.at.timestamp() - before if event else None,
            "cold_scale_out_reason": event.reason if event else None,
            "cold_job_running_s": running.at.timestamp() - before if running else None,
            "cold_replica_ready_s": replica.ready_since.timestamp() - before if replica.ready_since else None,
            "cold_queue_ms": body_c.get("queue_ms"), "cold_compute_ms": body_c.get("compute_ms"),
        }
        rounds.append(row)
        print(f"  round {number + 1} (after {waited:.0f} s of waiting for both to be idle): cold {status_c} in "
              f"{cold_s * 1000:.0f} ms (scale-out event {_ms(row['cold_scale_out_s'])}, replica job running "
              f"{_ms(row['cold_job_running_s'])}, replica ready {_ms(row['cold_replica_ready_s'])}); warm {status_w} in "
              f"{warm_s * 1000:.0f} ms", flush=True)
    figures = {
        "rounds": rounds,
        "cold_median_ms": statistics.median(r["cold_s"] for r in rounds) * 1000,
        "warm_median_ms": statistics.median(r["warm_s"] for r in rounds) * 1000,
    }
    for key in ("cold_scale_out_s", "cold_job_running_s", "cold_replica_ready_s"):
        values = [r[key] for r in rounds if r[key] is not None]
        figures[f"{key}_median"] = statistics.median(values) if values else None
    print(f"\n| time to the first answer | median | rounds |\n|---|---|---|\n"
          f"| scaled to zero (cold start) | {figures['cold_median_ms']:.0f} ms | "
          f"{', '.join(str(round(r['cold_s'] * 1000)) for r in rounds)} |\n"
          f"| warm replica kept ready | {figures['warm_median_ms']:.0f} ms | "
          f"{', '.join(str(round(r['warm_s'] * 1000)) for r in rounds)} |")
    print(f"cold start's parts (median, from the request): scale-out event {_ms(figures['cold_scale_out_s_median'])}, "
          f"replica job running {_ms(figures['cold_job_running_s_median'])}, replica ready "
          f"{_ms(figures['cold_replica_ready_s_median'])}")
    return figures


def _dt(seconds: float):
    from datetime import datetime, timezone

    return datetime.fromtimestamp(seconds, timezone.utc)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


if __name__ == "__main__":
    sys.exit(main())
