"""Staff pages: the cockpit, the cross-tenant queue, new tenants, flavors and price cards.

Each is a 404 for anyone but staff (`staff_required`, as the other staff pages). Reads go through
`runners.scheduling.cockpit` and the apps' selectors, writes through the apps' own services.
"""

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import urlencode
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from common.errors import Conflict
from frontend import drawings
from frontend.forms import refusals_on
from frontend.job_views import redirect_next
from frontend.staff_forms import FlavorDescriptionForm, FlavorForm, PriceCardForm, QueueFilterForm, TenantCreateForm
from frontend.views import staff_required
from quotas import selectors as quota_selectors
from quotas import services as quota_services
from runners.clusters import services as clusters
from runners.jobs import services as jobs
from runners.nodecache import selectors as nodecache_selectors
from runners.scheduling import cockpit as cockpit_selectors
from tenants import selectors as tenant_selectors
from tenants import services as tenant_services

# --- The cockpit ---------------------------------------------------------------------


def _cockpit_context(request) -> dict:
    context = cockpit_selectors.cockpit(user=request.user)
    context["node_caches"] = nodecache_selectors.node_cache_states(user=request.user)
    context["cache_totals"] = nodecache_selectors.cache_totals()
    for pool in context["pools"]:
        for node in pool["nodes"]:
            for view in node["gpus"]:
                view.drawing = drawings.gpu_drawing(view.gpu)
    return context


@staff_required
@require_GET
def cockpit(request):
    return render(request, "frontend/cockpit.html", _cockpit_context(request))


@never_cache
@staff_required
@require_GET
def cockpit_live(request):
    """The cockpit's figures, polled by the page."""
    return render(request, "frontend/_cockpit_live.html", _cockpit_context(request))


# --- The queue -----------------------------------------------------------------------


def _queue_context(request) -> dict:
    form = QueueFilterForm(request.GET or None, tenants=tenant_selectors.tenant_list(user=request.user).order_by("slug"))
    tenant = state = None
    if form.is_bound and form.is_valid():
        tenant = form.cleaned_data["tenant"].slug if form.cleaned_data["tenant"] else None
        state = form.cleaned_data["state"] or None
    rows = cockpit_selectors.queue(user=request.user, tenant=tenant, state=state)
    query = urlencode({key: value for key, value in (("tenant", tenant), ("state", state)) if value})
    return {"form": form, "rows": rows, "query": query, "filtered": bool(tenant or state),
            "here": reverse("queue") + (f"?{query}" if query else "")}


@staff_required
@require_GET
def queue(request):
    context = _queue_context(request)
    return render(request, "frontend/queue.html", context, status=400 if context["form"].errors else 200)


@never_cache
@staff_required
@require_GET
def queue_live(request):
    """The queue's table, polled by the page (with the same filters)."""
    return render(request, "frontend/_cockpit_queue.html", _queue_context(request))


@staff_required
@require_POST
def queue_cancel(request, job_id):
    """Cancel any tenant's job through the jobs app's own cancel: a waiting job ends cancelled, a
    running one stops with its grace period. Nothing is deleted."""
    job = cockpit_selectors.queue_job_get(user=request.user, job_id=job_id)
    try:
        jobs.job_cancel(actor=request.user, job=job)
    except PermissionDenied as exc:
        messages.error(request, f"Could not cancel {job.name}: {exc}")
    except Conflict as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Cancelling {job.tenant.slug}/{job.name} (job {job.id}).")
    return redirect_next(request, "queue")


# --- Tenants -------------------------------------------------------------------------


@staff_required
@require_http_methods(["GET", "POST"])
def tenant_new(request):
    """GET shows the form; POST creates the tenant through the tenants app's service."""
    form = TenantCreateForm(request.POST if request.method == "POST" else None)
    if request.method == "POST":
        if form.is_valid():
            with refusals_on(form):
                tenant = tenant_services.tenant_create(actor=request.user, **form.cleaned_data)
                messages.success(request, f"Created tenant {tenant.name}. Add its first members below.")
                return redirect("tenant", slug=tenant.slug)
        return render(request, "frontend/tenant_new.html", {"form": form}, status=400)
    return render(request, "frontend/tenant_new.html", {"form": form})


# --- Flavors and price cards ---------------------------------------------------------


def _render_flavors(request, *, flavor_form=None, price_form=None, describe_form=None, status=200):
    flavors = quota_selectors.flavor_list()
    context = {
        "rows": cockpit_selectors.flavor_table(user=request.user),
        "flavor_form": flavor_form or FlavorForm(),
        "price_form": price_form or PriceCardForm(flavors=flavors, initial={"flavor": request.GET.get("flavor", "")}),
        "describe_form": describe_form or FlavorDescriptionForm(flavors=flavors),
    }
    return render(request, "frontend/flavors.html", context, status=status)


@staff_required
@require_GET
def flavor_list(request):
    return _render_flavors(request)


@staff_required
@require_POST
def flavor_create(request):
    form = FlavorForm(request.POST)
    if form.is_valid():
        with refusals_on(form):
            flavor = quota_services.flavor_create(actor=request.user, **form.cleaned_data)
            clusters.flavor_capacity_refresh()
            messages.success(request, f"Created flavor {flavor.name}; it has no price yet.")
            return redirect(f"{reverse('flavors')}#flavor-{flavor.name}")
    return _render_flavors(request, flavor_form=form, status=400)


@staff_required
@require_POST
def flavors_discover(request):
    """Give every kind of capacity the inventory reports a flavor (the inventory sync does it too)."""
    created = clusters.flavors_discover(actor=request.user)
    if created:
        messages.success(request, f"Found {len(created)} new flavor{'s' if len(created) != 1 else ''}: "
                                  f"{', '.join(flavor.name for flavor in created)}.")
    else:
        messages.info(request, "Every kind of capacity in the inventory already has a flavor.")
    return redirect("flavors")


@staff_required
@require_POST
def price_card_add(request):
    """Add a price card through the quotas service; usage from its start on is repriced when it is saved."""
    form = PriceCardForm(request.POST, flavors=quota_selectors.flavor_list())
    if form.is_valid():
        data = form.cleaned_data
        with refusals_on(form):
            card = quota_services.price_set(
                actor=request.user, flavor=data["flavor"], price_per_hour=data["price_per_hour"],
                currency=data["currency"], effective_from=data["effective_from"],
            )
            messages.success(
                request, f"{card.flavor.name}: {card.price_per_hour:.4f} {card.currency} per hour from "
                         f"{card.effective_from:%Y-%m-%d %H:%M} UTC."
            )
            return redirect(f"{reverse('flavors')}#flavor-{card.flavor.name}")
    return _render_flavors(request, price_form=form, status=400)


@staff_required
@require_POST
def flavor_describe(request):
    """Change a flavor's description through the quotas service (its name and shape stay)."""
    form = FlavorDescriptionForm(request.POST, flavors=quota_selectors.flavor_list())
    if form.is_valid():
        with refusals_on(form):
            flavor = quota_services.flavor_describe(actor=request.user, flavor=form.cleaned_data["flavor"],
                                                    description=form.cleaned_data["description"])
            messages.success(request, f"Saved the description of {flavor.name}.")
            return redirect(f"{reverse('flavors')}#flavor-{flavor.name}")
    return _render_flavors(request, describe_form=form, status=400)
