"""REST API of utilization and cost: usage rows (JSON or CSV), utilization series, idle allocations, budgets."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta

from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from common.errors import NotFound
from quotas.models import ResourceFlavor
from runners.inference.selectors import endpoint_get
from runners.jobs.selectors import job_get
from runners.usage import ledger, sampling, services
from runners.usage.currencies import is_currency
from runners.usage.models import Budget, CloudPrice
from runners.usage.selectors import GROUPS, budget_alerts, usage_rows, visible_tenants
from tenants.selectors import tenant_get

USAGE_COLUMNS = ["tenant", "flavor", "job", "endpoint", "day", "kind", "gpu_hours", "storage_gb_months", "cost",
                 "cloud_cost", "currency"]
MAX_RANGE_DAYS = 400


class CSVRenderer(BaseRenderer):
    """Usage rows as CSV, the columns in the JSON's order (errors stay JSON: see UsageView.finalize_response)."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None) -> bytes:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(USAGE_COLUMNS)
        for row in data:
            writer.writerow(["" if row.get(column) is None else row[column] for column in USAGE_COLUMNS])
        return out.getvalue().encode(self.charset)


class _QueryParameters(serializers.Serializer):
    """A parameter given empty (`?start=`) is refused, naming it: a query dict hands DRF an empty string as
    if the parameter were absent, which would quietly apply its default."""

    def validate(self, data: dict) -> dict:
        empty = {name: "Give a value, or leave the parameter out." for name in self.fields
                 if name in self.initial_data and self.initial_data.get(name) == ""}
        if empty:
            raise serializers.ValidationError(empty)
        return super().validate(data)


class UsageQuery(_QueryParameters):
    start = serializers.DateField(required=False, help_text="First UTC day, included (default: the month's first).")
    end = serializers.DateField(required=False, help_text="Last UTC day, included (default: today).")
    group_by = serializers.CharField(
        required=False, default="tenant",
        help_text=f"Comma-separated, any of: {', '.join(GROUPS)}. The keys not grouped by are null.",
    )
    tenant = serializers.SlugField(required=False, help_text="One tenant's slug (staff may name any).")
    idle = serializers.BooleanField(required=False, default=True,
                                    help_text="Staff, no tenant named: add the cluster's idle capacity line.")

    def validate_group_by(self, value: str) -> tuple[str, ...]:
        groups = tuple(dict.fromkeys(part.strip() for part in value.split(",") if part.strip()))
        unknown = [group for group in groups if group not in GROUPS]
        if unknown or not groups:
            raise serializers.ValidationError(f"Group by any of {', '.join(GROUPS)}; not {', '.join(unknown) or value!r}.")
        return groups

    def validate(self, data: dict) -> dict:
        data = super().validate(data)
        today = ledger.utc_day(timezone.now())
        data.setdefault("end", today)
        data.setdefault("start", data["end"].replace(day=1))
        if data["start"] > data["end"]:
            raise serializers.ValidationError({"start": "start is after end."})
        if (data["end"] - data["start"]).days >= MAX_RANGE_DAYS:
            raise serializers.ValidationError({"end": f"A range is at most {MAX_RANGE_DAYS} days."})
        return data


UsageRow = inline_serializer("UsageRow", many=True, fields={
    "tenant": serializers.CharField(allow_null=True), "flavor": serializers.CharField(allow_null=True),
    "job": serializers.IntegerField(allow_null=True),
    "endpoint": serializers.IntegerField(allow_null=True, help_text="An endpoint's replicas count as the endpoint."),
    "day": serializers.DateField(allow_null=True),
    "kind": serializers.ChoiceField(["gpu", "storage", "idle"], allow_null=True),
    "gpu_hours": serializers.DecimalField(max_digits=20, decimal_places=4),
    "storage_gb_months": serializers.DecimalField(max_digits=20, decimal_places=4),
    "cost": serializers.DecimalField(max_digits=20, decimal_places=2),
    "cloud_cost": serializers.DecimalField(max_digits=20, decimal_places=2, allow_null=True,
                                           help_text="The same GPU-hours at the flavors' cloud reference prices."),
    "currency": serializers.CharField(),
})


class UsageView(APIView):
    """GPU-hours and cost, grouped; tenants see their own, staff everyone's and the cluster's idle line."""

    not_found_when = "the tenant named is not one this account belongs to"

    renderer_classes = [JSONRenderer, CSVRenderer]

    def finalize_response(self, request, response, *args, **kwargs):
        # Only rows are CSV: an error answer, or OPTIONS' description, is JSON whatever format was asked.
        if not isinstance(getattr(response, "data", None), list):
            request.accepted_renderer, request.accepted_media_type = JSONRenderer(), JSONRenderer.media_type
        return super().finalize_response(request, response, *args, **kwargs)

    @extend_schema(parameters=[UsageQuery], responses={200: UsageRow})
    def get(self, request, *args, **kwargs):
        if request.query_params.get("format") == "":
            raise serializers.ValidationError({"format": "Give csv or json, or leave the parameter out."})
        query = UsageQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        params = query.validated_data
        tenants = visible_tenants(request.user, params.get("tenant"))
        rows = usage_rows(start=params["start"], end=params["end"], group_by=params["group_by"], tenants=tenants,
                          include_idle=params["idle"] and request.user.is_staff)
        response = Response(rows)
        if request.accepted_renderer.format == "csv":
            name = f"usage-{params['start']}-{params['end']}.csv"
            response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response


