"""Chaos for the job path: backends whose every call takes a random while, and a driver of random operations.

Backends (picked through CLUSTER_BACKEND_FACTORY, as ``tests.support.backends`` are), configured by
environment variables so that every worker process builds the same one:

- ``chaos_quick_jobs``: ``QuickJobs`` (timers in place of trainers) whose calls each sleep a random
  0..CHAOS_MAX_DELAY_MS ms first, from an RNG seeded by CHAOS_SEED and CHAOS_ROLE (one role per
  process), whose replicas "run" CHAOS_STEP_S per step, and whose replicas die with their node as
  real ones do (``set_node_down``).
- ``chaos_local``: the real local backend (real trainer processes) with the same delays.

CHAOS_LAUNCH_DELAY_S adds a fixed pause to every launch_job (after the replicas were started when
CHAOS_LAUNCH_DELAY_AFTER is true, before otherwise): a launch a test can kill a worker in.

``ChaosRun`` drives real workers with random submits (several tenants with guarantees and
borrowing, over whole, MIG and time-sliced flavors), cancels, environment deletes (and new
environments in their place) and lost nodes (that come back), from a seeded RNG, and runs
``tests.support.invariants.check`` every ``check_every_s`` from a thread of its own. ``drain``
then cancels what is left and waits for every job to end. The test
(tests/jobs/test_job_chaos.py) and the bench (bench/jobs_chaos.py) share it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from runners.backends.base import AttemptStatus, PermanentBackendError
from runners.backends.kubernetes import KubernetesBackend
from runners.backends.local import LocalBackend
from runners.clusters.registry import local_backend_options
from tests.support.backends import QuickJobs

FACTORY_QUICK = "tests.support.chaos.chaos_quick_jobs"
FACTORY_KUBERNETES = "tests.support.chaos.chaos_kubernetes"


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name) or default)


class _Delays:
    """Every backend call first sleeps a random 0..CHAOS_MAX_DELAY_MS ms (a seeded RNG per process)."""

    def _chaos_setup(self) -> None:
        seed = os.environ.get("CHAOS_SEED", "0")
        role = os.environ.get("CHAOS_ROLE", "main")
        self._chaos_rng = random.Random(f"{seed}:{role}")
        self._chaos_lock = threading.Lock()
        self.max_delay_s = _env_float("CHAOS_MAX_DELAY_MS", 0) / 1000
        self.launch_delay_s = _env_float("CHAOS_LAUNCH_DELAY_S", 0)
        self.launch_delay_after = os.environ.get("CHAOS_LAUNCH_DELAY_AFTER", "false").lower() in ("1", "true", "yes")

    def _pause(self) -> None:
        if self.max_delay_s:
            with self._chaos_lock:
                delay = self._chaos_rng.uniform(0, self.max_delay_s)
            time.sleep(delay)

    def launch_job(self, launch):
        self._pause()
        if self.launch_delay_s and not self.launch_delay_after:
            time.sleep(self.launch_delay_s)
        resumed = super().launch_job(launch)
        if self.launch_delay_s and self.launch_delay_after:
            time.sleep(self.launch_delay_s)
        return resumed

    def job_status(self, job_id, attempt):
        self._pause()
        return super().job_status(job_id, attempt)

    def stop_job(self, job_id, attempt, *, grace_period_s):
        self._pause()
        return super().stop_job(job_id, attempt, grace_period_s=grace_period_s)

    def kill_job(self, job_id, attempt):
        self._pause()
        return super().kill_job(job_id, attempt)

    def forget_job(self, job_id, attempt):
        self._pause()
        return super().forget_job(job_id, attempt)

    def jobs_open(self, attempts):
        self._pause()
        return super().jobs_open(attempts)

    def job_progress(self, job_id, attempt, cursor):
        self._pause()
        return super().job_progress(job_id, attempt, cursor)

    def ensure_environment(self, spec):
        self._pause()
        return super().ensure_environment(spec)

    def delete_environment(self, spec):
        self._pause()
        return super().delete_environment(spec)

    def discover_inventory(self):
        self._pause()
        return super().discover_inventory()


class NodeAwareQuickJobs(QuickJobs):
    """QuickJobs whose replicas die with their node, as real processes do (LocalBackend.set_node_down)."""

    def _down(self) -> set[str]:
        with self._state(write=False) as state:
            return set(state.get("down", []))

    def launch_job(self, launch):
        if self._read(launch.job_id, launch.attempt) is None:
            nodes = sorted({replica.node for replica in launch.replicas})
            lost = sorted(set(nodes) & self._down())
            if lost:
                raise PermanentBackendError(f"Node {', '.join(lost)} is down.")
            self._write(launch.job_id, launch.attempt, {
                "started": time.time(), "duration": launch.steps * self.QUICK_STEP_S,
                "ranks": [replica.rank for replica in launch.replicas], "nodes": nodes, "end": None,
            })
        return None

    def job_status(self, job_id, attempt):
        record = self._read(job_id, attempt)
        if record is not None and record["end"] is None and set(record.get("nodes", [])) & self._down():
            self._end(job_id, attempt, "node_lost")
            record = self._read(job_id, attempt)
        if record is not None and record["end"] == "node_lost":
            return AttemptStatus("lost", reason=f"Node {', '.join(record['nodes'])} was lost.", node_lost=True)
        return super().job_status(job_id, attempt)

    def set_node_down(self, node_name: str, down: bool = True) -> None:
        super().set_node_down(node_name, down)
        if not down:
            return
        for path in self.jobs.jobs_dir.glob("*/attempts/*/quick.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if node_name in record.get("nodes", []) and record.get("end") is None:
                self._end(int(path.parent.parent.parent.name), int(path.parent.name), "node_lost")


class ChaosQuickJobs(_Delays, NodeAwareQuickJobs):
    """NodeAwareQuickJobs with delays and CHAOS_STEP_S-long steps."""

    def __init__(self, **options):
        super().__init__(**options)
        self._chaos_setup()
        self.QUICK_STEP_S = _env_float("CHAOS_STEP_S", 0.05)


def chaos_quick_jobs() -> LocalBackend:
    return ChaosQuickJobs(**local_backend_options())


class ChaosKubernetes(_Delays, KubernetesBackend):
    """The Kubernetes backend (against the stand-in, in tests), every call delayed."""


def chaos_kubernetes() -> KubernetesBackend:
    from django.conf import settings

    from runners.clusters.registry import kubernetes_backend_options

    backend = ChaosKubernetes.from_kubeconfig(in_cluster=False, kubeconfig=settings.KUBECONFIG,
                                              **kubernetes_backend_options())
    backend._chaos_setup()
    backend.min_sync_interval_s = 0  # every status read syncs the pod watch
    return backend


# --- The clusters the driver plays ---------------------------------------------------------


class LocalCluster:
    """The local backend's cluster: a node is lost through its state file, and jobs run by themselves."""

    factory = FACTORY_QUICK

    def inspected(self):
        """What invariants.check reads for its rule 2 (processes outliving their attempt)."""
        from runners.clusters.registry import get_backend

        return get_backend()

    def lose(self, node: str) -> None:
        from runners.clusters.registry import get_backend

        get_backend().set_node_down(node)

    def restore(self, node: str) -> None:
        from runners.clusters.registry import get_backend

        get_backend().set_node_down(node, False)

    def tick(self) -> None:
        """Nothing to play: QuickJobs' replicas end by themselves."""


