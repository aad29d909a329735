"""List filters for the runners API (django-filter); an unknown choice is a 400 naming the parameter."""

import django_filters

from portal.filters import StrictFilterSet
from runners.models import Environment, EnvironmentState, Job, JobState


class EnvironmentFilter(StrictFilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug", help_text="Only this tenant's environments (its slug).")
    state = django_filters.ChoiceFilter(
        choices=EnvironmentState.choices, help_text="Only this state; deleted ones are listed only when asked for."
    )

    class Meta:
        model = Environment
        fields = ["tenant", "state"]


class JobFilter(StrictFilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug", help_text="Only this tenant's jobs (its slug).")
    state = django_filters.ChoiceFilter(choices=JobState.choices, help_text="Only jobs in this state.")

    class Meta:
        model = Job
        fields = ["tenant", "state"]
