"""Job pages: a tenant's jobs with the submit form, and one job's page that follows it live."""

import json
import re
import shlex
from datetime import timedelta
from decimal import Decimal

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from common.errors import Conflict, NotFound
from common.numbers import whole_number
from frontend import charts
from frontend.filters import JobPageFilter, page_list
from frontend.forms import JobForm
from quotas import selectors as quota_selectors
from runners.bundles.models import Bundle
from runners.environments import selectors as environment_selectors
from runners.environments.models import EnvironmentState
from runners.inference.models import Replica
from runners.jobs import selectors as job_selectors
from runners.jobs import services as jobs
from runners.jobs.api import log_file_response
from runners.jobs.models import JOB_FINAL_STATES, Job, JobState
from runners.usage import pages as usage_pages
from tenants import selectors
from tenants.models import Role

CHART_WIDTH, CHART_HEIGHT, CHART_POINTS = 600, 180, 300
PER_STEP = Decimal("0.0001")


def _flavor_rows(tenant) -> list[dict]:
    """The tenant's flavors, each with what its quota leaves now."""
    usage = job_selectors.tenant_flavor_usage(tenant=tenant)
    rows = []
    for quota in quota_selectors.tenant_quotas(tenant=tenant):
        used = usage.get(quota.flavor_id, 0)
        left = max(0, quota.max - used)
        rows.append({
            "name": quota.flavor.name, "guaranteed": quota.guaranteed, "max": quota.max, "used": used, "left": left,
            "label": f"{quota.flavor.name}: {left} of {quota.max} left ({used} in use, {quota.guaranteed} guaranteed)",
        })
    return sorted(rows, key=lambda row: row["name"])


# The bundle picker offers the tenant's newest bundles, at most this many.
BUNDLE_CHOICES = 100


def _bundles(tenant) -> list:
    """The tenant's kept bundles, newest first: what the submit form's picker offers."""
    return list(Bundle.objects.filter(tenant=tenant, deleted_at__isnull=True).order_by("-created_at", "-id")
                [:BUNDLE_CHOICES])


def _render_jobs(request, tenant, form=None, *, status=200, source=None):
    can_submit = selectors.user_has_role(user=request.user, tenant=tenant, at_least=Role.MEMBER)
    ready = environment_selectors.environment_list(user=request.user, tenant=tenant, state=EnvironmentState.READY)
    flavors = _flavor_rows(tenant)
    bundles = _bundles(tenant)
    jobs_page = page_list(request, JobPageFilter,
                          job_selectors.job_list(user=request.user, tenant=tenant.slug).prefetch_related("attempts"))
    now = timezone.now()
    rows = [{"job": job, "durations": job_selectors.job_durations(job, list(job.attempts.all()), now)}
            for job in jobs_page.page]
    context = {
        "tenant": tenant,
        "jobs": rows,
        "list": jobs_page,
        "can_submit": can_submit,
        "flavors": flavors,
        "form": form or JobForm(environments=ready, flavors=flavors, bundles=bundles),
        "bundles": bundles,
        "has_environment": ready.exists(),
        "source": source,
    }
    if jobs_page.errors and status == 200:
        status = 400
    return render(request, "frontend/jobs.html", context, status=status)


@login_required
@require_GET
def job_list(request, slug):
    return _render_jobs(request, selectors.tenant_get(user=request.user, slug=slug))


def clone_name(name: str) -> str:
    """A name for a copy: llm -> llm-2, llm-2 -> llm-3, within the name's length limit."""
    found = re.fullmatch(r"(.*)-(\d+)", name)
    base, number = (found.group(1), int(found.group(2)) + 1) if found else (name, 2)
    suffix = f"-{number}"
    return base[: jobs.NAME_MAX - len(suffix)].rstrip("-") + suffix


