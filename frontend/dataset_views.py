"""The datasets page: a tenant's datasets and those shared with it, each sealed version's size and shards, and
which of the tenant's jobs named it."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.views.decorators.http import require_GET

from runners.datasets import selectors as datasets
from tenants import selectors

VERSIONS_SHOWN = 20
USES_SHOWN = 10


@login_required
@require_GET
def dataset_list_page(request, slug):
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    rows = []
    for summary in datasets.dataset_summaries(tenant):
        versions = []
        for version in datasets.sealed_versions(summary["dataset"])[:VERSIONS_SHOWN]:
            versions.append({"version": version, "uses": list(datasets.uses_of(version, [tenant])[:USES_SHOWN])})
        rows.append({**summary, "version_rows": versions,
                     "shared_with": sorted(summary["dataset"].shares.values_list("tenant__slug", flat=True))
                     if summary["own"] else []})
    return render(request, "frontend/dataset_list.html", {"tenant": tenant, "datasets": rows})