class StandInCluster:
    """The Kubernetes API stand-in: the driver plays the trainers (a pod exits 0 once its job's steps are done),
    and a lost node goes with its pods, as the pod garbage collector removes them."""

    factory = FACTORY_KUBERNETES

    def __init__(self, api, step_s: float):
        self.api, self.step_s = api, step_s
        self.running_since: dict[tuple[str, str], float] = {}  # (job id, attempt) -> first seen running
        self.durations: dict[str, float] = {}

    def inspected(self):
        return self.api

    def lose(self, node: str) -> None:
        self.api.delete("nodes", node)
        for pod in self.api.pods():
            if pod["spec"].get("nodeName") == node:
                with contextlib.suppress(KeyError):  # gone meanwhile
                    self.api.delete("pods", pod["metadata"]["name"], pod["metadata"]["namespace"])

    def restore(self, node: str) -> None:
        from tests.support.k8s import gpu_node

        self.api.put(gpu_node(node))

    def tick(self) -> None:
        from runners.backends.job_manifests import ATTEMPT_LABEL, JOB_LABEL
        from runners.jobs.models import Job

        now = time.monotonic()
        for pod in self.api.pods():
            metadata, status = pod["metadata"], pod.get("status") or {}
            if status.get("phase") != "Running" or metadata.get("deletionTimestamp"):
                continue
            labels = metadata.get("labels") or {}
            job_id, attempt = labels.get(JOB_LABEL), labels.get(ATTEMPT_LABEL)
            if job_id is None:
                continue
            if job_id not in self.durations:
                steps = Job.objects.filter(id=int(job_id)).values_list("spec__steps", flat=True).first() or 0
                self.durations[job_id] = steps * self.step_s
            since = self.running_since.setdefault((job_id, attempt), now)
            if now - since >= self.durations[job_id]:
                with contextlib.suppress(KeyError):  # gone meanwhile
                    self.api.finish_pod(metadata["namespace"], metadata["name"], 0)


