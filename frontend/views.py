"""Browser pages. Thin: read through selectors, write through services."""

from functools import wraps
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from common import nulls
from frontend import drawings
from frontend.environment_page import environment_page
from frontend.filters import EnvironmentPageFilter, MemberPageFilter, NodePageFilter, page_list, with_role_rank
from frontend.forms import (
    EnvironmentForm,
    MemberAddForm,
    NodePoolApplyForm,
    PartitionPreviewForm,
    PartitionProfileForm,
    QuotaForm,
    add_service_errors,
    refusals_on,
)
from quotas import selectors as quota_selectors
from quotas import services as quota_services
from runners.clusters import selectors as cluster_selectors
from runners.clusters import services as clusters
from runners.clusters.models import PartitionChange
from runners.environments import selectors as environment_selectors
from runners.environments import services as environments
from runners.environments.models import EnvironmentState
from runners.jobs import selectors as job_selectors
from runners.usage import pages as usage_pages
from runners.usage.selectors import current_alert
from tenants import selectors, services
from tenants.models import Role


def throttled_login(view):
    """A login view that answers 429 with Retry-After when its form was throttled."""

    @wraps(view)
    def wrapper(request, *args, **kwargs):
        response = view(request, *args, **kwargs)
        form = (getattr(response, "context_data", None) or {}).get("form")
        wait_s = getattr(form, "throttled_s", None)
        if wait_s:
            response.status_code = 429
            response["Retry-After"] = str(wait_s)
        return response

    return wrapper


def _abilities(user, tenant) -> dict:
    role = selectors.user_role(user=user, tenant=tenant)
    return {
        "role": role,
        # Which controls to show; the services decide again on submit.
        "can_change_environments": selectors.user_has_role(user=user, tenant=tenant, at_least=Role.MEMBER),
        "can_manage_members": selectors.user_has_role(user=user, tenant=tenant, at_least=Role.ADMIN),
    }


@login_required
@require_GET
def dashboard(request):
    tenants = [
        {"tenant": tenant, "role": selectors.user_role(user=request.user, tenant=tenant)}
        for tenant in selectors.tenant_list(user=request.user)
    ]
    environments = environment_selectors.environment_list(user=request.user)
    if request.user.is_staff:
        # Staff see the cluster's headline figures on top, and the way to the cockpit.
        from runners.scheduling.cockpit import cockpit_summary

        context = {"tenants": tenants, "environments": environments, "summary": cockpit_summary(user=request.user)}
        return render(request, "frontend/_cockpit_dashboard.html", context)
    return render(request, "frontend/dashboard.html", {"tenants": tenants, "environments": environments})


def _render_tenant(request, tenant, *, environment_form=None, member_form=None, status=200):
    # Two lists on one page, each with its own parameters: env-q, env-state, env-sort, env-page; member-...
    environment_rows = page_list(request, EnvironmentPageFilter,
                                 environment_selectors.environment_list(user=request.user, tenant=tenant), prefix="env")
    member_rows = page_list(request, MemberPageFilter,
                            with_role_rank(selectors.member_list(user=request.user, tenant=tenant)), prefix="member",
                            tiebreak="user__username")
    if (environment_rows.errors or member_rows.errors) and status == 200:
        status = 400
    context = {
        "tenant": tenant,
        "members": member_rows.page,
        "member_list": member_rows,
        "environments": environment_rows.page,
        "environment_list": environment_rows,
        "environment_form": environment_form or EnvironmentForm(),
        "member_form": member_form or MemberAddForm(),
        "budget_alert": current_alert(tenant),
        **_abilities(request.user, tenant),
    }
    return render(request, "frontend/tenant.html", context, status=status)


@login_required
@require_GET
def tenant_detail(request, slug):
    return _render_tenant(request, selectors.tenant_get(user=request.user, slug=slug))


@login_required
@require_POST
def environment_create(request, slug):
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    form = EnvironmentForm(request.POST)
    if form.is_valid():
        try:
            environment = environments.environment_request(actor=request.user, tenant=tenant, name=form.cleaned_data["name"])
        except PermissionDenied as exc:
            messages.error(request, f"Could not create the environment: {exc}")
            return redirect("tenant", slug=tenant.slug)
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            # Tagged with the states it describes: live.js drops it once the page's badge shows another.
            messages.success(request, f"Requested {environment.name}; a worker is provisioning it now.",
                             extra_tags="state:requested provisioning")
            return redirect("environment", environment_id=environment.id)
    return _render_tenant(request, tenant, environment_form=form, status=400)


