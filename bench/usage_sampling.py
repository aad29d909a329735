"""What reading the GPU utilization of every open attempt costs the portal: 1,000 GPUs, DCGM through Prometheus.

    .venv/bin/python bench/usage_sampling.py [--tenants 100] [--calls 30] [--interval-s 30]

A helper process plays the cluster. It runs the Kubernetes API stand-in (tests/support/k8s_standin.py)
and launches every attempt on it through the Kubernetes backend, as the portal does, so the pods are
the ones the Job and ReplicaSet controllers make from the portal's manifests (a serving replica's
with its random suffix). Each tenant has its own namespace and 10 GPUs: training jobs of 2 x 4, 1 x 8
or 2 x (1 x 4) GPUs, and two inference replicas of one GPU; `--tenants 100` is 1,000 GPUs on 125
nodes of 8. It also runs the DCGM exporter stand-in (tests/support/prometheus.py), serving the four
fields the portal reads for every GPU, each attributed to the replica's pod and container that holds it.
Debian's Prometheus scrapes it every `--scrape-interval-s`.

This process is the reading one, as a worker of the portal would be: a KubernetesBackend pointed
at the stand-in (its pod cache filled by its own list and watch) and at Prometheus, asked for all
attempts' readings `--calls` times in a row. Every call syncs the pod cache (one watch read), as
one call every 30 s does, then makes one query. The CPU time of this process per call
(time.process_time: the stand-ins and Prometheus run in other processes) is reported, and as a
share of one core at one call per `--interval-s`.

Then the ingest: the readings written to a scratch PostgreSQL database (created here) by the usage
app's own `store`, as the sampling task does; its CPU is this process's and the database backend
process's (read from /proc), so the total is what a pass costs the machine, PostgreSQL included.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode
from urllib.request import urlopen

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

GPUS_PER_NODE = 8
SCRATCH_DATABASE: list[str] = []  # the name to restore once the scratch database is dropped
GPUS_PER_TENANT = 10


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


# --- The cluster (the helper process) ------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One attempt to launch: a training job, or an inference replica (endpoint set) serving the tenant's first job."""

    job_id: int
    namespace: str
    replicas: int
    gpus_per_replica: int
    endpoint: int | None = None
    source_job_id: int | None = None


def tenant_attempts(tenant: int, first_job_id: int) -> list[Planned]:
    """A tenant's 10 GPUs: training of 2 x 4, 1 x 8 or two of 1 x 4 GPUs (by turns), and two replicas of one."""
    namespace = f"tenant-{tenant:03d}"
    shapes = [[(2, 4)], [(1, 8)], [(1, 4), (1, 4)]][tenant % 3]
    planned = [Planned(first_job_id + index, namespace, replicas, gpus) for index, (replicas, gpus) in enumerate(shapes)]
    for _replica in range(2):
        planned.append(Planned(first_job_id + len(planned), namespace, 1, 1, endpoint=tenant,
                               source_job_id=first_job_id))
    return planned


def place(planned: list[Planned], nodes: int) -> dict[tuple[int, int], tuple[str, tuple[int, ...]]]:
    """(job id, rank) -> (node, GPU indices): first fit, largest first (powers of two fill the nodes exactly)."""
    free = [list(range(GPUS_PER_NODE)) for _ in range(nodes)]
    placement = {}
    replicas = [(attempt.gpus_per_replica, attempt.job_id, rank) for attempt in planned for rank in range(attempt.replicas)]
    for gpus, job_id, rank in sorted(replicas, key=lambda replica: -replica[0]):
        node = next(index for index, left in enumerate(free) if len(left) >= gpus)
        placement[(job_id, rank)] = (f"node-{node:03d}", tuple(free[node][:gpus]))
        del free[node][:gpus]
    return placement


