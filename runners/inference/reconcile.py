"""The endpoints' reconcile: read every replica, record a sample, autoscale, roll out, drain, and say where each stands.

One pass at a time, cluster-wide (a session-level advisory lock; a pass started while another
runs returns at once, skipped). First, outside any transaction, every endpoint's running replicas
are read together, ENDPOINT_PROBE_CONCURRENCY at once: each one's address (a backend read) and its
server's /readyz and /metrics (HTTP, ENDPOINT_PROBE_TIMEOUT_S each), so hung replicas cost about
one timeout, not one each. Then, endpoint by endpoint, under the endpoint's row lock, what follows
from them: the replicas' readiness, a sample for the page,
the autoscaler's decision (recorded with its reason when it changes anything), the replicas to
start or retire, and the endpoint's state. A replica is retired by cancelling its job with the
grace period: its server gets SIGTERM and answers everything it admitted before it exits.

Rollouts and scale-in keep the ready count at the wanted number: a replica of the old generation
is retired only once a new one is ready in its place, one at a time.
"""

from __future__ import annotations

import logging
import math
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from django.conf import settings
from django.db import transaction
from django.db.models import F, Sum
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from common.errors import TooMany
from common.locks import one_pass_at_a_time
from quotas.models import Quota
from runners.backends import engines
from runners.backends.base import BackendError
from runners.clusters.registry import get_backend
from runners.environments.models import EnvironmentState
from runners.inference import autoscale
from runners.inference.models import (
    EndpointSample,
    EndpointState,
    InferenceEndpoint,
    Replica,
    ScaleEvent,
)
from runners.inference.services import replica_retire, replica_start, set_state
from runners.jobs import services as jobs
from runners.jobs.attempts import open_attempts
from runners.jobs.models import JOB_FINAL_STATES, JOB_HOLDING_STATES, Job, JobState

logger = logging.getLogger(__name__)

# A replica whose server has not answered /readyz (a timeout, or the connection refused) this many passes in a row
# is not ready: a hung server leaves the router's choices, while one slow answer on a busy machine does not.
MISSES_BEFORE_NOT_READY = 2
# pg_try_advisory_lock's key for the pass: "endpts" in ASCII.
PASS_LOCK_KEY = 0x656E64707473
# How long a rollout's new replica may wait for capacity before an old replica makes way for it.
ROLLOUT_SURGE_WAIT_S = 60.0
# Samples older than this are deleted as the reconcile goes (the page shows the last hour).
SAMPLE_KEEP_S = 24 * 3600


@dataclass
class Probe:
    """What one replica's server said: ready or not, and its counters."""

    ready: bool = False
    queue: int = 0
    running: int = 0
    counts: dict = field(default_factory=dict)  # outcome -> total
    buckets: list = field(default_factory=list)  # [(le as text, cumulative count)] of serve_request_seconds
    kv_cache_use: float | None = None  # a foreign engine's KV-cache use, 0..1 (None: the shipped server, or unknown)


def probe(address: str, engine: str = engines.SHIPPED) -> Probe | None:
    """The engine's health route (/readyz for the shipped server, /health for vLLM, TGI and SGLang) and /metrics
    of one replica; None when it does not answer (a timeout, the connection refused)."""
    found = Probe()
    timeout_s = settings.ENDPOINT_PROBE_TIMEOUT_S
    try:
        with urllib.request.urlopen(f"{address}{engines.health_path(engine)}", timeout=timeout_s) as answer:
            found.ready = answer.status == 200
    except urllib.error.HTTPError:
        found.ready = False
    except (OSError, ValueError):
        return None
    try:
        with urllib.request.urlopen(f"{address}{engines.metrics_path(engine)}", timeout=timeout_s) as answer:
            text = answer.read().decode()
    except (OSError, ValueError):
        return found
    if engine != engines.SHIPPED:
        # The engine's own Prometheus names, through its adapter: running, waiting, KV-cache use.
        try:
            signals = engines.read_metrics(engine, text)
        except ValueError:
            return found
        found.queue, found.running, found.kv_cache_use = signals.waiting, signals.running, signals.kv_cache_use
        return found
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "serve_queue_depth":
                found.queue = int(sample.value)
            elif sample.name == "serve_running_sequences":
                found.running = int(sample.value)
            elif sample.name == "serve_requests_total":
                found.counts[sample.labels["outcome"]] = sample.value
            elif sample.name == "serve_front_refused_total":
                found.counts[f"front_{sample.labels['reason']}"] = sample.value
            elif sample.name == "serve_request_seconds_bucket":
                found.buckets.append((sample.labels["le"], sample.value))  # "+Inf" stays a string: JSON has no inf
    return found


