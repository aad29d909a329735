"""Browser pages. Thin: read through selectors, write through services."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from frontend.forms import EnvironmentForm, MemberAddForm, add_service_errors
from tenants import selectors, services
from tenants.models import ROLE_RANK, EnvironmentState, Role


def _holds(role: str | None, at_least: str) -> bool:
    """Whether a role is enough to show a control; the service still decides on submit."""
    return role is not None and ROLE_RANK[role] >= ROLE_RANK[at_least]


def _abilities(user, tenant) -> dict:
    role = selectors.user_role(user=user, tenant=tenant)
    return {
        "role": role,
        "can_change_environments": _holds(role, Role.MEMBER),
        "can_manage_members": _holds(role, Role.ADMIN),
    }


@login_required
@require_GET
def dashboard(request):
    tenants = [
        {"tenant": tenant, "role": selectors.user_role(user=request.user, tenant=tenant)}
        for tenant in selectors.tenant_list(user=request.user)
    ]
    environments = selectors.environment_list(user=request.user)
    return render(request, "frontend/dashboard.html", {"tenants": tenants, "environments": environments})


def _render_tenant(request, tenant, *, environment_form=None, member_form=None, status=200):
    context = {
        "tenant": tenant,
        "members": selectors.member_list(user=request.user, tenant=tenant),
        "environments": selectors.environment_list(user=request.user, tenant=tenant),
        "environment_form": environment_form or EnvironmentForm(),
        "member_form": member_form or MemberAddForm(),
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
            environment = services.environment_request(actor=request.user, tenant=tenant, name=form.cleaned_data["name"])
        except PermissionDenied as exc:
            messages.error(request, f"Could not create the environment: {exc}")
            return redirect("tenant", slug=tenant.slug)
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            messages.success(request, f"Requested {environment.name}; a worker is provisioning it now.")
            return redirect("environment", environment_id=environment.id)
    return _render_tenant(request, tenant, environment_form=form, status=400)


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
    environment = selectors.environment_get(user=request.user, environment_id=environment_id)
    context = {"environment": environment, **_abilities(request.user, environment.tenant)}
    return render(request, "frontend/environment.html", context)


@never_cache
@login_required
@require_GET
def environment_status(request, environment_id):
    """The live status block of the environment page, polled while it is transitional."""
    environment = selectors.environment_get(user=request.user, environment_id=environment_id)
    context = {"environment": environment, **_abilities(request.user, environment.tenant)}
    return render(request, "frontend/fragments/environment_status.html", context)


@never_cache
@login_required
@require_GET
def environment_row(request, environment_id):
    """One row of an environment table; empty once the environment is deleted, so the row goes away."""
    environment = selectors.environment_get(user=request.user, environment_id=environment_id)
    if environment.state == EnvironmentState.DELETED:
        return HttpResponse("")
    context = {"environment": environment, "show_tenant": request.GET.get("show_tenant") == "1"}
    return render(request, "frontend/fragments/environment_row.html", context)


@login_required
@require_http_methods(["GET", "POST"])
def environment_delete(request, environment_id):
    """GET asks for confirmation; only the POST from that page deletes."""
    environment = selectors.environment_get(user=request.user, environment_id=environment_id)
    if request.method == "GET":
        context = {"environment": environment, **_abilities(request.user, environment.tenant)}
        return render(request, "frontend/environment_delete.html", context)
    try:
        services.environment_delete(actor=request.user, environment=environment)
    except PermissionDenied as exc:
        messages.error(request, f"Could not delete {environment.name}: {exc}")
        return redirect("environment", environment_id=environment.id)
    messages.success(request, f"Deleting {environment.name}; it disappears from the list once it is gone.")
    return redirect("tenant", slug=environment.tenant.slug)