def clone_initial(job: Job) -> dict:
    """The submit form filled from a job's spec, so it can be submitted again as it was (or changed)."""
    spec = job.spec
    topology = spec.get("topology") or {}
    initial = {field: spec[field] for field in ("cpu_milli_per_replica", "memory_mib_per_replica", "steps",
                                                "checkpoint_every_steps", "max_runtime_s", "max_retries")
               if spec.get(field) is not None}
    initial.update(
        name=clone_name(job.name), environment=job.environment_id, flavor=job.flavor.name, replicas=job.replicas,
        gpus_per_replica=job.gpus_per_replica, priority=job.priority, preemptible=job.preemptible,
        topology_level=topology.get("level", "none"), topology_mode=topology.get("mode", jobs.DEFAULT_TOPOLOGY_MODE),
        template=spec.get("template", "pytorch-ddp"),
    )
    if spec.get("template") == "script":
        # The command one argument per line, as the form takes it back; the hyperparameters as JSON.
        initial.update(bundle=spec.get("bundle") or "", command="\n".join(spec.get("command") or ()),
                       hyperparameters=json.dumps(spec.get("hyperparameters") or {}, indent=2, sort_keys=True))
    return initial


def can_clone(job: Job) -> bool:
    """The submit form runs the shipped trainer or a script from a bundle: only such training jobs can be
    filled into it (a custom image's job is the API's)."""
    return job.kind == Job.Kind.TRAINING and job.spec.get("template") in ("pytorch-ddp", "script")


@login_required
@require_http_methods(["GET", "POST"])
def job_submit(request, slug):
    """POST submits the form; GET ?from=<job id> shows it filled from that job (Clone on the job page)."""
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    ready = environment_selectors.environment_list(user=request.user, tenant=tenant, state=EnvironmentState.READY)
    if request.method == "GET":
        source = None
        if request.GET.get("from"):
            source = job_selectors.job_get(user=request.user, job_id=request.GET["from"])
            if source.tenant_id != tenant.id or not can_clone(source):
                raise NotFound("No such job to clone in this tenant.")
        flavors = _flavor_rows(tenant)
        initial = clone_initial(source) if source else None
        return _render_jobs(request, tenant, JobForm(initial=initial, environments=ready, flavors=flavors,
                                                     bundles=_bundles(tenant)), source=source)
    form = JobForm(request.POST, environments=ready, flavors=_flavor_rows(tenant), bundles=_bundles(tenant))
    if form.is_valid():
        try:
            job = jobs.job_submit(actor=request.user, data=form.job_data(tenant.slug))
        except PermissionDenied as exc:
            form.add_error(None, str(exc))
        except ValidationError as exc:
            form.add_job_errors(exc)
        else:
            messages.success(request, f"Submitted {job.name}; the scheduler decides in a moment.")
            return redirect("job", job_id=job.id)
    return _render_jobs(request, tenant, form, status=400)