def _quantile_ms(buckets: list[tuple[str, float]], q: float) -> float | None:
    """The q-quantile of a histogram's cumulative buckets (le, count), in ms: the bucket's upper bound."""
    buckets = sorted((float(upper), count) for upper, count in buckets)
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    for upper, count in buckets:
        if count >= q * total:
            return None if math.isinf(upper) else upper * 1000.0
    return None


# What one replica read: (its address, its server's probe or None when it did not answer, whether it was asked).
Read = tuple[str, Probe | None, bool]


def _engine(replica: Replica) -> str:
    """The engine a replica runs, as its job's spec says ("shipped" for one from before engines)."""
    return (replica.job.spec.get("serving") or {}).get("engine") or engines.SHIPPED


def _read_one(backend, replica: Replica, attempt_number: int) -> Read:
    try:
        address = backend.serving_address(replica.job_id, attempt_number, namespace=replica.job.environment.namespace)
    except BackendError as exc:
        # Where it answers is unknown this time (the API unreachable): that says nothing of the replica.
        logger.warning("Could not read where replica %s of %s answers: %s", replica.id, replica.endpoint_id, exc)
        return "", None, False
    if not address:
        return "", Probe(ready=False), True
    return address, probe(address, _engine(replica)), True


def _read_replicas(endpoints: list[int], backend) -> dict[int, dict[int, Read]]:
    """{endpoint id: {replica id: read}} of these endpoints' running replicas, read together (at most
    ENDPOINT_PROBE_CONCURRENCY at once); outside any transaction. The probes touch no database."""
    replicas = list(Replica.objects.filter(endpoint_id__in=endpoints, retiring=False, job__state=JobState.RUNNING)
                    .select_related("job__environment"))
    attempts = open_attempts([replica.job for replica in replicas])
    asked = [(replica, attempts[replica.job_id].number) for replica in replicas if replica.job_id in attempts]
    read: dict[int, dict[int, Read]] = {endpoint_id: {} for endpoint_id in endpoints}
    if not asked:
        return read
    with ThreadPoolExecutor(max_workers=min(len(asked), settings.ENDPOINT_PROBE_CONCURRENCY),
                            thread_name_prefix="endpoint-probe") as pool:
        found = list(pool.map(lambda item: _read_one(backend, *item), asked))
    for (replica, _), one in zip(asked, found):
        read[replica.endpoint_id][replica.id] = one
    return read


