"""Usage pages: a tenant's utilization, cost and idle allocations; the whole cluster's for staff.

Thin: the figures come from runners.usage.pages (the rows the usage API and its CSV export give),
the chart coordinates from frontend.charts.
"""

from datetime import timedelta
from urllib.parse import urlencode

from django import forms
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET

from frontend import charts
from frontend.views import staff_required
from runners.scheduling.services import fragmentation_now
from runners.usage import pages
from runners.usage.api import MAX_RANGE_DAYS
from runners.usage.selectors import current_alert
from tenants import selectors
from tenants.models import Role


class RangeForm(forms.Form):
    """UTC days, both included, as the usage API counts them."""

    start = forms.DateField(widget=forms.DateInput(attrs={"type": "date"}, format="%Y-%m-%d"))
    end = forms.DateField(widget=forms.DateInput(attrs={"type": "date"}, format="%Y-%m-%d"))

    def clean(self):
        data = super().clean()
        start, end = data.get("start"), data.get("end")
        if start and end and start > end:
            self.add_error("start", "The start is after the end.")
        elif start and end and (end - start).days >= MAX_RANGE_DAYS:
            self.add_error("end", f"A range is at most {MAX_RANGE_DAYS} days.")
        return data


class IdleForm(forms.Form):
    """Which allocations count as idle: every GPU under the threshold for the whole window."""

    threshold_pct = forms.FloatField(label="Utilization under (%)", min_value=0, max_value=100)
    window_min = forms.FloatField(label="For (minutes)", min_value=1, max_value=7 * 24 * 60)


def _bound(form_class, request, defaults: dict):
    """The form bound to the query, its defaults standing in for what the query leaves out."""
    data = {**defaults, **{name: request.GET[name] for name in form_class.base_fields if request.GET.get(name)}}
    return form_class(data)


def _range(request, now):
    first, last = pages.this_month(now)
    return _bound(RangeForm, request, {"start": first.isoformat(), "end": last.isoformat()})


@login_required
@require_GET
def tenant_usage(request, slug):
    """Any member's view of the tenant's usage (viewers included); a 404 for anyone else."""
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    now = timezone.now()
    range_form = _range(request, now)
    idle_form = _bound(IdleForm, request, {"threshold_pct": settings.USAGE_IDLE_THRESHOLD_PCT,
                                           "window_min": settings.USAGE_IDLE_WINDOW_S / 60})
    context = {
        "tenant": tenant, "range_form": range_form, "idle_form": idle_form, "budget_alert": current_alert(tenant),
        "can_stop": selectors.user_has_role(user=request.user, tenant=tenant, at_least=Role.MEMBER),
        "here": request.get_full_path(),
    }
    if not (range_form.is_valid() and idle_form.is_valid()):
        return render(request, "frontend/tenant_usage.html", context, status=400)
    start, end = range_form.cleaned_data["start"], range_form.cleaned_data["end"]
    begin, stop = pages.day_span(start, end, now)
    utilization = pages.tenant_utilization(tenant, begin, stop)
    daily = pages.daily_by_flavor(tenant, start, end, now)
    context.update(
        start=start, end=end, utilization=utilization, daily=daily,
        # Over the whole range, as the daily bars below it, though nothing is measured past now.
        utilization_chart=charts.line_chart([("mean over all GPUs", utilization["points"])], title="GPU utilization",
                                            unit="%", high=100, span=(begin, begin + timedelta(days=len(daily["days"])))),
        hours_chart=charts.stacked_bars(daily["days"], daily["hours"], title="GPU-hours", unit="GPU-h"),
        cost_chart=charts.stacked_bars(daily["days"], daily["cost"], title="Cost", unit=daily["currency"]),
        top=pages.top_items(tenant, start, end, now, user=request.user),
        workspaces=pages.tenant_workspaces(tenant, start, end, now, user=request.user),
        idle=pages.tenant_idle(tenant, threshold_pct=idle_form.cleaned_data["threshold_pct"],
                               window_s=idle_form.cleaned_data["window_min"] * 60),
        csv_url=reverse("usage") + "?" + urlencode({"start": start, "end": end, "group_by": "job,day",
                                                   "tenant": tenant.slug, "format": "csv"}),
    )
    return render(request, "frontend/tenant_usage.html", context)


@staff_required
@require_GET
def cluster_usage(request):
    """The cluster over a range: allocation, utilization, fragmentation now, idle capacity, cost per tenant."""
    now = timezone.now()
    range_form = _range(request, now)
    context = {"range_form": range_form}
    if not range_form.is_valid():
        return render(request, "frontend/cluster_usage.html", context, status=400)
    start, end = range_form.cleaned_data["start"], range_form.cleaned_data["end"]
    context.update(start=start, end=end, summary=pages.cluster_summary(start, end, now),
                   fragmentation=fragmentation_now())
    return render(request, "frontend/cluster_usage.html", context)
