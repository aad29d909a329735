"""Browser pages. Thin: read through selectors, write through services."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from tenants import selectors


@login_required
def dashboard(request):
    tenants = selectors.tenant_list(user=request.user)
    environments = selectors.environment_list(user=request.user)
    return render(request, "frontend/dashboard.html", {"tenants": tenants, "environments": environments})