def play_cluster(conn, tenants: int) -> None:
    """The helper process: the attempts' pods on the API stand-in, the exporter serving their GPUs, until told to stop."""
    import logging

    import django

    django.setup()
    from runners.backends.base import JobLaunch, ReplicaPlacement, ServingSettings
    from runners.backends.job_manifests import COMPLETION_INDEX_ANNOTATION, JOB_LABEL, training_job_manifest
    from runners.backends.kubernetes import KubernetesBackend
    from runners.backends.serve_manifests import serving_deployment_manifest
    from runners.clusters.registry import kubernetes_backend_options
    from runners.nvidia import names
    from tests.support.k8s import client_for, environment_namespace, gpu_node
    from tests.support.k8s_standin import KubernetesStandIn
    from tests.support.prometheus import DcgmDevice, DcgmExporter

    logging.getLogger("runners.backends.kubernetes").setLevel(logging.WARNING)  # not a line per pod bound
    options = kubernetes_backend_options()
    nodes = -(-tenants * GPUS_PER_TENANT // GPUS_PER_NODE)
    planned: list[Planned] = []
    for tenant in range(tenants):
        planned += tenant_attempts(tenant, first_job_id=len(planned) + 1)
    placement = place(planned, nodes)
    with KubernetesStandIn(controller_delay_s=0, controller_period_s=None) as api, DcgmExporter() as exporter:
        for node in range(nodes):
            api.put(gpu_node(f"node-{node:03d}"))
        for tenant in range(tenants):
            environment_namespace(api, f"tenant-{tenant:03d}")  # with the ServiceAccount its pods run as
        # What launch_job applies that makes pods; stored at once, since the stand-in's controllers
        # go over every object on each request (launching one by one takes minutes at this size).
        for attempt in planned:
            launch = JobLaunch(
                job_id=attempt.job_id, attempt=1, tenant_slug=attempt.namespace, namespace=attempt.namespace,
                name="bench", template="pytorch-ddp" if attempt.endpoint is None else "serve",
                replicas=tuple(ReplicaPlacement(rank, *placement[(attempt.job_id, rank)])
                               for rank in range(attempt.replicas)),
                gpu_resource=names.GPU_RESOURCE, gpus_per_replica=attempt.gpus_per_replica, cpu_milli_per_replica=4000,
                memory_mib_per_replica=16384, steps=1000, checkpoint_every_steps=100, max_runtime_s=86400,
                serving=None if attempt.endpoint is None else ServingSettings(
                    endpoint_id=attempt.endpoint, checkpoint="checkpoints/step-00001000.pt",
                    source_job_id=attempt.source_job_id),
            )
            if attempt.endpoint is None:
                api.put(training_job_manifest(launch, trainer_image=options["trainer_image"],
                                              scheduler_name=options["scheduler_name"], grace_period_s=30))
            else:
                api.put(serving_deployment_manifest(launch, server_image=options["trainer_image"],
                                                    scheduler_name=options["scheduler_name"]))
        api.objects()  # the Job, Deployment and ReplicaSet controllers make the pods
        launcher = KubernetesBackend(client_for(api.url), **options)
        launcher.jobs_open({(attempt.job_id, 1) for attempt in planned})
        launcher._sync(force=True)  # binds every pod where it was placed
        rng = random.Random(42)
        devices = []
        pods = api.pods()
        assert all(pod["spec"].get("nodeName") for pod in pods), "every pod bound"
        for pod in pods:
            metadata = pod["metadata"]
            rank = int(metadata["annotations"].get(COMPLETION_INDEX_ANNOTATION, 0))
            node, gpus = placement[(int(metadata["labels"][JOB_LABEL]), rank)]
            for gpu in gpus:
                busy = rng.uniform(0.05, 0.99)
                devices.append(DcgmDevice(
                    uuid=f"GPU-{uuid.UUID(int=rng.getrandbits(128))}", gpu=gpu, hostname=node,
                    namespace=metadata["namespace"], pod=metadata["name"], container=pod["spec"]["containers"][0]["name"],
                    gpu_util=round(busy * 100), gr_engine_active=round(busy, 6),
                    fb_used_mib=rng.randrange(2_000, 80_000), power_w=round(rng.uniform(90, 700), 3),
                ))
        exporter.set(devices)
        conn.send({"api": api.url, "exporter": exporter.target, "nodes": nodes, "pods": len(pods),
                   "gpus": len(devices), "attempts": [attempt.job_id for attempt in planned]})
        conn.recv()  # told to stop


# --- The reading process ------------------------------------------------------------------------


def backend_cpu_s(connection) -> float:
    """CPU seconds the database's backend process serving this connection has used (PostgreSQL runs here too)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Sampling:
    """One sampling pass of the portal: the read, then the ingest of what was read (runners.usage.sampling.store)."""

    backend: object  # runners.backends.kubernetes.KubernetesBackend
    attempts: set[tuple[int, int]]
    rows: dict | None = None  # (job id, attempt) -> JobAttempt, as the sampling task reads them

    def read_once(self) -> dict:
        """Every attempt's readings, as the sampling task asks the backend for them: one call for all."""
        return self.backend.gpu_readings(self.attempts)

    def one_pass(self) -> dict[str, float]:
        """CPU seconds of each step of one pass (the ingest step goes after the read, taking its readings)."""
        cpu = {}
        start = time.process_time()
        readings = self.read_once()
        cpu["read"] = time.process_time() - start
        assert len(readings) == len(self.attempts), f"{len(readings)} of {len(self.attempts)} attempts read"
        if self.rows is not None:
            from django.db import connection

            from runners.usage.sampling import store

            start, database = time.process_time(), backend_cpu_s(connection)
            store(readings, self.rows)
            cpu["ingest"] = time.process_time() - start
            cpu["ingest, database process"] = backend_cpu_s(connection) - database
        return cpu


def wait_until_read(sampling: Sampling, gpus: int, timeout_s: float) -> None:
    """Until Prometheus has scraped every GPU (the first scrape comes a few seconds after it starts)."""
    deadline = time.monotonic() + timeout_s
    while True:
        read = sum(len(found) for found in sampling.read_once().values())
        if read == gpus:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"Only {read} of {gpus} GPUs read after {timeout_s} s.")
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--interval-s", type=float, default=30.0, help="how often the portal reads, in production")
    parser.add_argument("--scrape-interval-s", type=float, default=5.0)
    args = parser.parse_args()
    from tests.support.prometheus import PROMETHEUS

    if not os.access(PROMETHEUS, os.X_OK):
        print(f"The bench needs Debian's Prometheus at {PROMETHEUS} (apt-get install prometheus).", file=sys.stderr)
        return 2
    import django

    django.setup()
    from runners.backends import dcgm
    from runners.backends.kubernetes import KubernetesBackend
    from runners.clusters.registry import kubernetes_backend_options
    from tests.support.k8s import client_for
    from tests.support.prometheus import running_prometheus

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    helper = context.Process(target=play_cluster, args=(theirs, args.tenants), daemon=True)
    started = time.monotonic()
    helper.start()
    cluster = ours.recv()
    print(f"cluster: {args.tenants} tenants, {cluster['nodes']} nodes, {cluster['gpus']} GPUs, "
          f"{len(cluster['attempts'])} attempts, {cluster['pods']} pods (launched in {time.monotonic() - started:.1f} s)")
    try:
        with running_prometheus([cluster["exporter"]], scrape_interval_s=args.scrape_interval_s) as prometheus:
            backend = KubernetesBackend(client_for(cluster["api"]),
                                        **kubernetes_backend_options() | {"prometheus_url": prometheus.url})
            backend.min_sync_interval_s = 0  # every call syncs the pod cache, as one every 30 s would
            sampling = Sampling(backend, {(job_id, 1) for job_id in cluster["attempts"]})
            wait_until_read(sampling, cluster["gpus"], timeout_s=60)
            sampling.rows = portal_rows(cluster["attempts"], args.tenants)
            with urlopen(f"{prometheus.url}/api/v1/query?" + urlencode({"query": dcgm.QUERY})) as answer:
                size = len(answer.read())
            print(f"one query: {size / 1e6:.2f} MB of JSON ({4 * cluster['gpus']} values and "
                  f"{cluster['gpus']} sample times)")
            passes, walls = [], []
            for _call in range(args.calls):
                wall = time.perf_counter()
                passes.append(sampling.one_pass())
                walls.append(time.perf_counter() - wall)
            query_only = []
            for _call in range(args.calls):
                start = time.process_time()
                dcgm.read_devices(prometheus.url)
                query_only.append(time.process_time() - start)
    finally:
        ours.send("stop")
        helper.join(timeout=30)
        if SCRATCH_DATABASE:
            from django.db import connection

            connection.creation.destroy_test_db(SCRATCH_DATABASE[0], verbosity=0)
    print(f"{args.calls} calls of gpu_readings for all {len(sampling.attempts)} attempts:")
    for step in passes[0]:
        cpu = [one[step] for one in passes]
        # The mean carries the share of a core: some calls pay for a full garbage collection.
        print(f"  {step}: CPU mean {statistics.mean(cpu) * 1000:.1f} ms (median {statistics.median(cpu) * 1000:.1f}, "
              f"p90 {percentile(cpu, 0.9) * 1000:.1f}, max {max(cpu) * 1000:.1f}) = "
              f"{statistics.mean(cpu) / args.interval_s * 100:.2f} % of one core at one call per {args.interval_s:g} s")
    print(f"  of which the query alone (dcgm.read_devices): CPU mean {statistics.mean(query_only) * 1000:.1f} ms")
    print(f"  wall time per call: median {statistics.median(walls) * 1000:.1f} ms")
    total = statistics.mean(sum(one.values()) for one in passes)
    print(f"  read and ingest, the database's process included: {total * 1000:.1f} ms a pass = "
          f"{total / args.interval_s * 100:.2f} % of one core at one pass per {args.interval_s:g} s")
    return 0