@login_required
@require_POST
def tenant_moves(request, slug):
    """Turn the scheduler's moves of the tenant's jobs on or off (an admin's choice; runners.scheduling.defrag)."""
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    allow = request.POST.get("allow_moves")
    if allow not in ("true", "false"):
        messages.error(request, "Could not change moves: allow_moves must be true or false.")
        return redirect("tenant", slug=tenant.slug)
    try:
        tenant = services.tenant_moves_set(actor=request.user, tenant=tenant, allow=allow == "true")
    except PermissionDenied as exc:
        messages.error(request, f"Could not change moves: {exc}")
    else:
        messages.success(request, "The scheduler may move this tenant's preemptible jobs to make room." if tenant.allow_moves
                         else "The scheduler will never move this tenant's jobs.")
    return redirect("tenant", slug=tenant.slug)


@login_required
@require_POST
def member_add(request, slug):
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    form = MemberAddForm(request.POST)
    if form.is_valid():
        try:
            membership = services.membership_add(actor=request.user, tenant=tenant, **form.cleaned_data)
        except PermissionDenied as exc:
            messages.error(request, f"Could not add the member: {exc}")
            return redirect("tenant", slug=tenant.slug)
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            messages.success(request, f"Added {membership.user.username} as {membership.role}.")
            return redirect("tenant", slug=tenant.slug)
    return _render_tenant(request, tenant, member_form=form, status=400)


@login_required
@require_POST
def member_remove(request, slug, username):
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    try:
        services.membership_remove(actor=request.user, tenant=tenant, username=username)
    except (PermissionDenied, ValidationError) as exc:
        text = " ".join(exc.messages) if isinstance(exc, ValidationError) else str(exc)
        messages.error(request, f"Could not remove {username}: {text}")
    else:
        messages.success(request, f"Removed {username} from {tenant.name}.")
        if username == request.user.get_username() and not request.user.is_staff:
            # Leaving the tenant: its page is a 404 for you now.
            return redirect("dashboard")
    return redirect("tenant", slug=tenant.slug)


@login_required
@require_GET
def environment_detail(request, environment_id):
    """The environment, how to connect to it when ready, its jobs, endpoints, quota and history; 410 once deleted."""
    context = _environment_context(request, environment_id)
    context.update(environment_page(context["environment"], request.user))
    return render(request, "frontend/environment.html", context, status=410 if context["gone"] else 200)


def _environment_context(request, environment_id) -> dict:
    environment = environment_selectors.environment_get(user=request.user, environment_id=environment_id)
    return {"environment": environment, **_abilities(request.user, environment.tenant)}


@never_cache
@login_required
@require_GET
def environment_status(request, environment_id):
    """The live status block of the environment page, polled while it is transitional."""
    return render(request, "frontend/fragments/environment_status.html", _environment_context(request, environment_id))


@never_cache
@login_required
@require_GET
def environment_row(request, environment_id):
    """One row of an environment table; empty once the environment is deleted, so the row goes away."""
    environment = environment_selectors.environment_get(user=request.user, environment_id=environment_id)
    if environment.state == EnvironmentState.DELETED:
        return HttpResponse("")
    context = {"environment": environment, "show_tenant": request.GET.get("show_tenant") == "1"}
    return render(request, "frontend/fragments/environment_row.html", context)


@login_required
@require_http_methods(["GET", "POST"])
def environment_delete(request, environment_id):
    """GET asks for confirmation; only the POST from that page deletes."""
    environment = environment_selectors.environment_get(user=request.user, environment_id=environment_id)
    if request.method == "GET":
        context = {
            "environment": environment, **_abilities(request.user, environment.tenant),
            "live_jobs": job_selectors.environment_live_jobs(environment),
        }
        return render(request, "frontend/environment_delete.html", context)
    try:
        environments.environment_delete(actor=request.user, environment=environment)
    except PermissionDenied as exc:
        messages.error(request, f"Could not delete {environment.name}: {exc}")
        return redirect("environment", environment_id=environment.id)
    messages.success(request, f"Deleting {environment.name}; it disappears from the list once it is gone.",
                     extra_tags="state:deleting")
    return redirect("tenant", slug=environment.tenant.slug)


# --- Quotas, partitions and node pools (staff), and a tenant's own quota ------------


def staff_required(view):
    """Staff pages are a 404 for everyone else: they do not exist for a tenant."""

    @wraps(view)
    @login_required
    def wrapped(request, *args, **kwargs):
        if not request.user.is_staff:
            raise Http404("No such page.")
        return view(request, *args, **kwargs)

    return wrapped


def _error_text(exc: PermissionDenied | ValidationError) -> str:
    return " ".join(exc.messages) if isinstance(exc, ValidationError) else str(exc)


def _quota_form(request, data=None, initial=None):
    return QuotaForm(
        data, initial=initial, tenants=selectors.tenant_list(user=request.user).order_by("slug"),
        flavors=quota_selectors.flavor_list(),
    )


def _render_quotas(request, form, *, editing=None, status=200):
    context = {"table": quota_selectors.quota_table(user=request.user), "form": form, "editing": editing}
    return render(request, "frontend/quotas.html", context, status=status)