# --- The driver -----------------------------------------------------------------------------

# Tenants: (guaranteed, max) per flavor kind; the guarantees of each flavor fit its capacity
# (16 H100s, 32 T4 shares, 8 A100 1g.5gb slices) and every tenant may borrow past its own.
TENANTS = {
    "alpha": {"whole": (6, 16), "timeslice": (8, 24), "mig": (4, 8)},
    "beta": {"whole": (4, 12), "timeslice": (8, 16)},
    "gamma": {"whole": (4, 8), "mig": (2, 8)},
    "delta": {"whole": (0, 8), "timeslice": (0, 16), "mig": (0, 4)},
}
# How often the driver picks each operation (relative weights). "redeliver" sends a launch or stop
# message again, as a broker redelivers one; "cycle_here" and "reconcile_here" run a scheduler
# cycle or a reconcile pass in the driver's own process, beside the workers' own.
OPERATIONS = {"submit": 60, "cancel": 14, "redeliver": 5, "cycle_here": 2, "reconcile_here": 2}
# The rarer operations come at random intervals (seconds, from the seeded RNG) instead: an
# environment deleted, a node lost (it comes back after ChaosSettings.node_down_s), and (only when
# the run is given its workers) a worker SIGKILLed and another started in its place.
EVERY_S = {"environment_delete": (5.0, 12.0), "node_loss": (8.0, 16.0), "worker_kill": (20.0, 40.0)}


@dataclass
class ChaosSettings:
    seed: int = 1
    max_delay_ms: float = 40
    step_s: float = 0.05
    grace_period_s: int = 3
    launch_lease_s: float = 3
    launch_resend_after_s: float = 2
    mean_gap_s: float = 0.12  # between two operations of the driver
    check_every_s: float = 0.5
    stuck_after_s: float = 30
    slack_s: float = 5
    node_down_s: tuple[float, float] = (2.0, 8.0)
    # The operations' weights and the rarer ones' intervals (OPERATIONS and EVERY_S unless given): a short
    # run (tests/jobs/test_job_chaos.py) brings the rarer ones sooner, so that it still runs every kind.
    operations: dict[str, float] = field(default_factory=lambda: dict(OPERATIONS))
    every_s: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(EVERY_S))
    # When the first of a rarer operation comes (seconds from the start), where not its every_s interval.
    first_s: dict[str, tuple[float, float]] = field(default_factory=dict)
    # When > 0, every owed_every-th operation is one of the kinds in ``operations`` the run has not yet done
    # (one that found nothing to do stays owed), so that a short run does each kind at least once.
    owed_every: int = 0

    def worker_env(self, role: str, factory: str = FACTORY_QUICK) -> dict[str, str]:
        """What a worker process needs (on top of tests.support.worker.worker_environment)."""
        return {
            "CLUSTER_BACKEND_FACTORY": factory, "CHAOS_SEED": str(self.seed), "CHAOS_ROLE": role,
            "CHAOS_MAX_DELAY_MS": str(self.max_delay_ms), "CHAOS_STEP_S": str(self.step_s),
            "PREEMPTION_GRACE_PERIOD_S": str(self.grace_period_s), "JOB_LAUNCH_LEASE_S": str(self.launch_lease_s),
            "JOB_LAUNCH_RESEND_AFTER_S": str(self.launch_resend_after_s), "SCHEDULER_CYCLE_INTERVAL_S": "1",
            "JOB_RECONCILE_INTERVAL_S": "0.5", "INVENTORY_SYNC_INTERVAL_S": "5", "SWEEP_INTERVAL_S": "5",
            "STUCK_AFTER_S": "10",
        }


