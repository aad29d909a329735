"""List filters for the quotas API (django-filter)."""

import django_filters

from common.filters import StrictFilterSet
from quotas.models import Quota


class QuotaFilter(StrictFilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug", help_text="Only this tenant's quotas (its slug).")
    flavor = django_filters.CharFilter(field_name="flavor__name", help_text="Only quotas for this flavor (its name).")

    class Meta:
        model = Quota
        fields = ["tenant", "flavor"]