class UtilizationQuery(_QueryParameters):
    job = serializers.IntegerField(required=False, min_value=1, help_text="A job (or one replica of an endpoint).")
    endpoint = serializers.IntegerField(required=False, min_value=1, help_text="Every replica of an endpoint.")
    start = serializers.DateTimeField(required=False, help_text="Default: 24 hours before end.")
    end = serializers.DateTimeField(required=False, help_text="Default: now.")

    def validate(self, data: dict) -> dict:
        data = super().validate(data)
        if ("job" in data) == ("endpoint" in data):
            raise serializers.ValidationError({"job": "Name a job or an endpoint (one of them)."})
        data.setdefault("end", timezone.now())
        if "start" not in data:
            if data["end"] - datetime.min.replace(tzinfo=UTC) < timedelta(days=1):
                raise serializers.ValidationError({"end": "end is too early to start a day before it; give start."})
            data["start"] = data["end"] - timedelta(days=1)
        if data["start"] >= data["end"]:
            raise serializers.ValidationError({"start": "start is not before end."})
        if data["end"] - data["start"] > timedelta(days=MAX_RANGE_DAYS):
            raise serializers.ValidationError({"end": f"A range is at most {MAX_RANGE_DAYS} days."})
        return data


UtilizationPoints = inline_serializer("UtilizationPoint", many=True, fields={
    "at": serializers.DateTimeField(), "resolution": serializers.ChoiceField(["raw", "5m", "1h"]),
    "gpu_util_pct": serializers.FloatField(allow_null=True), "memory_used_mib": serializers.FloatField(allow_null=True),
    "power_w": serializers.FloatField(allow_null=True),
})
UtilizationAnswer = inline_serializer("Utilization", fields={
    "start": serializers.DateTimeField(), "end": serializers.DateTimeField(),
    "series": inline_serializer("UtilizationSeries", many=True, fields={
        "job": serializers.IntegerField(), "attempt": serializers.IntegerField(), "rank": serializers.IntegerField(),
        "device": serializers.CharField(), "source": serializers.ChoiceField(["nvml", "dcgm", "simulated"]),
        "simulated": serializers.BooleanField(), "points": UtilizationPoints,
    }),
})


class UtilizationView(APIView):
    """Utilization, memory and power per replica and device over time (simulated GPUs say so)."""

    not_found_when = "the job or endpoint named does not exist or is not visible to this account"

    @extend_schema(parameters=[UtilizationQuery], responses={200: UtilizationAnswer})
    def get(self, request, *args, **kwargs):
        query = UtilizationQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        params = query.validated_data
        if "job" in params:
            job_ids = [job_get(user=request.user, job_id=params["job"]).id]
        else:
            endpoint = endpoint_get(user=request.user, endpoint_id=params["endpoint"])
            job_ids = list(endpoint.replicas.values_list("job_id", flat=True))
        return Response({"start": params["start"].isoformat(), "end": params["end"].isoformat(),
                         "series": sampling.series(job_ids, params["start"], params["end"])})


class IdleQuery(_QueryParameters):
    tenant = serializers.SlugField(required=False)
    threshold_pct = serializers.FloatField(required=False, min_value=0, max_value=100)
    window_s = serializers.FloatField(required=False, min_value=1, max_value=7 * 86400)


IdleRow = inline_serializer("IdleAllocation", many=True, fields={
    "tenant": serializers.CharField(), "job": serializers.IntegerField(), "name": serializers.CharField(),
    "endpoint": serializers.IntegerField(allow_null=True), "attempt": serializers.IntegerField(),
    "flavor": serializers.CharField(), "units": serializers.IntegerField(),
    "average_util_pct": serializers.FloatField(allow_null=True, help_text="Null: no reading in the window."),
    "peak_util_pct": serializers.FloatField(allow_null=True, help_text="Null: no reading in the window."),
    "samples": serializers.IntegerField(help_text="0: the workload stopped reporting (counted idle)."),
    "simulated": serializers.BooleanField(),
})