class Workers:
    """The run's Celery worker processes (tests.support.worker.WorkerProcess), the first with beat."""

    def __init__(self, config: ChaosSettings, log_dir, *, count: int = 2, factory: str = FACTORY_QUICK, **env):
        self.config, self.log_dir, self.factory = config, log_dir, factory
        self.count, self.started, self.live, self.env = count, 0, [], env

    def _start(self, *, beat: bool):
        from tests.support.worker import WorkerProcess

        self.started += 1
        role = f"worker-{self.started}"
        worker = WorkerProcess(self.log_dir / f"{role}.log", beat=beat,
                               **{**self.config.worker_env(role, self.factory), **self.env})
        self.live.append(worker)
        return worker.start()

    def start(self) -> "Workers":
        from tests.support.worker import purge_queue

        purge_queue()  # nothing an earlier test left queued
        for index in range(self.count):
            self._start(beat=index == 0)
        return self

    def kill_one(self, rng: random.Random) -> None:
        """SIGKILL one worker (its pool, and its beat if it runs one) and start another like it."""
        victim = rng.choice(self.live)
        victim.kill()
        victim.stop()
        self.live.remove(victim)
        self._start(beat=victim.beat)

    def stop(self) -> None:
        for worker in self.live:
            worker.stop()
        self.live = []

    def logs(self) -> str:
        return "\n".join(path.read_text(errors="replace") for path in sorted(self.log_dir.glob("worker-*.log")))


@dataclass
class _Tenancy:
    slug: str
    user: object
    quotas: dict[str, tuple[object, int, int]]  # flavor kind -> (flavor, guaranteed, max)
    environments_made: int = 0


