"""Endpoint pages: a tenant's inference endpoints, the deploy form, and one endpoint's page that follows it live,
with its replicas, scale events, charts of what the replicas reported, the owner's controls and a "try it" box."""

import re
from datetime import timedelta

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Count, Max, Q
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from common.errors import Conflict
from common.numbers import whole_number
from frontend import charts
from frontend.forms import EndpointForm, EndpointRolloutForm, EndpointScaleForm
from frontend.job_views import _flavor_rows, redirect_next
from runners.environments import selectors as environment_selectors
from runners.environments.models import EnvironmentState
from runners.inference import services as endpoints
from runners.inference.models import EndpointState
from runners.inference.selectors import endpoint_get, endpoint_list
from runners.jobs import selectors as job_selectors
from runners.jobs.attempts import open_attempts
from runners.jobs.models import JOB_FINAL_STATES, Checkpoint, Job
from runners.usage import pages as usage_pages
from tenants import selectors
from tenants.models import Role

CHART_WIDTH, CHART_HEIGHT, CHART_POINTS = 600, 160, 300
SAMPLES_SHOWN = timedelta(hours=1)
SCALE_EVENTS_SHOWN = 20
SOURCE_JOBS_OFFERED = 200
# The charts of the endpoint page: (test id, heading, unit, [(sample field, legend, stroke or "" for the default)]).
CHARTS = [
    ("chart-requests", "Request rate", "requests/s", [("requests_per_s", "requests/s", "")]),
    ("chart-latency", "Latency", "ms", [("p50_ms", "p50", ""), ("p99_ms", "p99", "#c2410c")]),
    ("chart-queue", "Queue depth", "requests", [("queue_depth", "queued", "")]),
    ("chart-shed", "Shed rate", "requests/s", [("shed_per_s", "shed (429)", "#b42318"),
                                               ("expired_per_s", "expired (504)", "#7c3aed")]),
]


def _source_jobs(user, tenant) -> list[dict]:
    """The tenant's servable training jobs, newest first, each labelled with its newest checkpoint."""
    jobs = (job_selectors.job_list(user=user, tenant=tenant.slug).filter(kind=Job.Kind.TRAINING,
                                                                        spec__template="pytorch-ddp")
            .annotate(newest_step=Max("checkpoints__step")).order_by("-id")[:SOURCE_JOBS_OFFERED])
    return [
        {"id": job.id, "name": job.name, "label": f"{job.name} #{job.id}: "
         + (f"newest checkpoint step {job.newest_step}" if job.newest_step is not None else "no checkpoint yet")}
        for job in jobs
    ]


def _can_change(user, tenant) -> bool:
    # Which controls to show; the services decide again on submit.
    return selectors.user_has_role(user=user, tenant=tenant, at_least=Role.MEMBER)


def _number(value) -> int | None:
    return whole_number(value, max_digits=9)


# --- Charts ---------------------------------------------------------------------------