def loss_chart(series: list[dict]) -> dict | None:
    """An SVG polyline of the loss per step (at most CHART_POINTS points), or None before the first step."""
    points = [point for point in series if isinstance(point.get("loss"), (int, float))]
    if not points:
        return None
    stride = max(1, len(points) // CHART_POINTS)
    sampled = points[::stride]
    if sampled[-1] is not points[-1]:
        sampled.append(points[-1])
    steps = [p["step"] for p in sampled]
    losses = [p["loss"] for p in sampled]
    low, high = min(losses), max(losses)
    first, last = steps[0], steps[-1]

    def x(step):
        return 40 + (CHART_WIDTH - 50) * ((step - first) / (last - first) if last > first else 1)

    def y(loss):
        return 10 + (CHART_HEIGHT - 30) * ((high - loss) / (high - low) if high > low else 0.5)

    return {
        "width": CHART_WIDTH, "height": CHART_HEIGHT,
        "points": " ".join(f"{x(s):.1f},{y(loss):.1f}" for s, loss in zip(steps, losses)),
        "first_step": first, "last_step": last, "low": low, "high": high, "latest": points[-1],
        "count": len(points),
    }


def _usage_context(job, attempts, chart) -> dict:
    """The job's GPUs per replica over its life, and what it has cost so far: in all, per step, and in the cloud."""
    now = timezone.now()
    costs = usage_pages.job_cost(job, now)
    newest_step = chart["last_step"] if chart else None
    for item in costs:
        item["per_step"] = (item["spend"].cost / newest_step).quantize(PER_STEP) if newest_step else None
    readings = None
    if attempts:
        # From the first admission to now, or to the end of the last attempt (its last reading included).
        span = (attempts[0].admitted_at, attempts[-1].ended_at + timedelta(seconds=1) if attempts[-1].ended_at else now)
        utilization = usage_pages.replica_utilization([job.id], *span)
        several = len({replica["attempt"] for replica in utilization["replicas"]}) > 1
        labels = {(r["job"], r["attempt"], r["rank"]): (f"attempt {r['attempt']} " if several else "")
                  + f"replica {r['rank']}" for r in utilization["replicas"]}
        readings = {**charts.replica_charts(utilization, labels, span), "bucket_label": utilization["bucket_label"]}
    serving = Replica.objects.filter(job=job).select_related("endpoint").first() if job.kind == Job.Kind.SERVING else None
    return {"costs": costs, "newest_step": newest_step, "readings": readings,
            "serving_endpoint": serving.endpoint if serving else None}


def _job_context(request, job_id) -> dict:
    job = job_selectors.job_get(user=request.user, job_id=job_id)
    context = job_selectors.job_page(job)
    chart = loss_chart(context["series"])
    if chart is not None:
        chart["count"] = context["steps_recorded"]  # the series is downsampled; say how many steps it covers
    is_member = selectors.user_has_role(user=request.user, tenant=job.tenant, at_least=Role.MEMBER)
    context.update(
        usage=_usage_context(job, context["attempts"], chart),
        chart=chart,
        final=job.state in JOB_FINAL_STATES,
        durations=job_selectors.job_durations(job, context["attempts"], timezone.now()),
        # Nothing to offer once it is being cancelled, or once it is over.
        can_cancel=job.state not in (*JOB_FINAL_STATES, JobState.CANCELLING) and is_member,
        can_clone=is_member and can_clone(job),
        # What a script or custom job runs: its argument list, written as a shell would quote it to read (it is
        # never run through one).
        command_text=shlex.join(job.spec["command"]) if job.spec.get("command") else "",
        hyperparameters_text=json.dumps(job.spec.get("hyperparameters") or {}, sort_keys=True),
        # A checkpoint of the shipped trainer can be served (frontend/endpoint_views.py's deploy form).
        can_serve=bool(context["checkpoints"]) and job.kind == Job.Kind.TRAINING
        and job.spec.get("template") == "pytorch-ddp" and is_member,
    )
    return context


def _log_target(request, job: Job, attempts: list) -> tuple:
    """The attempt and rank whose log is asked for (?attempt=&rank=), and what was wrong with the asking.

    The newest attempt that started and rank 0 unless given; an attempt that never started, or a
    rank it does not have, is a problem naming the parameter (the page then shows the default).
    """
    started = {attempt.number: attempt for attempt in attempts if attempt.started_at}
    newest = started[max(started)] if started else None
    problems = {}
    attempt = newest
    raw = request.GET.get("attempt", "")
    if raw:
        number = whole_number(raw)
        attempt = started.get(number) if number is not None else None
        if attempt is None:
            problems["attempt"] = f"Not an attempt of this job that started: {raw[:20]!r}."
            attempt = newest
    ranks = job_selectors.attempt_ranks(job, attempt) if attempt else [0]
    raw = request.GET.get("rank", "")
    rank = whole_number(raw)
    if rank not in ranks:
        if raw:
            problems["rank"] = f"Not a replica of this attempt: {raw[:20]!r}; it has {ranks[0]} to {ranks[-1]}."
        rank = ranks[0]
    return attempt, rank, problems


def _log_context(request, job: Job, attempts: list, *, sources: bool) -> dict:
    """The log card: one replica's last lines (no progress lines), and the replicas there are to pick."""
    attempt, rank, problems = _log_target(request, job, attempts)
    lines, error = [], ""
    if attempt is not None:
        try:
            lines = job_selectors.job_log_lines(job, attempt.number, rank)
        except job_selectors.BackendUnavailable as exc:
            error = str(exc)
    newest = attempt is None or attempt.number == max(a.number for a in attempts if a.started_at)
    return {
        "log_attempt": attempt.number if attempt else None, "log_rank": rank, "log_lines": lines,
        "log_error": error, "log_problems": problems,
        # What to follow: the newest attempt, whichever it is then (a requeue shows the next one), unless
        # an earlier one was picked; ?attempt= naming the newest pins nothing either.
        "log_query": f"?attempt={attempt.number}&rank={rank}" if attempt and not newest else
        (f"?rank={rank}" if rank else ""),
        "log_follow": job.state not in JOB_FINAL_STATES and newest,
        "log_sources": job_selectors.job_log_sources(job, attempts) if sources else [],
    }


@login_required
@require_GET
def job_detail(request, job_id):
    context = _job_context(request, job_id)
    context.update(_log_context(request, context["job"], context["attempts"], sources=True))
    return render(request, "frontend/job.html", context, status=400 if context["log_problems"] else 200)


@never_cache
@login_required
@require_GET
def job_live(request, job_id):
    """The live part of the job page, polled until the job is final."""
    return render(request, "frontend/fragments/job_live.html", _job_context(request, job_id))


@never_cache
@login_required
@require_GET
def job_log(request, job_id):
    """The log card of one replica (?attempt=&rank=): what the Follow toggle polls."""
    job = job_selectors.job_get(user=request.user, job_id=job_id)
    context = {"job": job, "final": job.state in JOB_FINAL_STATES,
               **_log_context(request, job, list(job.attempts.order_by("number")), sources=False)}
    return render(request, "frontend/fragments/job_log.html", context, status=400 if context["log_problems"] else 200)


@login_required
@require_GET
def job_log_download(request, job_id):
    """One replica's log as a text file (?attempt=&rank=), without the trainer's progress lines."""
    job = job_selectors.job_get(user=request.user, job_id=job_id)
    attempt, rank, problems = _log_target(request, job, list(job.attempts.order_by("number")))
    if problems:
        return HttpResponse(" ".join(f"{name}: {text}" for name, text in problems.items()), status=400,
                            content_type="text/plain; charset=utf-8")
    try:
        lines = job_selectors.job_log_lines(job, attempt.number, rank,
                                            tail=job_selectors.LOG_DOWNLOAD_LINES) if attempt else []
    except job_selectors.BackendUnavailable as exc:
        return HttpResponse(str(exc), status=503, content_type="text/plain; charset=utf-8", headers={"Retry-After": "5"})
    return log_file_response(job, attempt.number if attempt else None, rank, lines)


def redirect_next(request, to: str, **kwargs):
    """Back to the page the form says it came from (the usage page's stop buttons), if it is this site's; else to `to`."""
    target = request.POST.get("next", "")
    if target.startswith("/") and url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()},
                                                                  require_https=request.is_secure()):
        return redirect(target)
    return redirect(to, **kwargs)


@login_required
@require_POST
def job_cancel(request, job_id):
    job = job_selectors.job_get(user=request.user, job_id=job_id)
    try:
        job = jobs.job_cancel(actor=request.user, job=job)
    except PermissionDenied as exc:
        messages.error(request, f"Could not cancel: {exc}")
    except Conflict as exc:
        messages.error(request, str(exc))
    else:
        # A waiting job is cancelled at once; one that runs is cancelling until its replicas stop, and the
        # message goes (live.js) once the page's badge shows it no longer is.
        if job.state == JobState.CANCELLING:
            messages.success(request, f"Cancelling {job.name}.", extra_tags="state:cancelling")
        else:
            messages.success(request, f"Cancelled {job.name}.")
    return redirect_next(request, "job", job_id=job.id)