def _sample(endpoint: InferenceEndpoint, read: dict, ready_ids: set[int], now) -> EndpointSample:
    """The endpoint's sample from this pass's probes; counters become rates against the last pass's totals."""
    memory = endpoint.autoscale_state
    previous = memory.get("totals", {})
    previous_at = memory.get("totals_at")
    totals, answered, shed, expired = {}, 0.0, 0.0, 0.0
    bucket_delta: dict[str, float] = {}
    queue = running = 0
    kv_uses = []
    for replica_id, (_, found, _asked) in read.items():
        if found is None:
            continue
        if replica_id in ready_ids:
            queue += found.queue
            running += found.running
            if found.kv_cache_use is not None:
                kv_uses.append(found.kv_cache_use)
        before = previous.get(str(replica_id), {})
        counts = found.counts
        totals[str(replica_id)] = {"counts": counts, "buckets": found.buckets}
        if not before:
            continue  # a replica first seen: its counts so far are not this interval's
        delta = {key: max(0.0, value - before["counts"].get(key, 0.0)) for key, value in counts.items()}
        answered += delta.get("answered", 0.0)
        shed += delta.get("shed", 0.0)
        expired += delta.get("expired", 0.0)
        earlier = dict(before.get("buckets", []))
        for upper, count in found.buckets:
            bucket_delta[upper] = bucket_delta.get(upper, 0.0) + max(0.0, count - earlier.get(upper, 0.0))
    elapsed = max(1e-3, now.timestamp() - previous_at) if previous_at else None
    memory["totals"] = totals
    memory["totals_at"] = now.timestamp()
    buckets = sorted(bucket_delta.items())
    return EndpointSample(
        endpoint=endpoint, at=now, ready_replicas=len(ready_ids), queue_depth=queue, running=running,
        requests_per_s=(answered + shed + expired) / elapsed if elapsed else 0.0,
        shed_per_s=shed / elapsed if elapsed else 0.0, expired_per_s=expired / elapsed if elapsed else 0.0,
        p50_ms=_quantile_ms(buckets, 0.5), p99_ms=_quantile_ms(buckets, 0.99),
        kv_cache_use=sum(kv_uses) / len(kv_uses) if kv_uses else None,
    )


def policy() -> autoscale.Policy:
    return autoscale.Policy(
        target_inflight=settings.ENDPOINT_TARGET_INFLIGHT, scale_in_after_s=settings.ENDPOINT_SCALE_IN_AFTER_S,
        idle_after_s=settings.ENDPOINT_IDLE_AFTER_S,
        kv_cache_high=getattr(settings, "ENDPOINT_KV_CACHE_HIGH", autoscale.Policy.kv_cache_high),
    )


def _autoscale(endpoint: InferenceEndpoint, sample: EndpointSample, now) -> None:
    memory = endpoint.autoscale_state
    since_request = (now - endpoint.last_request_at).total_seconds() if endpoint.last_request_at else math.inf
    load = autoscale.Load(
        at_s=now.timestamp(), inflight=sample.queue_depth + sample.running,
        shed_per_s=sample.shed_per_s + sample.expired_per_s, since_last_request_s=since_request,
        kv_cache_use=sample.kv_cache_use,
    )
    bounds = autoscale.Bounds(endpoint.min_replicas, endpoint.max_replicas, endpoint.warm_replicas)
    wanted, why, memory["history"] = autoscale.decide(
        memory.get("history", []), load, bounds, policy(), current=endpoint.desired_replicas,
        last_change_s=memory.get("last_change_at"),
    )
    if wanted != endpoint.desired_replicas:
        ScaleEvent.objects.create(endpoint=endpoint, from_replicas=endpoint.desired_replicas, to_replicas=wanted,
                                  reason=why)
        endpoint.desired_replicas = wanted
        memory["last_change_at"] = now.timestamp()


def _non_preemptible_units(endpoint: InferenceEndpoint) -> int:
    held = Job.objects.filter(
        tenant=endpoint.tenant, flavor=endpoint.flavor, preemptible=False, state__in=JOB_HOLDING_STATES + [JobState.QUEUED]
    )
    return held.aggregate(units=Sum(F("replicas") * F("gpus_per_replica")))["units"] or 0


def _set_preemptible(replica: Replica, value: bool) -> bool:
    """Move a replica's job into or out of the guarantee through the jobs app (under its row lock); True if done."""
    if not jobs.job_preemptible_set(replica.job_id, value):
        return False
    replica.job.preemptible = value
    replica.job.spec["preemptible"] = value
    return True


def _failed_to_start(endpoint: InferenceEndpoint, replicas: list[Replica]) -> list[Replica]:
    """Replicas of the current generation whose jobs failed (past their retries) without ever being ready: a
    replica that served and later failed is replaced, never counted against the endpoint."""
    return [r for r in replicas if r.generation == endpoint.generation and r.job.state == JobState.FAILED
            and r.ready_since is None]


