"""Forms of the staff pages (cockpit, queue, tenants, flavors, prices): shape only; the services decide."""

from decimal import Decimal

from django import forms

from common import nulls
from quotas.models import PartitionKind
from runners.nvidia.mig import GPU_MODELS
from runners.scheduling.cockpit import QUEUE_STATES
from tenants.models import TENANT_SLUG_MAX, dns_label_validator


def _gpu_models():
    return [(name, name) for name in GPU_MODELS]


class TenantCreateForm(forms.Form):
    slug = forms.CharField(
        max_length=TENANT_SLUG_MAX, validators=[dns_label_validator],
        help_text=f"Lowercase letters, digits and '-', up to {TENANT_SLUG_MAX}; it starts every namespace of the tenant "
                  "and cannot change.",
        widget=forms.TextInput(attrs={"placeholder": "e.g. ml-research", "autocomplete": "off"}),
    )
    name = forms.CharField(max_length=100, widget=forms.TextInput(attrs={"placeholder": "e.g. ML Research"}))


class FlavorForm(forms.Form):
    name = forms.RegexField(
        regex=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=63,
        error_messages={"invalid": "Use lowercase letters, digits, '-' and '.', starting and ending alphanumeric."},
        widget=forms.TextInput(attrs={"placeholder": "e.g. h100-80gb", "autocomplete": "off"}),
    )
    kind = forms.ChoiceField(choices=PartitionKind.choices, initial=PartitionKind.WHOLE)
    gpu_model = forms.ChoiceField(choices=_gpu_models, label="GPU model")
    mig_profile = forms.CharField(
        max_length=20, required=False, label="MIG profile", help_text="MIG flavors only, e.g. 3g.40gb.",
        widget=forms.TextInput(attrs={"autocomplete": "off"}),
    )
    description = forms.CharField(max_length=200, required=False)


class PriceCardForm(forms.Form):
    flavor = nulls.ModelChoiceField(queryset=None, to_field_name="name", empty_label="Choose a flavor")
    price_per_hour = forms.DecimalField(
        min_value=Decimal("0"), max_digits=10, decimal_places=4, label="Price per hour",
        help_text="Per unit of the flavor (a GPU, a MIG slice or a time-slice share).",
    )
    currency = forms.RegexField(
        regex=r"^[A-Za-z]{3}$", initial="USD", max_length=3,
        error_messages={"invalid": "Use a 3-letter ISO 4217 code."},
    )
    effective_from = forms.DateTimeField(
        required=False, label="Effective from (UTC)",
        help_text="Empty: now. Usage from this moment on is repriced with this card.",
        widget=forms.DateTimeInput(attrs={"placeholder": "YYYY-MM-DD HH:MM"}),
    )

    def __init__(self, *args, flavors, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["flavor"].queryset = flavors
        self.fields["price_per_hour"].widget.attrs["inputmode"] = "decimal"


class FlavorDescriptionForm(forms.Form):
    flavor = nulls.ModelChoiceField(queryset=None, to_field_name="name", empty_label="Choose a flavor")
    description = forms.CharField(max_length=200, required=False,
                                  help_text="What teams read next to the flavor's name; empty: none.")

    def __init__(self, *args, flavors, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["flavor"].queryset = flavors


class QueueFilterForm(forms.Form):
    """The queue's filters, read from the query string; a bad value is named, never a 500."""

    tenant = nulls.ModelChoiceField(queryset=None, to_field_name="slug", required=False, empty_label="Every tenant")
    state = forms.ChoiceField(choices=[("", "Every state"), *[(state, state) for state in QUEUE_STATES]], required=False)

    def __init__(self, *args, tenants, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["tenant"].queryset = tenants
        self.fields["tenant"].label_from_instance = lambda tenant: f"{tenant.name} ({tenant.slug})"
