"""Workspace pages: a tenant's workspaces with the form that starts a new one, and one workspace's page (its
state, what it costs, its GPU use, the link that opens JupyterLab, and its owner's controls)."""

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from common.errors import Conflict, NotFound
from frontend.job_views import _flavor_rows
from runners.environments import selectors as environment_selectors
from runners.environments.models import EnvironmentState
from runners.usage import pages as usage_pages
from runners.workspaces import selectors as workspace_selectors
from runners.workspaces import services as workspaces
from tenants import selectors
from tenants.models import Role

LISTED = 200


class WorkspaceForm(forms.Form):
    name = forms.RegexField(regex=rf"^{workspaces.NAME_PATTERN}$", max_length=30, initial="notebook",
                            help_text="Lower-case letters, digits and '-'.")
    environment = forms.TypedChoiceField(coerce=int)
    flavor = forms.ChoiceField(help_text="A whole GPU, a MIG slice, a time-slice share, or CPU only.")
    gpus = forms.IntegerField(min_value=0, max_value=8, initial=1, label="Units of the flavor")
    shared = forms.BooleanField(required=False, label="Members of the tenant may open it too")

    def __init__(self, *args, environments, flavors, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["environment"].choices = [(e.id, e.name) for e in environments]
        self.fields["flavor"].choices = [(row["name"], row["label"]) for row in flavors]


def _can_start(user, tenant) -> bool:
    return selectors.user_has_role(user=user, tenant=tenant, at_least=Role.MEMBER)


def _may_drive(user, workspace) -> bool:
    return user.id == workspace.owner_id or selectors.user_has_role(user=user, tenant=workspace.tenant,
                                                                    at_least=Role.ADMIN)


@login_required
@require_http_methods(["GET", "POST"])
def workspace_list_page(request, slug):
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    ready = environment_selectors.environment_list(user=request.user, tenant=tenant, state=EnvironmentState.READY)
    flavors = _flavor_rows(tenant)
    status = 200
    form = WorkspaceForm(request.POST or None, environments=ready, flavors=flavors)
    if request.method == "POST":
        if form.is_valid():
            try:
                workspace = workspaces.workspace_create(actor=request.user, data={"tenant": tenant.slug,
                                                                                  **form.cleaned_data})
            except PermissionDenied as exc:
                form.add_error(None, str(exc))
            except ValidationError as exc:
                for field, errors in exc.message_dict.items():
                    form.add_error(field if field in form.fields else None, errors)
            else:
                messages.success(request, f"Starting {workspace.name}: it opens here once JupyterLab answers.")
                return redirect("workspace", slug=tenant.slug, workspace_id=workspace.id)
        status = 400
    rows = list(workspace_selectors.workspace_list(user=request.user, tenant=tenant)[:LISTED])
    return render(request, "frontend/workspace_list.html", {
        "tenant": tenant, "workspaces": [{"workspace": w, "idle_since": workspaces.idle_since(w)} for w in rows],
        "form": form, "can_start": _can_start(request.user, tenant), "has_environment": ready.exists(),
        "flavors": flavors,
    }, status=status)


def _workspace(request, slug, workspace_id):
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    workspace = workspace_selectors.workspace_list(user=request.user, tenant=tenant).filter(id=workspace_id).first()
    if workspace is None:
        raise NotFound("No such workspace.")
    return workspace


@login_required
@require_GET
def workspace_page(request, slug, workspace_id):
    workspace = _workspace(request, slug, workspace_id)
    return render(request, "frontend/workspace.html", {
        "tenant": workspace.tenant, "workspace": workspace, "idle_since": workspaces.idle_since(workspace),
        "idle_limit_minutes": workspaces.idle_limit(workspace).total_seconds() / 60,
        "usage": usage_pages.workspace_usage(workspace, timezone.now()),
        "may_drive": _may_drive(request.user, workspace), "open_url": f"{workspace.base_url}lab",
        "running": workspace.job is not None and workspace.state not in ("stopped", "failed"),
    })


@login_required
@require_POST
def workspace_action(request, slug, workspace_id, action):
    workspace = _workspace(request, slug, workspace_id)
    run = {"start": workspaces.workspace_start, "stop": workspaces.workspace_stop,
           "delete": workspaces.workspace_delete}.get(action)
    if run is None:
        raise NotFound("No such action.")
    try:
        run(actor=request.user, workspace=workspace)
    except (PermissionDenied, Conflict, ValidationError) as exc:
        messages.error(request, f"Could not {action} {workspace.name}: {' '.join(getattr(exc, 'messages', [str(exc)]))}")
        return redirect("workspace", slug=slug, workspace_id=workspace.id)
    if action == "delete":
        messages.success(request, f"Deleted {workspace.name} and its home folder.")
        return redirect("workspaces", slug=slug)
    messages.success(request, {"start": f"Starting {workspace.name}.", "stop": f"Stopping {workspace.name}: its "
                               "files stay for the next start."}[action])
    return redirect("workspace", slug=slug, workspace_id=workspace.id)