def _replicas(endpoint: InferenceEndpoint, stopping: bool) -> str:
    """Start and retire replicas towards the wanted number, one at a time where a rollout replaces them.
    Returns why a replica that should start did not ("" if none)."""
    replicas = list(endpoint.replicas.select_related("job").order_by("slot", "id"))
    live = [r for r in replicas if not r.retiring and r.job.state not in JOB_FINAL_STATES]
    current = [r for r in live if r.generation == endpoint.generation]
    stale = [r for r in live if r.generation != endpoint.generation]
    desired = 0 if stopping else endpoint.desired_replicas
    failed = _failed_to_start(endpoint, replicas)
    ready = [r for r in live if r.ready]
    # A generation whose replicas fail to start starts nothing more until a rollout asks for another.
    blocked = bool(failed) and not any(r.ready for r in current) and len(failed) >= endpoint.max_replicas

    # The rows this pass may write, locked in the order every writer takes them: the quota's (a
    # promotion), the tenant's then the environment's (a start, as a submit and an environment's
    # delete take them), then the replicas' jobs, in id order (as the cycle takes them).
    promoting = [r for r in current if r.job.preemptible and r.slot < endpoint.min_replicas
                 and not any(old.slot == r.slot for old in stale)]
    guaranteed = None
    if promoting:
        # The quota's row, locked: two endpoints of one tenant reconciled at once never both promote.
        quota = Quota.objects.select_for_update().filter(tenant=endpoint.tenant, flavor=endpoint.flavor).first()
        guaranteed = (quota.guaranteed if quota else 0) - _non_preemptible_units(endpoint)
    starting = len(current) < desired and not blocked
    if starting:
        # Read again under its lock (as a submit does), so no replica slips into an environment being deleted.
        environment = jobs.queue_locks(endpoint.tenant, endpoint.environment)
        blocked = environment is None or environment.state != EnvironmentState.READY
    fresh = jobs.jobs_locked(r.job_id for r in live)
    for replica in live:
        replica.job = fresh.get(replica.job_id, replica.job)

    # Preemptibility follows the slot: below min_replicas a replica is never preempted. A replica
    # started beside its slot's old one (a rollout) borrows until that one is gone, then is promoted
    # if the tenant's guarantee holds it. The jobs app re-checks the job's state under its row lock.
    for replica in current:
        want = replica.slot >= endpoint.min_replicas
        if replica in promoting and replica.job.preemptible:
            if guaranteed >= replica.job.units and _set_preemptible(replica, False):
                guaranteed -= replica.job.units
        elif not replica.job.preemptible and want:
            _set_preemptible(replica, True)

    # Start what is missing; during a rollout only one new replica is starting at a time. Each replica's
    # job is queued by the jobs app's rules (the tenant's budget of waiting jobs among them).
    refused = ""
    while starting and len(current) < desired and not blocked:
        if stale and any(not r.ready for r in current):
            break
        used = {r.slot for r in current}
        slot = next(n for n in range(endpoint.max_replicas + len(current) + 1) if n not in used)
        stale_here = any(r.slot == slot for r in stale)
        try:
            replica = replica_start(endpoint, slot, "the endpoint wants " + (
                f"{desired} replicas." if not stale else f"generation {endpoint.generation} (rollout)."),
                borrowing=stale_here)  # borrows until the old one of its slot is gone
        except TooMany as exc:
            refused = f"A replica waits to be queued: {exc}"
            break
        current.append(replica)

    # Retire: stale replicas as soon as they are not serving, or once enough new ones are ready;
    # current ones beyond the wanted number, those not serving first, the highest slot first.
    for replica in stale:
        if not replica.ready or stopping:
            replica_retire(replica, f"Replaced by generation {endpoint.generation}." if not stopping else endpoint.reason)
            ready = [r for r in ready if r.id != replica.id]
    # How long a new replica has waited for the cycle to admit it (starting up once admitted is not waiting).
    waited_s = max([(timezone.now() - r.created_at).total_seconds() for r in current
                    if r.job.state == JobState.QUEUED], default=0.0)
    for replica in [r for r in stale if not r.retiring]:
        if len(ready) - 1 >= min(desired, len(ready)) and any(r.ready for r in current):
            replica_retire(replica, f"Replaced by generation {endpoint.generation}: draining.")
            ready = [r for r in ready if r.id != replica.id]
            break  # one at a time: the next once another new replica is ready
        if waited_s > ROLLOUT_SURGE_WAIT_S:
            # No room for one more (the tenant at its max, nothing idle to borrow): one old replica makes way,
            # draining first, so the rollout goes on one unavailable at a time instead of waiting forever.
            replica_retire(replica, f"Making room for generation {endpoint.generation}: its new replica waited "
                                    f"{waited_s:.0f} s for capacity. Draining.")
            ready = [r for r in ready if r.id != replica.id]
            break
    extra = len(current) - desired
    if extra > 0:
        # Slots from min_replicas up go first, so the replicas that stay are the non-preemptible ones; then those
        # not serving; then the highest slot.
        order = sorted(current, key=lambda r: (r.slot < endpoint.min_replicas, r.ready, -r.slot))
        for replica in order[:extra]:
            if replica.ready and len(ready) - 1 < desired:
                continue
            reason = "Stopping: draining." if stopping else f"Scale in to {desired}: draining."
            replica_retire(replica, reason)
            ready = [r for r in ready if r.id != replica.id]
    return refused


