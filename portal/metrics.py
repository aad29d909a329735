"""``GET /metrics``: the portal's own figures for Prometheus, for staff and the scraper only.

What it shows, and where each figure comes from:

- ``portal_jobs_queued{tenant,flavor}`` and ``portal_gpu_units_allocated{tenant,flavor}``: gauges
  read from the database at each scrape (jobs waiting for the cycle; the units, as the flavor
  counts them, that open attempts hold), so every web process answers the same. Every tenant and
  flavor with a quota is listed, at 0 when nothing is queued or held, so a sum over tenants never
  loses a series.
- ``portal_scheduler_admissions_total{tenant}``, ``portal_scheduler_preemptions_total{tenant}``,
  ``portal_scheduler_cycle_seconds`` (histogram) and ``portal_celery_task_failures_total{task}``:
  counters the worker processes record in Redis (``common.metrics``); ``portal_metrics_store_up``
  says whether that store could be read (0: the counters are missing from this scrape, not zero).
- whatever the apps answer to ``common.metrics.metrics_collect`` (idle GPUs, from usage).

Who may read it: a staff user (API token or session), or Prometheus sending
``Authorization: Bearer <METRICS_SCRAPE_TOKEN>``. No one else: the figures are every tenant's,
so a tenant's own token is a 403, and no credentials a 401.
"""

import hmac
import logging
from collections.abc import Iterator

from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.db.models import Count, F, Sum
from django.http import HttpResponse
from django.utils.cache import add_never_cache_headers
from drf_spectacular.utils import extend_schema
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.permissions import BasePermission
from rest_framework.renderers import JSONRenderer
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from common.metrics import metrics_collect, recorded
from quotas.models import Quota
from runners.jobs.models import JOB_HOLDING_STATES, Job, JobAttempt, JobState

logger = logging.getLogger(__name__)

# What request.auth is when the scrape token authenticated the request (there is no user behind it).
SCRAPER = "metrics-scrape-token"


class ScrapeTokenAuthentication(BaseAuthentication):
    """``Authorization: Bearer <METRICS_SCRAPE_TOKEN>``, compared in constant time.

    A Bearer header is this class's alone (API tokens are sent as ``Token``): a wrong one, or any
    one while no scrape token is set, is a 401 rather than falling through to anonymous.
    """

    def authenticate(self, request):
        words = get_authorization_header(request).split()
        if not words or words[0].lower() != b"bearer":
            return None
        expected = settings.METRICS_SCRAPE_TOKEN.encode()
        if len(words) != 2 or not expected or not hmac.compare_digest(words[1], expected):
            raise AuthenticationFailed("Invalid scrape token.")
        return AnonymousUser(), SCRAPER

    def authenticate_header(self, request) -> str:
        # First among the view's authenticators, so a request with no credentials is a 401 naming Bearer.
        return 'Bearer realm="metrics"'


class StaffOrScraper(BasePermission):
    message = "Only staff and the metrics scraper read /metrics."

    def has_permission(self, request, view) -> bool:
        return request.auth == SCRAPER or bool(request.user and request.user.is_staff)


class AnyAccept(BaseContentNegotiation):
    """Errors are JSON like the rest of the API whatever the scraper accepts; the figures pick their own format."""

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


def _by_tenant_and_flavor(rows, zeros: set[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """(tenant, flavor, figure) rows as a mapping, with a 0 for every pair in ``zeros`` that has no row."""
    figures = dict.fromkeys(zeros, 0)
    for tenant, flavor, value in rows:
        figures[(tenant, flavor)] = int(value or 0)
    return figures


class PortalCollector(Collector):
    """Builds every family at scrape time; nothing is kept between scrapes in the web process."""

    def collect(self) -> Iterator[Metric]:
        yield from self._from_database()
        yield from self._from_store()
        yield from self._from_apps()

    def _from_database(self) -> Iterator[Metric]:
        with_quota = set(Quota.objects.values_list("tenant__slug", "flavor__name"))
        queued = _by_tenant_and_flavor(
            Job.objects.filter(state=JobState.QUEUED).values("tenant__slug", "flavor__name").order_by()
            .annotate(jobs=Count("id")).values_list("tenant__slug", "flavor__name", "jobs"),
            with_quota,
        )
        # One open attempt per holding job (the ownership rule), so summing over attempts counts each job once.
        allocated = _by_tenant_and_flavor(
            JobAttempt.objects.open().filter(job__state__in=JOB_HOLDING_STATES)
            .values("job__tenant__slug", "job__flavor__name").order_by()
            .annotate(units=Sum(F("job__replicas") * F("job__gpus_per_replica")))
            .values_list("job__tenant__slug", "job__flavor__name", "units"),
            with_quota,
        )
        for name, documentation, figures in (
            ("portal_jobs_queued", "Jobs waiting for the scheduler cycle (state queued).", queued),
            ("portal_gpu_units_allocated",
             "GPU units (whole GPUs, MIG instances or time-slice shares, as the flavor counts them) held by open attempts.",
             allocated),
        ):
            family = GaugeMetricFamily(name, documentation, labels=["tenant", "flavor"])
            for (tenant, flavor), value in sorted(figures.items()):
                family.add_metric([tenant, flavor], value)
            yield family

    def _from_store(self) -> Iterator[Metric]:
        counters = recorded()
        yield GaugeMetricFamily(
            "portal_metrics_store_up", "1 when the counters recorded by every process (Redis) could be read.",
            value=int(counters is not None),
        )
        if counters is None:
            return
        for name, documentation, label, figures in (
            ("portal_scheduler_admissions", "Attempts the scheduler cycle admitted.", "tenant", counters.admissions),
            ("portal_scheduler_preemptions", "Jobs the scheduler cycle preempted.", "tenant", counters.preemptions),
            ("portal_celery_task_failures", "Celery task runs that raised (retries not counted).", "task",
             counters.task_failures),
        ):
            family = CounterMetricFamily(name, documentation, labels=[label])
            for key, value in sorted(figures.items()):
                family.add_metric([key], value)
            yield family
        yield HistogramMetricFamily(
            "portal_scheduler_cycle_seconds", "How long one scheduler cycle took.",
            buckets=[(floatToGoString(upper), count) for upper, count in counters.cycle_buckets],
            sum_value=counters.cycle_sum_s,
        )

    def _from_apps(self) -> Iterator[Metric]:
        for receiver, answer in metrics_collect.send_robust(sender=None):
            if isinstance(answer, Exception):
                # One app's broken figures must not cost the scrape everyone else's.
                logger.error("A metrics_collect receiver failed: %r", receiver, exc_info=answer)
                continue
            yield from answer or ()


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(PortalCollector())


@extend_schema(exclude=True)  # Prometheus's text format, like /healthz outside the API's schema
class MetricsView(APIView):
    authentication_classes = [ScrapeTokenAuthentication, *api_settings.DEFAULT_AUTHENTICATION_CLASSES]
    permission_classes = [StaffOrScraper]
    renderer_classes = [JSONRenderer]
    content_negotiation_class = AnyAccept
    throttle_classes = []

    def get(self, request):
        # OpenMetrics when the scraper asks for it (Prometheus does), the classic text format otherwise.
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        response = HttpResponse(encoder(REGISTRY), content_type=content_type)
        add_never_cache_headers(response)
        return response
