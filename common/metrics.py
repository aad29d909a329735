"""The portal's own counters for ``/metrics``, recorded where the work happens, in Redis.

The portal serves from several web processes, and the scheduler cycle and the tasks run in Celery
worker processes, so a counter held in one process's memory would show only that process's share
(and start again at every restart). The counters and the cycle-time histogram live in Redis
instead, one hash per metric: whichever process does the work adds to it (HINCRBY, HINCRBYFLOAT
for the histogram's sum, in one MULTI so a scrape never sees half a cycle), and ``portal.metrics``
reads the hashes when Prometheus scrapes. Gauges (jobs queued, GPUs allocated) are not recorded
here at all: they are read from the database at scrape time.

The store is the broker's Redis (``CELERY_BROKER_URL``), else the cache's (``CACHE_URL``); with
neither (``make run``'s filesystem broker and in-process cache) nothing is recorded and
``/metrics`` shows only the gauges. Keys start with the deployment's queue name (``CELERY_QUEUE``,
one per deployment), so deployments sharing a Redis keep their figures apart.

Recording never fails the work it records: when Redis cannot be reached the write is logged and
dropped, and the counters miss what happened meanwhile (as Prometheus counters may across a restart).

``metrics_collect`` is how an app adds figures only it knows, so that the app owns them and
``/metrics`` need not know each app: ``portal.metrics`` sends it at every scrape, and each receiver
(connected in the app's ``receivers.py``) answers an iterable of prometheus-client metric families
(``prometheus_client.core.GaugeMetricFamily`` and the like), computed from the database or another
shared store, never from one process's memory. Idle GPUs by tenant are expected from the usage app
this way; the portal reports no idle figure of its own.
"""

import functools
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import redis
from django.conf import settings
from django.dispatch import Signal
from redis.backoff import NoBackoff
from redis.retry import Retry

logger = logging.getLogger(__name__)

# Answered by the apps above with metric families to add to a scrape (see the module's docstring).
metrics_collect = Signal()

# Upper bounds (seconds) of the scheduler cycle's histogram; +Inf is added after them. A cycle
# takes milliseconds on an idle cluster and seconds with thousands of queued gangs.
CYCLE_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# How long one write may wait for Redis: a cycle or a task waits at most this for its figures.
STORE_TIMEOUT_S = 0.5

ADMISSIONS = "admissions"  # attempts admitted by the cycle, by tenant
PREEMPTIONS = "preemptions"  # jobs preempted by the cycle, by tenant
CYCLE_SECONDS = "cycle_seconds"  # the cycle's duration: a count per bucket, and "sum"
TASK_FAILURES = "task_failures"  # task runs that raised, by task name
_SUM = "sum"


def store_url() -> str | None:
    """The Redis the counters live in, or None when the portal runs without one."""
    for url in (settings.CELERY_BROKER_URL, settings.CACHE_URL):
        if url.startswith(("redis://", "rediss://")):
            return url
    return None


@functools.lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    # No retries: a store that is down costs one refused connection per write, not a backoff.
    return redis.Redis.from_url(
        url, socket_connect_timeout=STORE_TIMEOUT_S, socket_timeout=STORE_TIMEOUT_S, retry=Retry(NoBackoff(), 0)
    )


def _key(metric: str) -> str:
    return f"{settings.CELERY_TASK_DEFAULT_QUEUE}:metrics:{metric}"


def _bucket_field(upper_s: float) -> str:
    return repr(upper_s)


def _write(what: str, add: Callable[[redis.client.Pipeline], None]) -> None:
    url = store_url()
    if url is None:
        return
    try:
        pipe = _client(url).pipeline(transaction=True)
        add(pipe)
        pipe.execute()
    except Exception as exc:  # redis ConnectionError, TimeoutError, socket errors...: never the caller's failure
        logger.warning("Could not record %s in the metrics store; going on without it: %s", what, exc)


def cycle_recorded(*, duration_s: float, admitted: Mapping[str, int], preempted: Mapping[str, int]) -> None:
    """Count one committed scheduler cycle: its duration, and the attempts admitted and jobs preempted by tenant."""
    upper = next((bound for bound in CYCLE_SECONDS_BUCKETS if duration_s <= bound), math.inf)

    def add(pipe: redis.client.Pipeline) -> None:
        for tenant, count in admitted.items():
            pipe.hincrby(_key(ADMISSIONS), tenant, count)
        for tenant, count in preempted.items():
            pipe.hincrby(_key(PREEMPTIONS), tenant, count)
        pipe.hincrby(_key(CYCLE_SECONDS), _bucket_field(upper), 1)
        pipe.hincrbyfloat(_key(CYCLE_SECONDS), _SUM, duration_s)

    _write("a scheduler cycle", add)


def task_failed(task_name: str) -> None:
    """Count one task run that raised (Celery's task_failure: retries are not failures, their last one is)."""
    _write(f"a failure of {task_name}", lambda pipe: pipe.hincrby(_key(TASK_FAILURES), task_name, 1))


@dataclass(frozen=True)
class Recorded:
    """What every process has recorded so far."""

    admissions: dict[str, int]
    preemptions: dict[str, int]
    task_failures: dict[str, int]
    # Cumulative counts of cycles at or under each bound, +Inf last (so its count is every cycle).
    cycle_buckets: list[tuple[float, int]]
    cycle_sum_s: float


def recorded() -> Recorded | None:
    """The counters as the store holds them now; None when there is no store or it cannot be read."""
    url = store_url()
    if url is None:
        return None
    try:
        pipe = _client(url).pipeline(transaction=True)
        for metric in (ADMISSIONS, PREEMPTIONS, TASK_FAILURES, CYCLE_SECONDS):
            pipe.hgetall(_key(metric))
        admissions, preemptions, failures, cycles = (
            {field.decode(): value for field, value in answer.items()} for answer in pipe.execute()
        )
    except Exception as exc:  # as in _write: a scrape without the counters, never a failed scrape
        logger.warning("Could not read the metrics store: %s", exc)
        return None
    buckets, seen = [], 0
    for upper in (*CYCLE_SECONDS_BUCKETS, math.inf):
        seen += int(cycles.get(_bucket_field(upper), 0))
        buckets.append((upper, seen))
    return Recorded(
        admissions={tenant: int(value) for tenant, value in admissions.items()},
        preemptions={tenant: int(value) for tenant, value in preemptions.items()},
        task_failures={name: int(value) for name, value in failures.items()},
        cycle_buckets=buckets,
        cycle_sum_s=float(cycles.get(_SUM, 0.0)),
    )