@staff_required
@require_GET
def quota_table(request):
    """Tenants x flavors; ?tenant=&flavor= fills the form with that cell's quota to edit it."""
    initial, quota = {}, None
    tenant_slug, flavor_name = request.GET.get("tenant"), request.GET.get("flavor")
    if tenant_slug and flavor_name and not (nulls.has_null(tenant_slug) or nulls.has_null(flavor_name)):
        initial = {"tenant": tenant_slug, "flavor": flavor_name}
        quota = quota_selectors.quota_list(user=request.user).filter(tenant__slug=tenant_slug, flavor__name=flavor_name).first()
        if quota is not None:
            initial.update(guaranteed=quota.guaranteed, max=quota.max, fair_share_weight=quota.fair_share_weight,
                           max_priority=quota.max_priority)
    return _render_quotas(request, _quota_form(request, initial=initial), editing=quota)


@staff_required
@require_POST
def quota_set(request):
    form = _quota_form(request, request.POST)
    if form.is_valid():
        with refusals_on(form):
            quota = quota_services.quota_set(actor=request.user, **form.cleaned_data)
            messages.success(
                request, f"{quota.tenant.name}: {quota.flavor.name} is now {quota.guaranteed} guaranteed, {quota.max} max."
            )
            return redirect("quotas")
    return _render_quotas(request, form, status=400)


@staff_required
@require_POST
def quota_remove(request, quota_id):
    quota = get_object_or_404(quota_selectors.quota_list(user=request.user), id=quota_id)
    try:
        quota_services.quota_delete(actor=request.user, quota=quota)
    except (PermissionDenied, ValidationError) as exc:
        messages.error(request, f"Could not remove the quota: {_error_text(exc)}")
    else:
        messages.success(request, f"Removed {quota.tenant.name}'s quota for {quota.flavor.name}.")
    return redirect("quotas")


def _render_partitions(request, form, *, preview=None, status=200):
    profiles = [
        {
            "profile": profile,
            "drawing": drawings.profile_drawing(profile),
            "configs": cluster_selectors.partition_profile_configs(profile),
        }
        for profile in cluster_selectors.partition_profile_list()
    ]
    context = {"profiles": profiles, "form": form, "preview": preview}
    return render(request, "frontend/partitions.html", context, status=status)


@staff_required
@require_GET
def partition_list(request):
    return _render_partitions(request, PartitionProfileForm())


def _preview(form: PartitionPreviewForm) -> dict:
    """The drawing of one GPU as the form asks, or why it cannot be cut that way."""
    if not form.is_valid():
        return {"problems": [f"{form.fields[field].label or field}: {' '.join(errors)}" if field != "__all__" else " ".join(errors)
                             for field, errors in form.errors.items() if field != "name"]}
    data = form.cleaned_data
    problem = _geometry_problem(data["gpu_model"], data["kind"], data["layout"], data["replicas"])
    if problem:
        return {"problems": [problem]}
    try:
        drawing = drawings.layout_drawing(data["gpu_model"], data["kind"], data["layout"], data["replicas"])
    except ValueError as exc:  # mig.MigError: the geometry's own reason
        return {"problems": [f"Does not fit: {exc}."]}
    return {"drawing": drawing, "data": data}


def _geometry_problem(gpu_model: str, kind: str, layout: list[str], replicas: int | None) -> str | None:
    # The service's own check, so the preview never promises what Save then refuses.
    try:
        clusters.partition_profile_check(gpu_model=gpu_model, kind=kind, layout=layout, replicas=replicas)
    except ValidationError as exc:
        return " ".join(message for messages in exc.message_dict.values() for message in messages)
    return None


@staff_required
@require_GET
def partition_preview(request):
    """A fragment: one GPU drawn as the create form's fields describe it, or why not."""
    return render(request, "frontend/fragments/partition_preview.html", _preview(PartitionPreviewForm(request.GET)))


@staff_required
@require_POST
def partition_create(request):
    form = PartitionProfileForm(request.POST)
    if form.is_valid():
        data = form.cleaned_data
        with refusals_on(form):
            profile = clusters.partition_profile_create(actor=request.user, **data)
            messages.success(request, f"Saved partition profile {profile.name}.")
            return redirect(f"{reverse('partitions')}#profile-{profile.name}")
    return _render_partitions(request, form, preview=_preview(PartitionPreviewForm(request.POST)), status=400)


@staff_required
@require_GET
def node_pool_list(request):
    latest = cluster_selectors.partition_change_latest_by_pool(user=request.user)
    first_gpus = cluster_selectors.node_pool_first_gpus(user=request.user)
    pools = [
        {
            "pool": pool,
            "change": latest.get(pool.id),
            # A pool is partitioned alike, so its first GPU shows how each of them is cut.
            "drawing": drawings.gpu_drawing(first_gpus[pool.id]) if pool.id in first_gpus else None,
        }
        for pool in cluster_selectors.node_pool_list(user=request.user)
    ]
    return render(request, "frontend/node_pools.html", {"pools": pools})


