"""A tenant's checkpoint storage page: its quota, what the store holds of it after deduplication, and its
retention policy with a form whose preview says what the policy would delete and free before it is saved."""

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from common.errors import Invalid
from frontend.forms import refusals_on
from quotas.storage_services import UNCHANGED, tenant_storage_set
from runners.jobs import storage_selectors
from tenants import selectors

COUNT_MAX = 1_000_000


class RetentionForm(forms.Form):
    """A retention policy: each rule off when left empty; all empty keeps everything."""

    keep_newest = forms.IntegerField(required=False, min_value=0, max_value=COUNT_MAX, label="Keep the newest",
                                     help_text="The N checkpoints of each job's highest steps. Empty: off.")
    keep_best = forms.IntegerField(required=False, min_value=0, max_value=COUNT_MAX, label="Keep the best",
                                   help_text="The M with the lowest reported loss. Empty: off.")
    keep_every = forms.IntegerField(required=False, min_value=1, max_value=COUNT_MAX, label="Keep every K-th",
                                    help_text="Every K-th checkpoint a job wrote, counted over its whole history. "
                                              "Empty: off.")

    def policy(self) -> dict | None:
        chosen = {name: self.cleaned_data.get(name) for name in ("keep_newest", "keep_best", "keep_every")}
        return None if all(value is None for value in chosen.values()) else chosen


class QuotaForm(forms.Form):
    quota_gb = forms.DecimalField(required=False, min_value=0, max_digits=12, decimal_places=3, label="Quota (GB)",
                                  help_text="GB (10^9 bytes) of the store after deduplication. Empty: no limit.")


def decimal_size(size: int | None) -> str:
    """Bytes in the units the quota is set in: kB, MB, GB, TB of powers of 1000 (10^9 bytes a GB)."""
    if size is None:
        return ""
    value = float(size)
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{size} bytes" if unit == "bytes" else f"{value:.1f}\xa0{unit}"
        value /= 1000
    return f"{size} bytes"


def _sized(data: dict, *keys: str) -> dict:
    return {**data, **{f"{key}_text": decimal_size(data[key]) for key in keys}}


def _invalid_on(form: forms.Form, exc: Invalid) -> None:
    # The service names a policy's field as "retention.keep_newest"; the form's is "keep_newest".
    name = exc.field.rpartition(".")[2]
    form.add_error(name if name in form.fields else None, exc.messages)


@login_required
@require_http_methods(["GET", "POST"])
def tenant_storage(request, slug):
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    summary = _sized(storage_selectors.storage_summary(user=request.user, tenant=tenant),
                     "used_bytes", "quota_bytes", "durable_file_bytes")
    initial = {key: value for key, value in (summary["retention"] or {}).items() if key.startswith("keep_")}
    retention_form, quota_form, preview, status = RetentionForm(initial=initial), None, None, 200
    if summary["can_set_quota"]:
        quota_form = QuotaForm(initial={"quota_gb": summary["quota_gb"]})
    action = request.POST.get("action")
    if action in ("preview", "save"):
        retention_form = RetentionForm(request.POST)
        if retention_form.is_valid():
            try:
                with refusals_on(retention_form):
                    if action == "preview":
                        preview = _sized(storage_selectors.retention_preview(
                            user=request.user, tenant=tenant, policy=retention_form.policy()),
                            "bytes_freed", "file_bytes", "stored_bytes")
                        preview["jobs"] = [_sized(job, "file_bytes") for job in preview["jobs"]]
                    else:
                        tenant_storage_set(actor=request.user, tenant=tenant, retention_policy=retention_form.policy())
                        messages.success(request, f"Saved {tenant.name}'s retention policy.")
                        return redirect("tenant-storage", slug=tenant.slug)
            except Invalid as exc:
                _invalid_on(retention_form, exc)
        status = 400 if retention_form.errors else 200
    elif action == "quota" and quota_form is not None:
        quota_form = QuotaForm(request.POST)
        if quota_form.is_valid():
            try:
                with refusals_on(quota_form):
                    tenant_storage_set(actor=request.user, tenant=tenant, quota_gb=quota_form.cleaned_data["quota_gb"],
                                       retention_policy=UNCHANGED)
                    messages.success(request, f"Saved {tenant.name}'s storage quota.")
                    return redirect("tenant-storage", slug=tenant.slug)
            except ValidationError as exc:
                quota_form.add_error(None, exc)
        status = 400
    return render(request, "frontend/tenant_storage.html", {
        "tenant": tenant, "summary": summary, "form": retention_form, "quota_form": quota_form, "preview": preview,
    }, status=status)