def sample_chart(samples: list, lines: list[tuple[str, str, str]]) -> dict | None:
    """SVG polylines of sample fields over time (at most CHART_POINTS points), drawn as the job page draws its loss
    curve; None before there are two samples with a value. The value axis starts at zero."""
    stride = max(1, len(samples) // CHART_POINTS)
    sampled = samples[::stride]
    if sampled and sampled[-1] is not samples[-1]:
        sampled.append(samples[-1])
    drawn = [(field, legend, stroke, [(s.at, getattr(s, field)) for s in sampled if getattr(s, field) is not None])
             for field, legend, stroke in lines]
    if sum(len(points) for *_, points in drawn) < 2:
        return None
    times = [at for *_, points in drawn for at, _ in points]
    first, last = min(times), max(times)
    span = (last - first).total_seconds()
    high = max((value for *_, points in drawn for _, value in points), default=0) or 1.0

    def x(at):
        return 40 + (CHART_WIDTH - 50) * ((at - first).total_seconds() / span if span > 0 else 1)

    def y(value):
        return 10 + (CHART_HEIGHT - 30) * (high - value) / high

    series = []
    for field, legend, stroke, points in drawn:
        latest = points[-1][1] if points else None
        series.append({
            "field": field, "legend": legend, "stroke": stroke, "latest": latest,
            "points": " ".join(f"{x(at):.1f},{y(value):.1f}" for at, value in points),
        })
    return {"width": CHART_WIDTH, "height": CHART_HEIGHT, "high": high, "first": first, "last": last,
            "series": series, "count": len(samples)}


def _charts(endpoint) -> list[dict]:
    samples = list(endpoint.samples.filter(at__gte=timezone.now() - SAMPLES_SHOWN).order_by("at"))
    charts = []
    for test_id, heading, unit, lines in CHARTS:
        chart = sample_chart(samples, lines)
        if chart is not None:
            peak = f"{chart['high']:.4g}"
            latest = ", ".join(f"{s['legend']} {s['latest']:.4g}" for s in chart["series"] if s["latest"] is not None)
            chart["label"] = f"{heading} over the last hour, in {unit}: peak {peak}; latest {latest}"
        charts.append({"test_id": test_id, "heading": heading, "unit": unit, "chart": chart})
    return charts


# --- The endpoint page ---------------------------------------------------------------


def _replicas(endpoint) -> list[dict]:
    """The replicas still running or starting, each with where it runs (its open attempt's placement)."""
    live = [r for r in endpoint.replicas.select_related("job", "model_version").order_by("slot", "id")
            if r.job.state not in JOB_FINAL_STATES]
    attempts = open_attempts([r.job for r in live])
    rows = []
    for replica in live:
        attempt = attempts.get(replica.job_id)
        placement = attempt.placement[0] if attempt and attempt.placement else {}
        rows.append({"replica": replica, "job": replica.job, "node": placement.get("node"),
                     "gpus": placement.get("gpus", [])})
    return rows


def _usage(endpoint) -> dict:
    """Its replicas' GPUs over the last hour (as its load charts), its cost so far and per 1,000 requests."""
    now = timezone.now()
    span = (now - SAMPLES_SHOWN, now)
    replicas = {replica.job_id: replica for replica in endpoint.replicas.select_related("job")}
    utilization = usage_pages.replica_utilization(list(replicas), *span)
    # A replica is a job of one replica: its slot and job name say which (and the attempt, once preempted).
    labels = {(r["job"], r["attempt"], r["rank"]): f"slot {replicas[r['job']].slot} · {replicas[r['job']].job.name}"
              + (f" attempt {r['attempt']}" if r["attempt"] > 1 else "") for r in utilization["replicas"]}
    return {
        "readings": {**charts.replica_charts(utilization, labels, span), "bucket_label": utilization["bucket_label"]},
        "costs": usage_pages.endpoint_cost(endpoint, now),
        "requests": usage_pages.endpoint_requests(endpoint),
    }


def _live_context(request, endpoint) -> dict:
    replicas = _replicas(endpoint)
    return {
        "usage": _usage(endpoint),
        "endpoint": endpoint,
        "replicas": replicas,
        "ready_count": sum(1 for row in replicas if row["replica"].ready and not row["replica"].retiring),
        "scale_events": list(endpoint.scale_events.all()[:SCALE_EVENTS_SHOWN]),
        "charts": _charts(endpoint),
        "final": endpoint.state == EndpointState.STOPPED,
    }


def _render_endpoint(request, endpoint, *, scale_form=None, rollout_form=None, status=200):
    can_change = _can_change(request.user, endpoint.tenant) and endpoint.stop_requested_at is None
    bounds = endpoints.BOUNDS
    path = reverse("endpoint-generate", args=[endpoint.tenant.slug, endpoint.name])
    context = {
        **_live_context(request, endpoint),
        "url": request.build_absolute_uri(path),
        "generate_path": path,
        "can_change": can_change,
        "can_try": endpoint.stop_requested_at is None,
        "scale_form": scale_form or EndpointScaleForm(prefix="scale", bounds=bounds, initial={
            "min_replicas": endpoint.min_replicas, "max_replicas": endpoint.max_replicas,
            "warm_replicas": endpoint.warm_replicas}),
        "rollout_form": rollout_form or EndpointRolloutForm(
            prefix="rollout", source_jobs=_source_jobs(request.user, endpoint.tenant),
            initial={"job": endpoint.source_job_id}),
    }
    return render(request, "frontend/endpoint_detail.html", context, status=status)


@login_required
@require_GET
def endpoint_detail(request, endpoint_id):
    return _render_endpoint(request, endpoint_get(user=request.user, endpoint_id=endpoint_id))


@never_cache
@login_required
@require_GET
def endpoint_live(request, endpoint_id):
    """The live part of the endpoint page, polled until the endpoint has stopped."""
    endpoint = endpoint_get(user=request.user, endpoint_id=endpoint_id)
    return render(request, "frontend/endpoint_live.html", _live_context(request, endpoint))


def _act(request, endpoint, action, success: str, *, states: str = ""):
    """Run `action`; `states` (space-separated) are the endpoint states the success message describes:
    live.js drops it once the page's badge shows none of them."""
    try:
        action()
    except PermissionDenied as exc:
        messages.error(request, f"Could not change {endpoint.name}: {exc}")
    except Conflict as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, success, extra_tags=f"state:{states}" if states else "")
    return redirect_next(request, "endpoint", endpoint_id=endpoint.id)