def _pool_live_context(request, pool) -> dict:
    change = cluster_selectors.partition_change_latest(user=request.user, pool=pool)
    # The page's node filters, sort and page travel with the live poll, so an update keeps them.
    node_page = page_list(request, NodePageFilter, cluster_selectors.node_pool_nodes(user=request.user, pool=pool),
                          tiebreak="id")
    nodes = [
        {"node": node, "gpus": [{"gpu": gpu, "drawing": drawings.gpu_drawing(gpu)} for gpu in node.gpus.all()]}
        for node in node_page.page
    ]
    return {
        "pool": pool,
        "change": change,
        "change_in_flight": change is not None and change.state not in PartitionChange.FINISHED,
        "nodes": nodes,
        "node_list": node_page,
        "node_query": urlencode(node_page.query),
    }


def _render_pool(request, pool, form=None, *, status=200):
    profiles = cluster_selectors.node_pool_profiles(user=request.user, pool=pool)
    context = {
        **_pool_live_context(request, pool),
        "form": form or NodePoolApplyForm(profiles=profiles),
        "has_profiles": profiles.exists(),
        "capacity_preview": _capacity_preview(request, pool, form) if form is not None else None,
    }
    if context["node_list"].errors and status == 200:
        status = 400  # a bad node filter: the page names the parameter
    return render(request, "frontend/node_pool.html", context, status=status)


def _capacity_preview(request, pool, form: NodePoolApplyForm) -> dict:
    """What applying the form's profile would do to each flavor's capacity (the API's dry run)."""
    # Only the profile matters here: the other fields may be unset, or the apply refused.
    try:
        profile = form.fields["profile"].clean(form["profile"].value())
    except ValidationError:
        profile = None
    if profile is None:
        return {"problem": "Choose a profile to see what it does to capacity."}
    result = clusters.node_pool_apply(
        actor=request.user, pool=pool, profile=profile, drain=PartitionChange.Drain.WAIT, dry_run=True
    )
    return {"profile": profile, "rows": result["capacity"]}


@staff_required
@require_GET
def node_pool_apply_preview(request, pool_id):
    """A fragment: per flavor, capacity before and after the chosen profile, and guarantees that no longer fit."""
    pool = cluster_selectors.node_pool_get(user=request.user, pool_id=pool_id)
    form = NodePoolApplyForm(request.GET, profiles=cluster_selectors.node_pool_profiles(user=request.user, pool=pool))
    return render(
        request, "frontend/fragments/pool_capacity_preview.html",
        {"pool": pool, "preview": _capacity_preview(request, pool, form)},
    )


@staff_required
@require_GET
def node_pool_detail(request, pool_id):
    return _render_pool(request, cluster_selectors.node_pool_get(user=request.user, pool_id=pool_id))


@never_cache
@staff_required
@require_GET
def node_pool_live(request, pool_id):
    """The pool's layouts and latest change, polled while the change is in flight."""
    pool = cluster_selectors.node_pool_get(user=request.user, pool_id=pool_id)
    return render(request, "frontend/fragments/node_pool_live.html", _pool_live_context(request, pool))


@staff_required
@require_POST
def node_pool_apply(request, pool_id):
    pool = cluster_selectors.node_pool_get(user=request.user, pool_id=pool_id)
    form = NodePoolApplyForm(request.POST, profiles=cluster_selectors.node_pool_profiles(user=request.user, pool=pool))
    if form.is_valid():
        with refusals_on(form):
            change = clusters.node_pool_apply(actor=request.user, pool=pool, **form.cleaned_data)["change"]
            messages.success(request, f"Applying {change.profile.name} to {pool.name}; progress shows below.")
            return redirect("node-pool", pool_id=pool.id)
    return _render_pool(request, pool, form, status=400)


@login_required
@require_GET
def tenant_quota(request, slug):
    """What the tenant may use, and what it uses: units held now and this month's GPU-hours and cost per flavor.

    Any member, viewers included; a 404 for anyone else.
    """
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    held = job_selectors.tenant_flavor_usage(tenant=tenant)
    month = usage_pages.flavor_month(tenant, timezone.now())
    quotas = [
        {**quota_selectors.tenant_quota_row(quota), "held": held.get(quota.flavor_id, 0),
         "month": month.get(quota.flavor.name, [])}
        for quota in quota_selectors.quota_list(user=request.user, tenant=tenant).order_by("flavor__gpu_model", "flavor__name")
    ]
    return render(request, "frontend/tenant_quota.html", {"tenant": tenant, "quotas": quotas,
                                                          "budget_alert": current_alert(tenant)})
