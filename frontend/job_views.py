"""Job pages: a tenant's jobs with the submit form, and one job's page that follows it live."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST

from common.errors import Conflict
from frontend.forms import JobForm
from quotas import selectors as quota_selectors
from runners.environments import selectors as environment_selectors
from runners.environments.models import EnvironmentState
from runners.jobs import selectors as job_selectors
from runners.jobs import services as jobs
from runners.jobs.models import JOB_FINAL_STATES, Job, JobState
from tenants import selectors
from tenants.models import Role

CHART_WIDTH, CHART_HEIGHT, CHART_POINTS = 600, 180, 300


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


def _render_jobs(request, tenant, form=None, *, status=200):
    can_submit = selectors.user_has_role(user=request.user, tenant=tenant, at_least=Role.MEMBER)
    ready = environment_selectors.environment_list(user=request.user, tenant=tenant, state=EnvironmentState.READY)
    flavors = _flavor_rows(tenant)
    state = request.GET.get("state") or ""
    if state and state not in JobState.values:
        state = ""
    context = {
        "tenant": tenant,
        "jobs": job_selectors.job_list(user=request.user, tenant=tenant.slug, state=state or None)[:200],
        "state": state,
        "states": JobState.values,
        "can_submit": can_submit,
        "flavors": flavors,
        "form": form or JobForm(environments=ready, flavors=flavors),
        "has_environment": ready.exists(),
    }
    return render(request, "frontend/jobs.html", context, status=status)


@login_required
@require_GET
def job_list(request, slug):
    return _render_jobs(request, selectors.tenant_get(user=request.user, slug=slug))


@login_required
@require_POST
def job_submit(request, slug):
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    ready = environment_selectors.environment_list(user=request.user, tenant=tenant, state=EnvironmentState.READY)
    form = JobForm(request.POST, environments=ready, flavors=_flavor_rows(tenant))
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


def _job_context(request, job_id) -> dict:
    job = job_selectors.job_get(user=request.user, job_id=job_id)
    context = job_selectors.job_page(job)
    chart = loss_chart(context["series"])
    if chart is not None:
        chart["count"] = context["steps_recorded"]  # the series is downsampled; say how many steps it covers
    context.update(
        chart=chart,
        final=job.state in JOB_FINAL_STATES,
        # Nothing to offer once it is being cancelled, or once it is over.
        can_cancel=job.state not in (*JOB_FINAL_STATES, JobState.CANCELLING)
        and selectors.user_has_role(user=request.user, tenant=job.tenant, at_least=Role.MEMBER),
        # A checkpoint of the shipped trainer can be served (frontend/endpoint_views.py's deploy form).
        can_serve=bool(context["checkpoints"]) and job.kind == Job.Kind.TRAINING
        and job.spec.get("template") == "pytorch-ddp"
        and selectors.user_has_role(user=request.user, tenant=job.tenant, at_least=Role.MEMBER),
    )
    return context


@login_required
@require_GET
def job_detail(request, job_id):
    return render(request, "frontend/job.html", _job_context(request, job_id))


@never_cache
@login_required
@require_GET
def job_live(request, job_id):
    """The live part of the job page, polled until the job is final."""
    return render(request, "frontend/fragments/job_live.html", _job_context(request, job_id))


@login_required
@require_POST
def job_cancel(request, job_id):
    job = job_selectors.job_get(user=request.user, job_id=job_id)
    try:
        jobs.job_cancel(actor=request.user, job=job)
    except PermissionDenied as exc:
        messages.error(request, f"Could not cancel: {exc}")
    except Conflict as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Cancelling {job.name}.")
    return redirect("job", job_id=job.id)