def _state(endpoint: InferenceEndpoint, stopping: bool, refused: str = "") -> None:
    """The endpoint's state and reason from its replicas; ``refused``: why a replica could not be started."""
    replicas = list(endpoint.replicas.select_related("job"))
    holding = [r for r in replicas if r.job.state not in JOB_FINAL_STATES]
    if stopping:
        if holding:
            set_state(endpoint, EndpointState.DRAINING, f"Draining {len(holding)} replica(s): each answers what it "
                                                        f"admitted, then ends.")
        else:
            set_state(endpoint, EndpointState.STOPPED, endpoint.reason if endpoint.state == EndpointState.STOPPED
                      else "Stopped: every replica drained.")
        return
    current = [r for r in holding if r.generation == endpoint.generation and not r.retiring]
    ready = [r for r in current if r.ready]
    failed = _failed_to_start(endpoint, replicas)
    desired = endpoint.desired_replicas
    if failed and not ready and len(failed) >= endpoint.max_replicas:
        newest = max(failed, key=lambda r: r.id)
        set_state(endpoint, EndpointState.FAILED, f"Its replicas fail to start: {newest.job.reason}")
    elif not endpoint.replicas.filter(ready_since__isnull=False).exists() and desired > 0:
        waiting = refused or next((r.job.reason for r in current if r.job.state == JobState.QUEUED), "")
        set_state(endpoint, EndpointState.DEPLOYING,
                  f"Starting {desired} replica(s)." + (f" {waiting}" if waiting else ""))
    elif len(ready) == desired and len(holding) == len(current):
        set_state(endpoint, EndpointState.READY, f"{len(ready)} replica(s) ready." if desired else
                  "Scaled to zero: the next request starts a replica.")
    else:
        rolling = any(r.generation != endpoint.generation for r in holding)
        what = f"rolling out generation {endpoint.generation}" if rolling else f"scaling to {desired}"
        set_state(endpoint, EndpointState.SCALING, f"{len(ready)} of {desired} replica(s) ready, {what}."
                  + (f" {refused}" if refused else ""))


