"""Model registry pages: a tenant's models with their versions, and one version's lineage and weights."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.views.decorators.http import require_GET

from runners.inference.selectors import endpoint_list
from runners.registry import selectors as registry
from tenants import selectors

VERSIONS_SHOWN = 200


@login_required
@require_GET
def model_list_page(request, slug):
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    versions = list(registry.version_list(user=request.user, tenant=tenant).order_by("name", "-version")
                    [:VERSIONS_SHOWN])
    models: dict[str, list] = {}
    for version in versions:
        models.setdefault(version.name, []).append(version)
    return render(request, "frontend/model_list.html", {"tenant": tenant, "models": models})


@login_required
@require_GET
def model_version_page(request, slug, name, version):
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    found = registry.version_get(user=request.user, tenant=tenant, name=name, version=version)
    serving = endpoint_list(user=request.user, tenant=tenant).filter(model_version=found).exclude(state="stopped")
    return render(request, "frontend/model_version.html", {
        "tenant": tenant, "version": found, "lineage": found.lineage, "endpoints": list(serving),
        "hyperparameters": sorted((found.lineage.get("hyperparameters") or {}).items()),
    })