class IdleView(APIView):
    """Allocations whose every device stayed under the threshold for the whole window."""

    not_found_when = "the tenant named is not one this account belongs to"

    @extend_schema(parameters=[IdleQuery], responses={200: IdleRow})
    def get(self, request, *args, **kwargs):
        query = IdleQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        params = query.validated_data
        tenants = visible_tenants(request.user, params.get("tenant"))
        idle = sampling.idle_allocations(
            tenant_ids=None if tenants is None else {tenant.id for tenant in tenants},
            threshold_pct=params.get("threshold_pct"), window_s=params.get("window_s"),
        )
        return Response([{
            "tenant": item.job.tenant.slug, "job": item.job.id, "name": item.job.name, "endpoint": item.endpoint_id,
            "attempt": item.attempt, "flavor": item.job.flavor.name, "units": item.units,
            "average_util_pct": None if item.average_util_pct is None else round(item.average_util_pct, 2),
            "peak_util_pct": None if item.peak_util_pct is None else round(item.peak_util_pct, 2),
            "samples": item.samples, "simulated": item.simulated,
        } for item in idle])


AlertRow = inline_serializer("BudgetAlert", many=True, fields={
    "tenant": serializers.CharField(), "month": serializers.CharField(help_text="YYYY-MM"),
    "threshold_pct": serializers.IntegerField(), "spent": serializers.DecimalField(max_digits=14, decimal_places=2),
    "budget": serializers.DecimalField(max_digits=14, decimal_places=2), "currency": serializers.CharField(),
    "at": serializers.DateTimeField(), "mailed_to": serializers.IntegerField(help_text="How many people were mailed."),
})


class BudgetAlertView(APIView):
    """Budget events: a tenant's month crossing 80% or 100% of its budget."""

    not_found_when = "the tenant named is not one this account belongs to"

    @extend_schema(parameters=[OpenApiParameter("tenant", str)], responses={200: AlertRow})
    def get(self, request, *args, **kwargs):
        tenants = visible_tenants(request.user, request.query_params.get("tenant"))
        return Response([{
            "tenant": alert.tenant.slug, "month": alert.month.isoformat()[:7], "threshold_pct": alert.threshold,
            "spent": str(alert.spent), "budget": str(alert.budget), "currency": alert.currency,
            "at": alert.at.isoformat(), "mailed_to": len(alert.mailed_to),
        } for alert in budget_alerts(tenants)[:200]])


def _iso_4217(value: str) -> None:
    if not is_currency(value):
        raise serializers.ValidationError(f"{value} is not an ISO 4217 currency code (USD, EUR, JPY, ...).")


def _currency_field() -> serializers.RegexField:
    return serializers.RegexField(r"^[A-Z]{3}$", default="USD", validators=[_iso_4217],
                                  error_messages={"invalid": "Use a 3-letter ISO 4217 code in capitals."})


class BudgetSerializer(serializers.ModelSerializer):
    tenant = serializers.CharField(source="tenant.slug", read_only=True)
    currency = _currency_field()

    class Meta:
        model = Budget
        fields = ["tenant", "monthly_amount", "currency", "stop_borrowing", "updated_at"]
        read_only_fields = ["updated_at"]


class BudgetView(APIView):
    """A tenant's monthly budget: its members read it, staff set it (PUT) or remove it (DELETE)."""

    @extend_schema(responses={200: BudgetSerializer})
    def get(self, request, slug: str):
        budget = Budget.objects.filter(tenant=tenant_get(user=request.user, slug=slug)).first()
        if budget is None:
            raise NotFound(f"Tenant {slug} has no budget.")
        return Response(BudgetSerializer(budget).data)

    @extend_schema(request=BudgetSerializer, responses={200: BudgetSerializer})
    def put(self, request, slug: str):
        tenant = tenant_get(user=request.user, slug=slug)
        serializer = BudgetSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        budget = services.budget_set(actor=request.user, tenant=tenant, **serializer.validated_data)
        return Response(BudgetSerializer(budget).data)

    @extend_schema(responses={204: None})
    def delete(self, request, slug: str):
        if not services.budget_remove(actor=request.user, tenant=tenant_get(user=request.user, slug=slug)):
            raise NotFound(f"Tenant {slug} has no budget.")
        return Response(status=204)


class CloudPriceSerializer(serializers.ModelSerializer):
    flavor = serializers.SlugRelatedField(slug_field="name", queryset=ResourceFlavor.objects.all())
    currency = _currency_field()
    effective_from = serializers.DateTimeField(required=False)

    class Meta:
        model = CloudPrice
        fields = ["id", "flavor", "price_per_hour", "currency", "provider", "effective_from"]
        validators = []  # the one-per-start rule is answered as a 400 naming effective_from (the service)


class CloudPriceView(APIView):
    """Cloud reference prices per flavor: what a flavor's unit-hour would cost elsewhere. Anyone reads; staff add."""

    @extend_schema(responses={200: CloudPriceSerializer(many=True)})
    def get(self, request):
        return Response(CloudPriceSerializer(CloudPrice.objects.select_related("flavor")[:500], many=True).data)

    @extend_schema(request=CloudPriceSerializer, responses={201: CloudPriceSerializer})
    def post(self, request):
        serializer = CloudPriceSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        price = services.cloud_price_add(actor=request.user, **serializer.validated_data)
        return Response(CloudPriceSerializer(price).data, status=201)
