"""List filters for the environments API (django-filter); an unknown choice is a 400 naming the parameter."""

import django_filters

from common.filters import StrictFilterSet
from runners.environments.models import Environment, EnvironmentState


class EnvironmentFilter(StrictFilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug", help_text="Only this tenant's environments (its slug).")
    state = django_filters.ChoiceFilter(
        choices=EnvironmentState.choices, help_text="Only this state; deleted ones are listed only when asked for."
    )

    class Meta:
        model = Environment
        fields = ["tenant", "state"]