@login_required
@require_POST
def endpoint_scale(request, endpoint_id):
    endpoint = endpoint_get(user=request.user, endpoint_id=endpoint_id)
    form = EndpointScaleForm(request.POST, prefix="scale", bounds=endpoints.BOUNDS)
    if form.is_valid():
        try:
            return _act(request, endpoint, lambda: endpoints.endpoint_scale(
                actor=request.user, endpoint=endpoint, data=dict(form.cleaned_data)),
                f"Scaling {endpoint.name} between {form.cleaned_data['min_replicas']} and "
                f"{form.cleaned_data['max_replicas']} replicas.")
        except ValidationError as exc:
            form.add_endpoint_errors(exc)
    return _render_endpoint(request, endpoint, scale_form=form, status=400)


@login_required
@require_POST
def endpoint_rollout(request, endpoint_id):
    endpoint = endpoint_get(user=request.user, endpoint_id=endpoint_id)
    form = EndpointRolloutForm(request.POST, prefix="rollout", source_jobs=_source_jobs(request.user, endpoint.tenant))
    if form.is_valid():
        try:
            return _act(request, endpoint, lambda: endpoints.endpoint_rollout(
                actor=request.user, endpoint=endpoint, data={"source": form.source()}),
                f"Rolling {endpoint.name} out to a new checkpoint: its replicas are replaced one at a time.")
        except ValidationError as exc:
            form.add_endpoint_errors(exc)
    return _render_endpoint(request, endpoint, rollout_form=form, status=400)


@login_required
@require_POST
def endpoint_stop(request, endpoint_id):
    endpoint = endpoint_get(user=request.user, endpoint_id=endpoint_id)
    return _act(request, endpoint, lambda: endpoints.endpoint_stop(actor=request.user, endpoint=endpoint),
                f"Stopping {endpoint.name}: its replicas answer what they admitted, then end.",
                states=EndpointState.DRAINING)


# --- The list and the deploy form ----------------------------------------------------


@login_required
@require_GET
def endpoint_list_page(request, slug):
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    rows = list(endpoint_list(user=request.user, tenant=tenant).annotate(
        ready_count=Count("replicas", filter=Q(replicas__ready=True, replicas__retiring=False)))[:200])
    return render(request, "frontend/endpoint_list.html", {
        "tenant": tenant, "endpoints": rows, "can_deploy": _can_change(request.user, tenant),
    })


def _endpoint_name(job_name: str) -> str:
    """A job's name made into an endpoint's: as long as endpoint names may be, ending alphanumeric."""
    name = job_name[: endpoints.NAME_MAX].rstrip("-")
    return name if re.fullmatch(endpoints.NAME_PATTERN, name) else ""


@login_required
@require_http_methods(["GET", "POST"])
def endpoint_deploy(request, slug):
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    ready = environment_selectors.environment_list(user=request.user, tenant=tenant, state=EnvironmentState.READY)
    flavors = _flavor_rows(tenant)
    source_jobs = _source_jobs(request.user, tenant)
    options = {"environments": ready, "flavors": flavors, "source_jobs": source_jobs, "bounds": endpoints.BOUNDS,
               "name_max": endpoints.NAME_MAX}
    status = 200
    if request.method == "POST":
        form = EndpointForm(request.POST, **options)
        if form.is_valid():
            try:
                endpoint = endpoints.endpoint_deploy(actor=request.user, data=form.endpoint_data(tenant.slug))
            except PermissionDenied as exc:
                form.add_error(None, str(exc))
            except ValidationError as exc:
                form.add_endpoint_errors(exc)
            else:
                messages.success(request, f"Deploying {endpoint.name}: its replicas start in a moment.",
                                 extra_tags=f"state:{EndpointState.DEPLOYING}")
                return redirect("endpoint", endpoint_id=endpoint.id)
        status = 400
    else:
        form = EndpointForm(initial=_prefill(request, tenant, source_jobs, ready, flavors), **options)
    return render(request, "frontend/endpoint_new.html", {
        "tenant": tenant, "form": form, "can_deploy": _can_change(request.user, tenant), "flavors": flavors,
        "has_environment": ready.exists(), "has_source": bool(source_jobs),
    }, status=status)


def _prefill(request, tenant, source_jobs, ready, flavors) -> dict:
    """?job=<id>&step=<n> (the job page's "Serve this checkpoint"): that job, its step, name, environment, flavor."""
    initial = {}
    job_id, step = _number(request.GET.get("job")), _number(request.GET.get("step"))
    job = None
    if job_id is not None and any(row["id"] == job_id for row in source_jobs):
        job = Job.objects.filter(id=job_id, tenant=tenant).first()
    if job is None:
        return initial
    initial.update(job=job.id, name=_endpoint_name(job.name))
    if step is not None and Checkpoint.objects.filter(job=job, step=step).exists():
        initial["step"] = step
    if ready.filter(id=job.environment_id).exists():
        initial["environment"] = job.environment_id
    if any(row["name"] == job.flavor.name for row in flavors):
        initial["flavor"] = job.flavor.name
    return initial