def endpoint_reconcile(endpoint_id: int, backend=None, *, now=None, read: dict[int, Read] | None = None) -> str:
    """One endpoint's step; `read` is what the pass read of its replicas (read here when not given)."""
    backend = backend or get_backend()
    endpoint = InferenceEndpoint.objects.select_related("tenant", "environment").get(id=endpoint_id)
    if endpoint.state == EndpointState.STOPPED:
        return "stopped"
    now = now or timezone.now()  # when this pass's read started: its sample's time
    if read is None:
        read = _read_replicas([endpoint_id], backend)[endpoint_id]
    with transaction.atomic():
        endpoint = InferenceEndpoint.objects.select_for_update(of=("self",), skip_locked=True).filter(
            id=endpoint_id).select_related("tenant", "environment", "flavor").first()
        if endpoint is None:
            return "busy"
        if endpoint.autoscale_state.get("totals_at", 0) >= now.timestamp():
            return "busy"  # a pass that read after this one has already written: this one's reads are older
        if endpoint.stop_requested_at is None and endpoint.environment.state != EnvironmentState.READY:
            endpoint.stop_requested_at = now
            endpoint.reason = f"Environment {endpoint.environment.name} is {endpoint.environment.state}."
            ScaleEvent.objects.create(endpoint=endpoint, from_replicas=endpoint.desired_replicas, to_replicas=0,
                                      reason=endpoint.reason)
            endpoint.desired_replicas = 0
        stopping = endpoint.stop_requested_at is not None
        ready_ids = set()
        misses = endpoint.autoscale_state.get("misses", {})  # replica id -> passes in a row its server did not answer
        endpoint.autoscale_state["misses"] = {}
        for replica in endpoint.replicas.filter(retiring=False):
            if replica.id in read:
                address, found, asked = read[replica.id]
                if found is not None:
                    ready = found.ready
                elif asked:
                    # Its server did not answer /readyz: once may be a busy machine; MISSES_BEFORE_NOT_READY passes
                    # in a row is a hung (or gone) server, no longer ready, so the router stops choosing it.
                    missed = misses.get(str(replica.id), 0) + 1
                    endpoint.autoscale_state["misses"][str(replica.id)] = missed
                    ready = replica.ready and missed < MISSES_BEFORE_NOT_READY
                else:
                    ready = replica.ready  # where it answers could not be read (the API unreachable): no news
            else:
                address, ready = "", False  # its job is not running
            changed = {"ready": ready, "address": address or replica.address}
            if ready and replica.ready_since is None:
                changed["ready_since"] = now
            Replica.objects.filter(id=replica.id).update(**changed)
            if ready:
                ready_ids.add(replica.id)
        sample = _sample(endpoint, read, ready_ids, now)
        sample.save()
        EndpointSample.objects.filter(endpoint=endpoint, at__lt=now - timezone.timedelta(seconds=SAMPLE_KEEP_S)).delete()
        if not stopping:
            _autoscale(endpoint, sample, now)
        endpoint.save(update_fields=["autoscale_state", "desired_replicas", "stop_requested_at", "reason"])
        refused = _replicas(endpoint, stopping)
        _state(endpoint, stopping, refused)
        return endpoint.state


def endpoints_reconcile_run() -> dict:
    """One pass over every endpoint not stopped; one failing never blocks the rest.

    Returns the count of each endpoint's outcome, or ``{"skipped": "busy"}`` when another pass runs.
    """
    with one_pass_at_a_time(PASS_LOCK_KEY, "endpoints reconcile") as held:
        if not held:
            logger.info("Endpoints reconcile skipped: another pass runs.")
            return {"skipped": "busy"}
        backend = get_backend()
        endpoints = list(InferenceEndpoint.objects.exclude(state=EndpointState.STOPPED).values_list("id", flat=True))
        now = timezone.now()  # when this pass's read started: its samples' time
        read = _read_replicas(endpoints, backend)
        outcomes: dict[str, int] = {}
        for endpoint_id in endpoints:
            try:
                outcome = endpoint_reconcile(endpoint_id, backend, now=now, read=read[endpoint_id])
            except Exception:  # noqa: BLE001 - one endpoint's failure is logged, the others go on
                logger.exception("Reconciling endpoint %s failed", endpoint_id)
                outcome = "error"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        return outcomes
