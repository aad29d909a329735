"""Cold start of an inference replica serving a model version: its weights in the node's cache against from the store.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/portal CELERY_BROKER_URL=redis://127.0.0.1:6379/9 \\
        .venv/bin/python bench/model_cold_start.py [--weights-mb 256] [--repeats 5] [--store s3|folder] [--json out.json]

Everything real on the local backend, in this process as the suite's endpoint tests drive it
(`tests.support.endpoints.drive`: the endpoint reconcile, the scheduler cycle, the replicas' launches and the
jobs reconcile, one after the other every 50 ms): a scratch PostgreSQL database (created and dropped here), the
demo cluster, one tenant, and a model version promoted from a checkpoint of the shipped trainer's model padded
to `--weights-mb` MB (an extra tensor the server loads and ignores, so that the weights weigh what a real
model's do). The store is a moto S3 server on a loopback port (`--store s3`, the default: the portal reads it
through s3fs as it reads any bucket) or a folder (`--store folder`).

A cold start is one endpoint (min 1, max 1) deployed from the version, timed from the deploy's answer to its
replica's first ready `/readyz`. Each of `--repeats` pairs times it twice, in an order that alternates (ABBA):

- **store**: every node's cache emptied first, so the attempt's supervisor pulls the weights from the store into
  the cache (checked) before the server starts;
- **cache**: every node's cache holding the weights already (filled beforehand and released), so the supervisor
  finds them there and pulls nothing.

Reported per mode: the median, min and max of the cold start, and its parts from the database (deploy -> the
replica's job admitted by the cycle -> its attempt started by the launch -> ready); the bytes pulled from the
store by the node caches (their counters). Each endpoint is stopped and drained before the next.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.s3 import MotoS3  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights-mb", type=int, default=256, help="The model version's weights, in MB.")
    parser.add_argument("--repeats", type=int, default=5, help="Pairs of cold starts (store, cache).")
    parser.add_argument("--store", choices=("s3", "folder"), default="s3")
    parser.add_argument("--json", type=Path, help="Also write the figures here.")
    return parser.parse_args()


def padded_job(actor, environment, weights_mb: int):
    """A training job with one checkpoint: the shipped model, padded with an extra tensor to `weights_mb` MB."""
    import torch
    from django.utils import timezone

    from runners.clusters.registry import get_backend
    from runners.jobs import services as jobs
    from runners.jobs.models import Checkpoint
    from runners.workloads.train import CharModel, checkpoint_state
    from tests.support.jobs import job_data

    job = jobs.job_submit(actor=actor, data=job_data(environment, name="big", replicas=1, topology={"level": "none"},
                                                     steps=10, checkpoint_every_steps=10))
    model = CharModel()
    state = checkpoint_state(10, model, torch.optim.Adam(model.parameters()), world_size=1)
    state["padding"] = torch.randint(0, 255, (weights_mb * 1000 * 1000,), dtype=torch.uint8)
    job_dir = get_backend().jobs.job_dir(job.id)
    path = job_dir / "checkpoints" / "step-00000010.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    Checkpoint.objects.create(job=job, step=10, uri=str(path.relative_to(job_dir)), bytes=path.stat().st_size,
                              created_at=timezone.now())
    jobs.job_cancel(actor=actor, job=job)
    return job


def node_names() -> list[str]:
    from runners.clusters.models import Node

    return sorted(Node.objects.values_list("name", flat=True))


def empty_caches() -> None:
    from runners.clusters.registry import get_backend

    shutil.rmtree(get_backend().jobs.node_cache_dir, ignore_errors=True)


def fill_caches(version) -> None:
    """Every node's cache holds the version's weights (pulled once, copied to the others), pinned by nobody."""
    from runners.clusters.registry import get_backend
    from runners.registry.services import weights_store
    from runners.storage.nodecache import BlobWanted, NodeCache

    jobs = get_backend().jobs
    for node in node_names():
        root, size = jobs.node_cache(node)
        cache = NodeCache(root, size)
        cache.fill(weights_store(), BlobWanted(version.weights_sha256, version.weights_bytes, "models"),
                   holder="bench-prefill")
        cache.release("bench-prefill")


def pulled_bytes() -> int:
    from runners.clusters.registry import get_backend

    jobs = get_backend().jobs
    snapshots = jobs.node_cache_snapshots({node: None for node in node_names()})
    return sum(snapshot.stats.bytes_pulled for snapshot in snapshots.values())


def cold_start(client, environment, version, name: str) -> dict:
    from runners.inference.models import EndpointState, InferenceEndpoint
    from tests.support.endpoints import drive

    started = time.monotonic()
    answer = client.post("/api/v1/endpoints/", {
        "tenant": environment.tenant.slug, "environment": environment.id, "name": name,
        "source": {"model": version.name, "version": version.version}, "flavor": "h100-80gb",
        "min_replicas": 1, "max_replicas": 1}, format="json")
    assert answer.status_code == 201, answer.json()
    deployed_at = time.monotonic()
    endpoint = InferenceEndpoint.objects.get(id=answer.json()["id"])
    endpoint = drive(endpoint, lambda e: e.replicas.filter(ready=True).exists(), timeout_s=600, pause_s=0.05)
    ready_at = time.monotonic()
    replica = endpoint.replicas.select_related("job").get()
    attempt = replica.job.attempts.order_by("number").first()
    created = endpoint.created_at
    parts = {
        "admitted_s": (attempt.admitted_at - created).total_seconds(),
        "started_s": (attempt.started_at - created).total_seconds(),
        "ready_s": (replica.ready_since - created).total_seconds(),
    }
    assert client.post(f"/api/v1/endpoints/{endpoint.id}/stop/").status_code == 202
    drive(endpoint, lambda e: e.state == EndpointState.STOPPED, timeout_s=120, pause_s=0.05)
    return {"cold_start_s": ready_at - started, "deploy_answer_s": deployed_at - started, **parts}


def summary(rows: list[dict]) -> dict:
    out = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="model-cold-start-"))
    server = None
    if args.store == "s3":
        # A moto S3 server on a loopback port with one bucket; the portal reads it through s3fs.
        server = MotoS3("models").start()
        url, options = "s3://models/store", server.options
    else:
        url, options = f"file://{work / 'store'}", {}
    os.environ.update(DATA_STORAGE_URL=url, DATA_STORAGE_OPTIONS=json.dumps(options),
                      LOCAL_JOBS_DIR=str(work / "jobs"), LOCAL_WORKSPACE_DIR=str(work / "workspaces"),
                      LOCAL_USE_NVML="false", LOCAL_PROVISION_DELAY_S="0", DJANGO_SETTINGS_MODULE="portal.settings")
    import logging

    import django

    django.setup()
    # The S3 server's request lines and the portal's access log would bury the figures.
    for noisy in ("werkzeug", "portal.access", "runners.registry.services"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    from bench.timing import scratch_database
    from runners.clusters.registry import get_backend
    from runners.registry import services as registry
    from tenants.models import Membership, Role, Tenant
    from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

    figures: dict = {"store": args.store, "weights_mb": args.weights_mb, "repeats": args.repeats, "runs": []}
    try:
        with scratch_database():
            get_backend.cache_clear()
            flavors = demo_cluster_with_flavors()
            tenant = Tenant.objects.create(slug="bench", name="Bench")
            user = get_user_model().objects.create_user("bench", password="bench-password-1")
            Membership.objects.create(user=user, tenant=tenant, role=Role.OWNER)
            give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8)
            environment = ready_environment(actor=user, tenant=tenant)
            job = padded_job(user, environment, args.weights_mb)
            promote_started = time.monotonic()
            version, _ = registry.promote_checkpoint(actor=user, job=job, step=10, name="big")
            figures["promote_s"] = time.monotonic() - promote_started
            figures["weights_bytes"] = version.weights_bytes
            client = APIClient()
            client.force_authenticate(user)
            for repeat in range(args.repeats):
                order = ("store", "cache") if repeat % 2 == 0 else ("cache", "store")
                for mode in order:
                    if mode == "store":
                        empty_caches()
                    else:
                        fill_caches(version)
                    before = pulled_bytes() if mode == "cache" else 0
                    row = cold_start(client, environment, version, f"cold-{repeat}-{mode}")
                    row["pulled_bytes"] = pulled_bytes() - before
                    figures["runs"].append({"repeat": repeat, "mode": mode, **row})
                    print(f"repeat {repeat} {mode:5}: cold start {row['cold_start_s']:.2f} s (admitted "
                          f"{row['admitted_s']:.2f}, started {row['started_s']:.2f}, ready {row['ready_s']:.2f}), "
                          f"pulled {row['pulled_bytes'] / 1e6:.1f} MB", flush=True)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    for mode in ("store", "cache"):
        rows = [{k: v for k, v in run.items() if k not in ("repeat", "mode")} for run in figures["runs"]
                if run["mode"] == mode]
        figures[mode] = summary(rows)
        cold = figures[mode]["cold_start_s"]
        print(f"{mode:5}: cold start median {cold['median']:.2f} s (min {cold['min']:.2f}, max {cold['max']:.2f}), "
              f"ready after the deploy: median {figures[mode]['ready_s']['median']:.2f} s, pulled median "
              f"{figures[mode]['pulled_bytes']['median'] / 1e6:.1f} MB")
    print(f"promotion (copy of {figures['weights_bytes'] / 1e6:.1f} MB into the store): {figures['promote_s']:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    main()