@dataclass
class ChaosRun:
    """One seeded run; ``setup``, then ``run`` (the chaos), then ``drain``; ``counts`` and ``violations`` say what happened."""

    config: ChaosSettings
    cluster: LocalCluster | StandInCluster = field(default_factory=LocalCluster)
    # The run's workers, when it may SIGKILL one and start another in its place; None: workers are left alone.
    workers: Workers | None = None
    log: object = print
    counts: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    submitted: list[int] = field(default_factory=list)
    failure_reasons: Counter = field(default_factory=Counter)

    def setup(self) -> None:
        from django.contrib.auth import get_user_model

        from quotas.models import ResourceFlavor
        from tenants.models import Membership, Tenant
        from tests.support import invariants
        from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

        self.rng = random.Random(self.config.seed)
        demo_cluster_with_flavors()
        by_kind = {
            "whole": ResourceFlavor.objects.filter(name="h100-80gb").first(),
            "timeslice": ResourceFlavor.objects.filter(kind="timeslice", gpu_model="T4").first(),
            "mig": ResourceFlavor.objects.filter(kind="mig", mig_profile="1g.5gb").first(),
        }  # the kinds the cluster has: all three in the demo cluster, H100s only on the stand-in
        self.tenants: dict[str, _Tenancy] = {}
        for slug, quotas in TENANTS.items():
            tenant = Tenant.objects.create(slug=f"chaos-{slug}", name=slug.title())
            user = get_user_model().objects.create_user(f"chaos-{slug}-owner", password="x")
            Membership.objects.create(tenant=tenant, user=user, role="owner")
            tenancy = _Tenancy(slug=tenant.slug, user=user, quotas={})
            for kind, (guaranteed, cap) in quotas.items():
                if by_kind[kind] is None:
                    continue
                give_quota(tenant, by_kind[kind], guaranteed=guaranteed, max=cap, max_priority=100)
                tenancy.quotas[kind] = (by_kind[kind], guaranteed, cap)
            for _ in range(2):
                tenancy.environments_made += 1
                ready_environment(actor=user, tenant=tenant, name=f"env-{tenancy.environments_made}")
            self.tenants[slug] = tenancy
        self.nodes = sorted(node.name for node in self._node_rows())
        self.down: dict[str, float] = {}  # node -> when it comes back (monotonic)
        self.baseline = invariants.baseline()

    @staticmethod
    def _node_rows():
        from runners.clusters.models import Node

        return Node.objects.all()

    # --- The operations ----------------------------------------------------------------

    def _submit(self) -> None:
        from common.errors import Invalid, TooMany
        from runners.environments.models import Environment, EnvironmentState
        from runners.jobs import services as jobs

        rng = self.rng
        tenancy = self.tenants[rng.choice(sorted(self.tenants))]
        environments = list(Environment.objects.filter(tenant__slug=tenancy.slug, state=EnvironmentState.READY)
                            .order_by("id"))
        if not environments:
            self.counts["submit_no_environment"] += 1
            return
        environment = rng.choice(environments)
        kind = rng.choice(sorted(tenancy.quotas))
        flavor, guaranteed, cap = tenancy.quotas[kind]
        if kind == "whole":
            replicas = rng.choice([1, 1, 1, 2, 2, 4])
            gpus = rng.choice([g for g in (1, 1, 2, 4) if replicas * g <= cap] or [1])
            topology = rng.choice([{"level": "none", "mode": "preferred"}, {"level": "node", "mode": "required"},
                                   {"level": "node", "mode": "preferred"}])
        else:
            replicas, gpus = rng.choice([1, 1, 2, 3]), 1
            topology = {"level": "none", "mode": "preferred"}
        units = replicas * gpus
        preemptible = units > guaranteed or rng.random() < 0.75
        data = {
            "tenant": tenancy.slug, "environment": environment.id, "name": f"chaos-{len(self.submitted)}",
            "template": "pytorch-ddp", "replicas": replicas, "flavor": flavor.name, "gpus_per_replica": gpus,
            "cpu_milli_per_replica": 1000, "memory_mib_per_replica": 2048, "topology": topology,
            "priority": rng.randint(0, 30), "preemptible": preemptible, "steps": rng.randint(10, 400),
            "checkpoint_every_steps": 0, "max_runtime_s": 900, "max_retries": 2,
        }
        try:
            job = jobs.job_submit(actor=tenancy.user, data=data)
        except Invalid as exc:
            self.counts[f"submit_refused_{getattr(exc, 'field', 'invalid')}"] += 1
            return
        except TooMany:
            self.counts["submit_refused_too_many"] += 1
            return
        self.submitted.append(job.id)
        self.counts["submit"] += 1

    def _cancel(self) -> None:
        from common.errors import Conflict
        from runners.jobs import services as jobs
        from runners.jobs.models import JOB_FINAL_STATES, Job

        candidates = list(Job.objects.filter(tenant__slug__startswith="chaos-").exclude(state__in=JOB_FINAL_STATES)
                          .order_by("id").values_list("id", flat=True))
        if not candidates:
            return
        job = Job.objects.select_related("tenant").get(id=self.rng.choice(candidates))
        tenancy = next(t for t in self.tenants.values() if t.slug == job.tenant.slug)
        before = job.state
        try:
            jobs.job_cancel(actor=tenancy.user, job=job)
        except Conflict:
            self.counts["cancel_late"] += 1
            return
        self.counts["cancel"] += 1
        self.counts[f"cancel_of_{before}"] += 1

    def _environment_delete(self) -> None:
        from runners.environments import services as environments
        from runners.environments.models import Environment, EnvironmentState

        ready = list(Environment.objects.filter(tenant__slug__startswith="chaos-", state=EnvironmentState.READY)
                     .select_related("tenant").order_by("id"))
        if not ready:
            return
        environment = self.rng.choice(ready)
        tenancy = next(t for t in self.tenants.values() if t.slug == environment.tenant.slug)
        holding = environment.jobs.exclude(state__in=["succeeded", "failed", "cancelled"]).count()
        environments.environment_delete(actor=tenancy.user, environment=environment)
        self.counts["environment_delete"] += 1
        self.counts["environment_delete_jobs_cancelled"] += holding
        # The tenant asks for a new one in its place (a worker provisions it).
        tenancy.environments_made += 1
        environments.environment_request(actor=tenancy.user, tenant=environment.tenant,
                                         name=f"env-{tenancy.environments_made}")
        self.counts["environment_request"] += 1

    def _node_loss(self) -> None:
        from runners.clusters.services import inventory_sync

        if self.down:
            return  # one node lost at a time
        node = self.rng.choice(self.nodes)
        self.cluster.lose(node)
        self.down[node] = time.monotonic() + self.rng.uniform(*self.config.node_down_s)
        self.counts["node_loss"] += 1
        if self.rng.random() < 0.5:
            inventory_sync()  # an operator's sync right away; otherwise the beat's or the reconcile's
            self.counts["inventory_sync"] += 1

    def _nodes_back(self, *, all_now: bool = False) -> None:
        from runners.clusters.services import inventory_sync

        for node, back_at in list(self.down.items()):
            if all_now or time.monotonic() >= back_at:
                self.cluster.restore(node)
                del self.down[node]
                inventory_sync()
                self.counts["node_back"] += 1

    def _redeliver(self) -> None:
        from common.dispatch import send_task
        from runners.jobs.models import JOB_HOLDING_STATES, JobAttempt
        from runners.jobs.tasks import job_launch, job_stop

        attempts = list(JobAttempt.objects.filter(ended_at__isnull=True, job__state__in=JOB_HOLDING_STATES)
                        .order_by("id").values_list("job_id", "number", "job__state"))
        if not attempts:
            return
        job_id, number, state = self.rng.choice(attempts)
        if state in ("preempted", "cancelling") or self.rng.random() < 0.3:
            send_task(job_stop.name, job_id)
            self.counts["redeliver_stop"] += 1
        else:
            send_task(job_launch.name, job_id, number)
            self.counts["redeliver_launch"] += 1

    def _cycle_here(self) -> None:
        from runners.scheduling.services import cycle_run

        cycle_run()
        self.counts["cycle_here"] += 1

    def _reconcile_here(self) -> None:
        from runners.jobs.reconcile import jobs_reconcile_run

        jobs_reconcile_run()
        self.counts["reconcile_here"] += 1

    def _worker_kill(self) -> None:
        if self.workers is None:
            return
        self.workers.kill_one(self.rng)
        self.counts["worker_kill"] += 1

    # --- The checker ----------------------------------------------------------------------

    def _checker(self, stop: threading.Event) -> None:
        from django.db import connection

        try:
            while not stop.wait(self.config.check_every_s):
                try:
                    self.check_now()
                except Exception as exc:  # the harness's own trouble: reported, never silent
                    self.violations.append(f"the check itself failed: {type(exc).__name__}: {exc}")
                    self.log(self.violations[-1])
        finally:
            connection.close()

    def check_now(self, *, stuck_after_s: float | None = None) -> list[str]:
        from tests.support import invariants

        found = invariants.check(
            self.cluster.inspected(),
            stuck_after_s=self.config.stuck_after_s if stuck_after_s is None else stuck_after_s,
            slack_s=self.config.slack_s, baseline=self.baseline,
        )
        self.counts["checks"] += 1
        for violation in found:
            if violation not in self.violations:
                self.violations.append(violation)
                self.log(f"VIOLATION: {violation}")
        return found

    # --- Running ---------------------------------------------------------------------

    def run(self, seconds: float, *, until=None, max_seconds: float | None = None) -> None:
        """Random operations for this long, the checker running beside them; with ``until`` (a callable, asked
        at most once a second), on past ``seconds`` until it answers true, for ``max_seconds`` at most."""
        stop = threading.Event()
        checker = threading.Thread(target=self._checker, args=(stop,), name="invariants", daemon=True)
        checker.start()
        names, weights = zip(*self.config.operations.items())
        every_s = self.config.every_s
        started = time.monotonic()
        deadline = started + seconds
        due = {name: started + self.rng.uniform(*self.config.first_s.get(name, every)) for name, every in every_s.items()}
        last_report = started
        picked = 0
        hard_deadline = started + max(seconds, max_seconds or 0)
        asked_at, met = 0.0, until is None

        def going() -> bool:
            nonlocal asked_at, met
            now = time.monotonic()
            if now < deadline:
                return True
            if met or now >= hard_deadline:
                return False
            if now - asked_at >= 1:
                asked_at, met = now, bool(until())
            return not met

        try:
            while going():
                self._nodes_back()
                self.cluster.tick()
                operation = self.rng.choices(names, weights)[0]
                picked += 1
                if self.config.owed_every and picked % self.config.owed_every == 0:
                    owed = [name for name in names if not self.done(name)]
                    if owed:
                        operation = self.rng.choice(owed)
                for name, at in due.items():
                    if time.monotonic() >= at:
                        operation = name
                        due[name] = time.monotonic() + self.rng.uniform(*every_s[name])
                        break
                getattr(self, f"_{operation}")()
                time.sleep(self.rng.uniform(0, 2 * self.config.mean_gap_s))
                if time.monotonic() - last_report > 30:
                    last_report = time.monotonic()
                    self.log(f"chaos: {dict(sorted(self.counts.items()))}")
        finally:
            stop.set()
            checker.join()

    def done(self, operation: str) -> int:
        """How many times the run did this kind of operation (either redelivery counts for "redeliver")."""
        if operation == "redeliver":
            return self.counts["redeliver_launch"] + self.counts["redeliver_stop"]
        return self.counts[operation]

    def drain(self, timeout_s: float = 120) -> dict[str, int]:
        """Nodes back, everything left cancelled; wait until every job is final, then check once more."""
        from common.errors import Conflict
        from runners.jobs import services as jobs
        from runners.jobs.models import JOB_FINAL_STATES, Job

        self._nodes_back(all_now=True)
        deadline = time.monotonic() + timeout_s
        while True:
            left = list(Job.objects.exclude(state__in=JOB_FINAL_STATES).select_related("tenant").order_by("id"))
            if not left:
                break
            if time.monotonic() > deadline:
                from tests.support.invariants import describe

                self.violations.append(f"{len(left)} jobs not final {timeout_s}s after the drain began:\n"
                                       + describe([job.id for job in left[:10]]))
                break
            for job in left:
                if job.state == "cancelling":
                    continue
                tenancy = next(t for t in self.tenants.values() if t.slug == job.tenant.slug)
                try:
                    jobs.job_cancel(actor=tenancy.user, job=job)
                    self.counts["drain_cancel"] += 1
                except Conflict:
                    pass
            self.cluster.tick()
            self.check_now()
            time.sleep(0.5)
        # What ended last must be gone from the backend too, past the grace period.
        time.sleep(self.config.grace_period_s + self.config.slack_s + 0.5)
        self.check_now(stuck_after_s=0)
        return self.summary()

    def summary(self) -> dict[str, int]:
        from django.db.models import Count

        from runners.jobs.models import Job, JobAttempt

        outcomes = dict(JobAttempt.objects.values_list("outcome").annotate(n=Count("id")))
        self.counts["attempts"] = sum(outcomes.values())
        for outcome, n in outcomes.items():
            self.counts[f"attempt_{outcome or 'open'}"] = n
        self.counts["preempted_for_guarantee"] = JobAttempt.objects.filter(
            outcome="preempted", reason__startswith="Preempted for job"
        ).count()
        for state, n in Job.objects.values_list("state").annotate(n=Count("id")):
            self.counts[f"job_{state}"] = n
        # Why attempts failed, for the report (digits folded, so alike reasons count together).
        self.failure_reasons = Counter(
            re.sub(r"\d+", "N", reason)[:120] for reason in
            JobAttempt.objects.filter(outcome="failed").values_list("reason", flat=True)
        )
        return dict(sorted(self.counts.items()))