def portal_rows(job_ids: list[int], tenants: int) -> dict:
    """The attempts as the portal's database holds them (a scratch database): what the ingest attributes to."""
    from django.db import connection

    from runners.environments.models import Environment, EnvironmentState
    from runners.jobs.models import Job, JobAttempt
    from tenants.models import Tenant
    from tests.support.jobs import demo_cluster_with_flavors

    SCRATCH_DATABASE.append(connection.settings_dict["NAME"])
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    flavor = demo_cluster_with_flavors()["h100-80gb"]
    environments = []
    for number in range(tenants):
        tenant = Tenant.objects.create(slug=f"team-{number:03d}", name=f"Team {number}")
        environments.append(Environment.objects.create(tenant=tenant, name="work", namespace=f"team-{number:03d}--work",
                                                       state=EnvironmentState.READY))
    rows = {}
    for index, job_id in enumerate(sorted(job_ids)):
        environment = environments[index % tenants]
        job = Job.objects.create(id=job_id, tenant=environment.tenant, environment=environment, name=f"job-{job_id}",
                                 spec={}, flavor=flavor, replicas=1, gpus_per_replica=1, state="running")
        attempt = JobAttempt.objects.create(job=job, number=1, placement=[])
        rows[(job_id, 1)] = JobAttempt.objects.select_related("job").get(id=attempt.id)
    return rows


if __name__ == "__main__":
    sys.exit(main())
