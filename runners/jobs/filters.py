"""List filters for the jobs API (django-filter); an unknown choice is a 400 naming the parameter."""

import django_filters

from common.filters import StrictFilterSet
from runners.jobs.models import Job, JobState


class JobFilter(StrictFilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug", help_text="Only this tenant's jobs (its slug).")
    state = django_filters.ChoiceFilter(choices=JobState.choices, help_text="Only jobs in this state.")

    class Meta:
        model = Job
        fields = ["tenant", "state"]
